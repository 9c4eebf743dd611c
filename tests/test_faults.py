"""Faults, each a real one, in a child process where it takes one: nothing lost, nothing silently wrong.

- kill -9 in the middle of a save: `latest` still names the previous checkpoint, which loads and resumes
  bitwise; the interrupted tag is refused as incomplete; the dead process's swap file is found and removed at
  the next start.
- A full disk during a save (a small tmpfs: ENOSPC; RLIMIT_FSIZE: EFBIG): a CheckpointIOError naming the file
  and the bytes, no checkpoint marked complete, no temporary file left, `latest` untouched, the engine's state
  unchanged: the save succeeds elsewhere and loads to the same state.
- A full disk during a swap-out (RLIMIT_FSIZE): the swap manager's typed error names the swap file, offset and
  bytes and the segment keeps its bytes; during training, the engine's state stays consistent: a checkpoint
  saved elsewhere holds exactly it (never a half-applied step: that save is refused), and the engine, given
  its last checkpoint back, trains on bitwise.
- A flipped byte in a swap file: ChecksumMismatchError naming the segment and the file, on the read that
  training does.
- Two processes with the same nvme_path and checkpoint directory (different tags): no clobbering.
- Swap files left by a killed process: found and reported at the next store start, removed only when provably
  stale; a live process's file (locked, or unlocked while its process runs) is never touched.
"""
from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import REPO_ROOT, child_env, mounted  # noqa: E402
from checkpoint_models import GAS, assert_same, build, snapshot, train  # noqa: E402

from tiering import ChecksumMismatchError, NvmeStore, NvmeStoreConfig  # noqa: E402
from tiering.stale import LOCKED, StaleSwapFileWarning, this_host  # noqa: E402
from zero.checkpoint.format import CheckpointIncompleteError, CheckpointIOError  # noqa: E402

THIS = os.path.abspath(__file__)
CONFIG = "stage3-bf16-nvme"
"""Every engine here: ZeRO-3, bf16, parameters and optimizer state on nvme (checkpoint_models.CONFIGS)."""
SWAPPING = {"sub_group_size": 2048, "tiering": {"host_budget": 128 << 10}}
"""Small sub-groups and a host budget that cannot hold all the state: every step swaps state out to nvme."""


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, THIS, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=child_env(), cwd=REPO_ROOT)


def read_until(child: subprocess.Popen, prefix: str, timeout: float = 120) -> str:
    """The first stdout line of `child` starting with `prefix` (the child prints it, then waits)."""
    deadline = time.monotonic() + timeout
    found: list[str] = []

    def reader() -> None:
        for line in child.stdout:
            if line.startswith(prefix):
                found.append(line.strip())
                return

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if not found:
        child.kill()
        _, err = child.communicate()
        raise AssertionError(f"child never printed {prefix!r} (rc {child.returncode}):\n{err[-4000:]}")
    return found[0][len(prefix):].strip()


def finish(child: subprocess.Popen, timeout: float = 120) -> str:
    try:
        out, err = child.communicate(timeout=timeout)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, f"child failed (rc {child.returncode}):\n{err[-4000:]}"
    return out


def _same(a: dict, b: dict) -> bool:
    try:
        assert_same(a, b)
        return True
    except AssertionError:
        return False


def tag_files(tag_dir) -> list[str]:
    return sorted(os.listdir(tag_dir)) if os.path.isdir(tag_dir) else []


# -- kill -9 in the middle of a save -----------------------------------------------------------------------------


@pytest.mark.parametrize("second", ["b", "a"])
def test_kill_9_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tmp_path, second):
    """Killed while saving its second checkpoint, under a new tag or again under the first's (as a preemption save
    and the loop's own save at one step do): `latest` and the first checkpoint are whole and resume bitwise."""
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    child = spawn("save-then-hang", str(nvme), str(ckpt), second)
    partial = read_until(child, "IN-SAVE")  # the child is writing the second save's data file, and will never finish
    os.kill(child.pid, signal.SIGKILL)
    child.communicate()
    assert child.returncode == -signal.SIGKILL
    swap_left = [n for n in os.listdir(nvme) if n.endswith(".swap")]
    assert len(swap_left) == 1, "the killed process left its swap file"

    assert (ckpt / "latest").read_text() == "a"
    assert os.path.exists(partial) and os.path.getsize(partial) > 0, "killed while its data file was being written"
    assert ("manifest.json" in tag_files(ckpt / second)) == (second == "a")
    with pytest.warns(StaleSwapFileWarning, match="removed 1 stale swap file") as record:
        engine = build(CONFIG, str(nvme))  # restart on the same nvme_path: the dead process's file goes
    stale = [w for w in record if issubclass(w.category, StaleSwapFileWarning)]  # (a slow dtype's warns too)
    assert swap_left[0] in str(stale[0].message) and not os.path.exists(nvme / swap_left[0])
    try:
        if second == "b":
            with pytest.raises(CheckpointIncompleteError, match="incomplete"):
                engine.load_checkpoint(ckpt, tag="b")
        path, client_state = engine.load_checkpoint(ckpt)  # latest: a
        assert path == str(ckpt / "a") and client_state == {"saved": "a"}
        train(engine, 2)
        resumed = snapshot(engine)
        engine.save_checkpoint(ckpt, tag="c")  # the killed save's temporary file goes, whichever tag it was under
        assert not os.path.exists(partial)
    finally:
        engine.close()
    engine = build(CONFIG, str(nvme))
    try:
        train(engine, 4)
        assert_same(snapshot(engine), resumed)  # 2 steps, saved, killed later, loaded, 2 steps == 4 steps
    finally:
        engine.close()
    assert os.listdir(nvme) == []


def child_save_then_hang(nvme: str, ckpt: str, second: str) -> None:
    from zero.checkpoint import format as checkpoint_manifest

    engine = build(CONFIG, nvme)
    train(engine, 2)
    engine.save_checkpoint(ckpt, tag="a", client_state={"saved": "a"})
    train(engine, 1)
    write = checkpoint_manifest.AtomicFile.write

    def write_then_hang(self, data):
        start = write(self, data)
        if self.name.endswith(".data") and self.size > 4096:
            print(f"IN-SAVE {self.temp_path}", flush=True)
            time.sleep(600)
        return start

    checkpoint_manifest.AtomicFile.write = write_then_hang
    engine.save_checkpoint(ckpt, tag=second, client_state={"saved": "second"})


# -- a full disk during a save --------------------------------------------------------------------------------------


def checkpoint_bytes(tmp_path) -> int:
    engine = build(CONFIG, str(tmp_path))
    try:
        directory = engine.save_checkpoint(tmp_path / "probe", tag="p")
        return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))
    finally:
        engine.close()


def test_full_disk_during_a_save(tmp_path):
    """A tmpfs with room for one checkpoint: the second save fails with ENOSPC part way."""
    size = checkpoint_bytes(tmp_path)
    with mounted("tmpfs", f"size={(size * 3 // 2 + 8192) // 4096 * 4096}") as disk:
        engine = build(CONFIG, str(tmp_path))
        try:
            train(engine, 1)
            engine.save_checkpoint(disk, tag="a")
            train(engine, 1)
            before = snapshot(engine)
            with pytest.raises(CheckpointIOError) as info:
                engine.save_checkpoint(disk, tag="b")
            err = info.value
            assert err.errno == errno.ENOSPC and err.nbytes > 0
            assert err.path.startswith(os.path.join(disk, "b", "rank00000-of-00001."))
            assert err.path in str(err) and f"{err.nbytes} bytes" in str(err)
            assert tag_files(os.path.join(disk, "b")) == [], "no manifest, no temporary file left behind"
            assert (Path(disk) / "latest").read_text() == "a"
            assert_same(before, snapshot(engine))  # nothing in memory changed
            engine.save_checkpoint(tmp_path / "elsewhere", tag="b")  # the save can be made elsewhere
        finally:
            engine.close()
        fresh = build(CONFIG, str(tmp_path))
        try:
            fresh.load_checkpoint(tmp_path / "elsewhere")
            assert_same(before, snapshot(fresh))
            fresh.load_checkpoint(disk)  # and the checkpoint before the full disk still loads
            assert fresh.global_steps == 1
        finally:
            fresh.close()


# -- a full disk during a swap-out -----------------------------------------------------------------------------


def test_full_disk_during_a_swap_out_names_the_file_and_keeps_the_bytes(tmp_path):
    """The swap manager alone, under RLIMIT_FSIZE: writing a dirty segment back fails with IOFailedError; the
    segment's current bytes stay readable; once there is room the write-back succeeds and reads back."""
    out = json.loads(finish(spawn("swap-out-rlimit", str(tmp_path))).strip().splitlines()[-1])
    assert out["error"] == "IOFailedError" and out["errno"] == errno.EFBIG
    assert out["path"] == out["store"] and out["path"] in out["message"]
    assert out["nbytes"] > 0 and f"{out['nbytes']} bytes" in out["message"] and out["offset"] >= 64 << 10
    assert out["kept_after_failure"] and out["kept_after_retry"] and out["other_intact"]
    assert out["removed"]


def child_swap_out_rlimit(directory: str) -> None:
    import resource

    from tiering import IOFailedError, SwapConfig, SwapManager

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing us
    n = 16 << 10  # 64 KiB of fp32 per segment
    manager = SwapManager(SwapConfig(host_budget=1 << 20, nvme=NvmeStoreConfig(nvme_path=directory, grow_step=1 << 20)))
    first, second = torch.arange(n, dtype=torch.float32), torch.arange(n, dtype=torch.float32) * 2
    manager.register("first", dtype=torch.float32, shape=(n,), home="nvme", data=first).wait()
    manager.register("second", dtype=torch.float32, shape=(n,), home="nvme", data=second).wait()
    manager.acquire("second", "host").add_(1)  # dirty: only the host copy holds these bytes now
    manager.release("second", dirty=True)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))  # "second" lies past 64 KiB in the store file
    out = {"store": manager.store.path}
    try:
        manager.evict("second").wait()
        out["error"] = None
    except IOFailedError as exc:
        out.update(error=type(exc).__name__, errno=exc.errno, path=exc.path, offset=exc.offset, nbytes=exc.nbytes,
                   message=str(exc))
    out["kept_after_failure"] = bool(torch.equal(manager.acquire("second", "host"), second + 1))
    manager.release("second")
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    manager.evict("second").wait()  # room again: the write-back succeeds
    manager.evict("first").wait()
    out["kept_after_retry"] = bool(torch.equal(manager.acquire("second", "host"), second + 1))  # read from nvme
    manager.release("second")
    out["other_intact"] = bool(torch.equal(manager.acquire("first", "host"), first))
    manager.release("first")
    manager.close()
    out["removed"] = not os.path.exists(out["store"])
    print(json.dumps(out))


LIMIT = 64 << 10
"""RLIMIT_FSIZE in the child: no file of its may reach past 64 KiB (the swap file and the checkpoint's are larger)."""


@pytest.fixture(scope="module")
def under_rlimit(tmp_path_factory):
    """One child, faults under RLIMIT_FSIZE (see child_rlimit). Returns (root, its report)."""
    root = tmp_path_factory.mktemp("rlimit")
    proc = subprocess.run([sys.executable, THIS, "rlimit", str(root)], capture_output=True, text=True,
                          timeout=240, env=child_env(), cwd=REPO_ROOT)
    assert proc.returncode == 0, f"child failed (rc {proc.returncode}; killed by SIGXFSZ?):\n{proc.stderr[-4000:]}"
    return root, json.loads(proc.stdout.strip().splitlines()[-1])


def test_file_size_limit_during_a_save(under_rlimit):
    root, out = under_rlimit
    save = out["save"]
    assert save["error"] == "CheckpointIOError" and save["errno"] == errno.EFBIG
    data = re.escape(str(root / "ckpt" / "a" / "rank00000-of-00001.")) + r"[0-9a-f]{8}\.data"  # (this save's id)
    assert re.fullmatch(data, save["path"])
    assert save["path"] in save["message"] and f"{save['nbytes']} bytes" in save["message"]
    assert save["offset"] == LIMIT  # everything up to the limit was written, not a byte more
    assert save["left"] == [] and not save["latest"], "nothing marked complete, nothing left behind"
    assert save["state_unchanged"]


def test_full_disk_during_a_training_swap_out_leaves_the_engine_consistent(under_rlimit):
    """A training step whose swap-outs cannot reach the file fails with the swap manager's typed error. Once
    there is room again: a checkpoint saved elsewhere holds exactly the engine's state, which is the last
    completed step (or, if the fault left gradients unapplied or a step half-applied, the save refuses and
    marks nothing complete); and the engine, given its last checkpoint back, trains on bitwise."""
    root, out = under_rlimit
    fault = out.get("fault", {"hung": True})
    if fault.get("hung"):
        pytest.fail("the training step hung when a swap-out hit the full disk: the error must surface")
    assert fault["error"] in ("IOFailedError", "StoreFullError") and fault["errno"] == errno.EFBIG
    assert fault["path"].endswith(".swap") and fault["path"] in fault["message"] and "bytes" in fault["message"]
    before = torch.load(root / "before.pt", weights_only=False)
    if out["saved_elsewhere"] == "ok":
        after_fault = torch.load(root / "after_fault.pt", weights_only=False)
        for key, value in before.items():  # no optimizer step went half way: the tensors are the last step's
            if key.split("/")[0] in ("param", "master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(value, after_fault[key]), key
        engine = build(CONFIG, str(root), **SWAPPING)
        try:
            engine.load_checkpoint(root / "elsewhere")
            assert_same(after_fault, snapshot(engine))
        finally:
            engine.close()
    else:
        assert "not yet applied" in out["saved_elsewhere"] and "half-applied" in out["saved_elsewhere"]
        assert "manifest.json" not in tag_files(root / "elsewhere" / "b")
    engine = build(CONFIG, str(root), **SWAPPING)
    try:
        train(engine, 2)
        assert_same(snapshot(engine), torch.load(root / "recovered.pt", weights_only=False))
    finally:
        engine.close()


def child_rlimit(root: str) -> None:
    """One step, a complete checkpoint (`good`), all state written back; then under the limit a save (fails on
    the checkpoint file) and, with room again, a look at the state; then under the limit a step (fails on a
    swap-out; reported after 10 s if stuck); then with room again a save elsewhere, and recovery: the
    last checkpoint loaded into the same engine, and the step trained again."""
    import resource

    from tiering import TieringError
    from zero.checkpoint.format import CheckpointBoundaryError

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, instead of killing us
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    out: dict = {}

    def limit(on: bool) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT if on else hard, hard))

    os.makedirs(os.path.join(root, "nvme"))
    engine = build(CONFIG, os.path.join(root, "nvme"), **SWAPPING)
    train(engine, 1)
    engine.save_checkpoint(os.path.join(root, "good"))
    for name, segment in list(engine.swap.segments.items()):
        if segment.home == "nvme":
            engine.swap.evict(name).wait()  # all written back: the save below swaps nothing out
    before = snapshot(engine)
    torch.save(before, os.path.join(root, "before.pt"))
    limit(True)
    try:
        engine.save_checkpoint(os.path.join(root, "ckpt"), tag="a")
        out["save"] = {"error": None}
    except CheckpointIOError as exc:
        out["save"] = {"error": type(exc).__name__, "errno": exc.errno, "path": exc.path, "offset": exc.offset,
                       "nbytes": exc.nbytes, "message": str(exc)}
    out["save"]["left"] = tag_files(os.path.join(root, "ckpt", "a"))
    out["save"]["latest"] = os.path.exists(os.path.join(root, "ckpt", "latest"))
    limit(False)
    out["save"]["state_unchanged"] = _same(before, snapshot(engine))  # (a snapshot swaps: not under the limit)

    def hung() -> None:  # the main thread is stuck in the swap manager: report and go
        out["fault"] = {"hung": True}
        print(json.dumps(out), flush=True)
        os._exit(0)

    limit(True)
    watchdog = threading.Timer(10.0, hung)
    watchdog.start()
    try:
        train(engine, 1)
        out["fault"] = {"error": None}
    except TieringError as exc:
        out["fault"] = {"error": type(exc).__name__, "errno": getattr(exc, "errno", None),
                        "path": getattr(exc, "path", ""), "message": str(exc)}
    finally:
        watchdog.cancel()
        limit(False)
    try:
        engine.save_checkpoint(os.path.join(root, "elsewhere"), tag="b")
        out["saved_elsewhere"] = "ok"
        torch.save(snapshot(engine), os.path.join(root, "after_fault.pt"))
    except CheckpointBoundaryError as exc:
        out["saved_elsewhere"] = str(exc)
    engine.load_checkpoint(os.path.join(root, "good"))  # recovery, in the same process
    train(engine, 1)
    torch.save(snapshot(engine), os.path.join(root, "recovered.pt"))
    engine.close()
    print(json.dumps(out), flush=True)


# -- a flipped byte in a swap file ------------------------------------------------------------------------------


@pytest.mark.parametrize("moments", ["fp32", "int8"])
def test_a_flipped_byte_in_a_swap_file_is_detected_and_named(moments, tmp_path):
    """Exact and compact state alike: the byte flipped is in a first moment (an int8 one: in a block's absmax; the
    model 64 wide, so that its embedding has the 4096 elements int8 moments need)."""
    engine = build(CONFIG, str(tmp_path), tiering={"moments": moments}, dim=64)
    try:
        sg = next(sg for sg in engine.driver.sub_groups if moments in sg.codecs.exp_avg.name)
        tiles = getattr(sg.codecs.exp_avg, "tiles", ())  # int8 tiles beside fp32 ones: flip an int8 tile's absmax
        at = next((tile.offset for tile in tiles if tile.codec.name == "int8"), 100)
        name = sg.segment("exp_avg")
        segment = engine.swap.segments[name]
        assert segment.state.tier == "nvme"
        fd = os.open(engine.swap.store.path, os.O_RDWR)
        try:
            offset = segment.extent.offset + at + 1
            byte = os.pread(fd, 1, offset)
            os.pwrite(fd, bytes([byte[0] ^ 0x01]), offset)
            os.fsync(fd)
        finally:
            os.close(fd)
        with pytest.raises(ChecksumMismatchError) as info:
            train(engine, 1)  # the optimizer step reads it
        assert info.value.what == name and name in str(info.value)
        assert info.value.path == engine.swap.store.path and engine.swap.store.path in str(info.value)
    finally:
        engine.close()


# -- two processes, one nvme_path, one checkpoint directory ----------------------------------------------------------


def test_two_processes_share_an_nvme_path_and_a_checkpoint_directory(tmp_path):
    nvme, ckpt, go = tmp_path / "nvme", tmp_path / "ckpt", tmp_path / "go"
    nvme.mkdir()
    children = [spawn("share", str(nvme), str(ckpt), str(go), str(seed), str(tmp_path / f"p{seed}.pt"))
                for seed in (1, 2)]
    paths = [read_until(child, "READY") for child in children]  # both stores open on the same nvme_path
    assert paths[0] != paths[1] and all(os.path.exists(p) for p in paths)
    go.touch()
    reports = [json.loads(finish(child).strip().splitlines()[-1]) for child in children]
    for report in reports:
        assert report == {"own_file_kept": True, "removed_by_sweep": [], "other_file_untouched": True}
    assert os.listdir(nvme) == []
    assert (ckpt / "latest").read_text() in ("p1", "p2")
    for seed in (1, 2):
        engine = build(CONFIG, str(nvme))
        try:
            engine.load_checkpoint(ckpt, tag=f"p{seed}")
            assert_same(torch.load(tmp_path / f"p{seed}.pt", weights_only=False), snapshot(engine))
        finally:
            engine.close()
    states = [torch.load(tmp_path / f"p{seed}.pt", weights_only=False) for seed in (1, 2)]
    assert not torch.equal(states[0]["master/1/0"], states[1]["master/1/0"]), "two different runs"


def meet(go: str, what: str, seed: str) -> None:
    """Wait until both processes have reached `what` (a file each beside `go`)."""
    open(f"{go}.{what}-{seed}", "w").close()
    while len([n for n in os.listdir(os.path.dirname(go)) if f".{what}-" in n]) < 2:
        time.sleep(0.01)


def child_share(nvme: str, ckpt: str, go: str, seed: str, out: str) -> None:
    from checkpoint_models import TinyLM, ds_config
    import zero

    torch.manual_seed(int(seed))
    engine = zero.initialize(model=TinyLM(), config=ds_config(3, "bf16", "nvme", nvme))[0]
    own = engine.swap.store.path
    print(f"READY {own}", flush=True)
    while not os.path.exists(go):
        time.sleep(0.01)
    others = [os.path.join(nvme, n) for n in os.listdir(nvme) if os.path.join(nvme, n) != own]
    for step in range(2 * GAS):  # each process its own data
        ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(int(seed) * 1000 + step))
        engine.backward(engine(ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(ckpt, tag=f"p{seed}")
    torch.save(snapshot(engine), out)
    meet(go, "saved", seed)  # both saved, both stores still open
    report = {"own_file_kept": os.path.exists(own), "removed_by_sweep": [f.path for f in engine.swap.store.stale.removed],
              "other_file_untouched": all(os.path.exists(p) for p in others) and len(others) == 1}
    meet(go, "checked", seed)  # neither closes (removing its file) before the other has looked
    engine.close()
    print(json.dumps(report), flush=True)


# -- swap files left by a killed process ------------------------------------------------------------------------


def test_swap_files_of_a_killed_process_are_found_and_only_stale_ones_removed(tmp_path):
    directory = tmp_path / "nvme"
    directory.mkdir()
    dead, live = spawn("hold-store", str(directory)), spawn("hold-store", str(directory))
    dead_path, live_path = read_until(dead, "STORE"), read_until(live, "STORE")
    os.kill(dead.pid, signal.SIGKILL)
    dead.communicate()  # reaped: its pid is gone, and the kernel dropped its lock
    host = this_host()
    now = time.time()

    def fake(name: str, age: float) -> str:
        path = directory / name
        path.write_bytes(b"\0" * 4096)
        os.utime(path, (now - age, now - age))
        return str(path)

    opening = fake(f"zt-{host}-{live.pid}-deadbeef.swap", 0)         # unlocked, its process runs: may be opening
    reused = fake(f"zt-{host}-{live.pid}-0badf00d.swap", 3600)       # older than the process with that pid
    recent_remote = fake("zt-elsewhere-123-12345678.swap", 5)        # another host's, touched 5 s ago
    old_remote = fake("zt-elsewhere-124-9abcdef0.swap", 7200)        # another host's, untouched for 2 h
    stranger = fake("zt-stranger.swap", 7200)                         # not a store's name: never looked at

    with pytest.warns(StaleSwapFileWarning) as record:
        store = NvmeStore(NvmeStoreConfig(nvme_path=str(directory), grow_step=1 << 20))
    try:
        report = store.stale
        assert sorted(f.path for f in report.removed) == sorted([dead_path, reused, old_remote])
        kept = {f.path: f.verdict for f in report.kept}
        assert kept.keys() == {live_path, opening, recent_remote}
        assert kept[live_path] == LOCKED
        message = str(record[0].message)
        assert dead_path in message and "process" in message and "removed 3 stale swap file" in message
        for path in (dead_path, reused, old_remote):
            assert not os.path.exists(path)
        for path in (live_path, opening, recent_remote, stranger, store.path):
            assert os.path.exists(path)
        with open(directory / "go", "w"):
            pass  # the live store still works on its file, then closes it
        assert "OK" in finish(live)
        assert not os.path.exists(live_path)
    finally:
        store.close()
        for child in (dead, live):
            if child.poll() is None:
                child.kill()
                child.wait()


def child_hold_store(directory: str) -> None:
    from tiering import aligned_empty

    store = NvmeStore(NvmeStoreConfig(nvme_path=directory, grow_step=1 << 20))
    extent = store.allocate(64 << 10)
    data = aligned_empty(64 << 10).fill_(0x5A)
    store.write(extent, data).wait()
    print(f"STORE {store.path}", flush=True)
    while not os.path.exists(os.path.join(directory, "go")):
        time.sleep(0.01)
    back = aligned_empty(64 << 10)
    store.read(extent, back).wait()
    assert torch.equal(back, data)
    store.close()
    print("OK", flush=True)


if __name__ == "__main__":
    command, *arguments = sys.argv[1:]
    {"save-then-hang": child_save_then_hang, "swap-out-rlimit": child_swap_out_rlimit,
     "rlimit": child_rlimit, "share": child_share, "hold-store": child_hold_store}[command](*arguments)
