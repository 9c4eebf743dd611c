"""Checkpoints: save and load of the whole training state, bitwise resume, verification, world size.

- Resume: N optimizer steps, save, and a fresh process that builds the engine the same way, loads, and runs M
  more steps ends bitwise equal to N + M steps straight: losses, full parameters, fp32 masters, both Adam
  moments, counters, LR (stage 3 fp32 with dropout, so RNG states matter; stage 3 bf16; stage 2 bf16; params
  and optimizer state on nvme; gradient accumulation 2, clipping, a warmup schedule cut in the middle).
- Layout: per-rank files, a manifest whose sizes and checksums match the files, `latest` naming the tag, no
  temporary file left; saving inside an accumulation window is refused and writes nothing.
- Verification: a flipped byte in a data file, a state file or the manifest is refused, naming the file (and
  the damaged record); a tag without manifest is incomplete; another model is a mismatch; none of these
  changes the engine.
- World size: saved with 2 ranks and loaded with 1, and the other way, the state is the same (resharded);
  ranks whose `latest` files disagree, and a load failing on one rank after verification: every rank raises.

Children run this file as a script (`python tests/test_checkpoint.py <command> ...`), so the code they run is
the code here.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoint_models import (  # noqa: E402
    CONFIGS, GAS, assert_same, batch, build, ds_config, full_units, snapshot, tiny_lm, train, unit_pieces,
)
from conftest import REPO_ROOT, child_env  # noqa: E402

import zero  # noqa: E402
from tiering.stale import this_host  # noqa: E402
from zero.checkpoint.format import (  # noqa: E402
    CheckpointBoundaryError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompleteError,
    CheckpointMismatchError,
    read_manifest,
)

THIS = os.path.abspath(__file__)


def run_child(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, THIS, *args], capture_output=True, text=True, timeout=timeout,
                          env=child_env(), cwd=REPO_ROOT)
    assert proc.returncode == 0, f"child {args[0]} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc


# -- resume is bitwise -------------------------------------------------------------------------------------------

N_STEPS, M_STEPS = 2, 2


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """For every config: a straight run of N + M steps here, a run of N steps saved here, and one fresh child
    process that loads each checkpoint and runs M steps. Yields {config: (straight, resumed, checkpoint dir)}."""
    root = tmp_path_factory.mktemp("resume")
    straight, ckpts = {}, {}
    for name in CONFIGS:
        nvme = root / f"{name}-nvme"
        nvme.mkdir()
        engine = build(name, str(nvme))
        losses = train(engine, N_STEPS + M_STEPS)
        straight[name] = (losses[N_STEPS * GAS:], snapshot(engine))
        engine.close()
        engine = build(name, str(nvme))
        train(engine, N_STEPS)
        ckpts[name] = str(root / f"{name}-ckpt")
        engine.save_checkpoint(ckpts[name], client_state={"config": name, "note": [1, 2, 3]})
        engine.close()
        assert os.listdir(nvme) == [], "the engine left swap files behind"
    out = root / "resumed.pt"
    run_child("resume", str(out), str(root), json.dumps(ckpts))
    results = torch.load(out, weights_only=False)
    yield {name: (straight[name], results[name], ckpts[name]) for name in CONFIGS}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_resume_in_a_fresh_process_is_bitwise_equal_to_a_straight_run(resumed, name):
    (straight_losses, straight_state), result, _ = resumed[name]
    assert result["client_state"] == {"config": name, "note": [1, 2, 3]}
    assert result["loaded_counters"] == (N_STEPS, N_STEPS * GAS, 0, N_STEPS)
    assert len(result["losses"]) == len(straight_losses) == M_STEPS * GAS
    for step, (a, b) in enumerate(zip(straight_losses, result["losses"])):
        assert torch.equal(a, b), f"micro step {N_STEPS * GAS + step}: loss {a.item()!r} != {b.item()!r}"
    assert_same(straight_state, result["state"])


def child_resume(out: str, root: str, ckpts_json: str) -> None:
    results = {}
    for name, ckpt in json.loads(ckpts_json).items():
        nvme = os.path.join(root, f"{name}-nvme-child")
        os.mkdir(nvme)
        torch.manual_seed(12345)  # whatever the process did before, loading restores the RNG states
        engine = build(name, nvme)
        path, client_state = engine.load_checkpoint(ckpt, load_rng_states=True)
        assert path == os.path.join(ckpt, f"global_step{N_STEPS}"), path
        counters = (engine.global_steps, engine.micro_steps, engine.skipped_steps, engine.optimizer.step_count)
        losses = train(engine, M_STEPS)
        results[name] = {"losses": losses, "state": snapshot(engine), "client_state": client_state,
                         "loaded_counters": counters}
        engine.close()
    torch.save(results, out)


# -- layout, boundary ---------------------------------------------------------------------------------------------


def test_checkpoint_layout_and_manifest(resumed):
    import xxhash

    _, _, ckpt = resumed["stage3-bf16-nvme"]
    tag = f"global_step{N_STEPS}"
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read() == tag
    tag_dir = os.path.join(ckpt, tag)
    names = sorted(os.listdir(tag_dir))
    assert names[0] == "manifest.json" and len(names) == 3
    data, state = names[1:]  # this save's id in both names
    assert re.fullmatch(r"rank00000-of-00001\.[0-9a-f]{8}\.data", data) and state == data[:-len("data")] + "state.pt"
    manifest = read_manifest(tag_dir)
    assert sorted(manifest["files"]) == [n for n in names if n != "manifest.json"]
    for name, entry in manifest["files"].items():
        with open(os.path.join(tag_dir, name), "rb") as f:
            data = f.read()
        assert entry == {"size": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data)}
    assert (manifest["world_size"], manifest["stage"], manifest["compute_dtype"]) == (1, 3, "bfloat16")
    assert manifest["library_version"] == "0.1.0" and manifest["global_steps"] == N_STEPS
    assert [u["name"] for u in manifest["units"]] == ["", "blocks.0", "blocks.1"]
    assert manifest["aliases"] == {"head.weight": "embed.weight"}
    assert manifest["model_config"] is None  # not a transformers model
    parts = {(r["unit"], r["part"]) for r in manifest["ranks"][0]["records"] if r["kind"] == "unit"}
    assert parts == {(u, p) for u in range(3) for p in ("param", "master", "exp_avg", "exp_avg_sq")}
    extras = [r for r in manifest["ranks"][0]["records"] if r["kind"] == "extra"]
    assert [(r["name"], r["dtype"], r["is_param"]) for r in extras] == [("tokens_seen", "int64", False)]


def test_save_inside_an_accumulation_window_is_refused(tmp_path):
    engine = build("stage3-bf16-nvme", str(tmp_path), sub_group_size=0)
    try:
        ids = batch(0)
        engine.backward(engine(ids, labels=ids).loss)
        engine.step()  # micro step 1 of 2: gradients accumulated, no optimizer step yet
        with pytest.raises(CheckpointBoundaryError, match="inside a gradient accumulation window"):
            engine.save_checkpoint(tmp_path / "ckpt")
        assert not (tmp_path / "ckpt").exists() or os.listdir(tmp_path / "ckpt") == []
        ids = batch(1)
        engine.backward(engine(ids, labels=ids).loss)
        engine.step()
        assert engine.save_checkpoint(tmp_path / "ckpt") == str(tmp_path / "ckpt" / "global_step1")
    finally:
        engine.close()


def test_a_resume_with_another_accumulation_starts_a_whole_step(tmp_path):
    """Saved at accumulation 2 after 3 steps (micro step 6), resumed at 4: the next step takes 4 micro-batches,
    not the 2 that 6 % 4 would leave it, and train_batch runs at once."""
    from stage3_models import batches, engine_train, own_gpt, stage3_config

    data = batches(12)
    engine, *_ = zero.initialize(model=own_gpt(0), config=stage3_config("cpu", "cpu", accum=2))
    engine_train(engine, data[:6])
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()
    for manual in (True, False):
        engine, *_ = zero.initialize(model=own_gpt(0), config=stage3_config("cpu", "cpu", accum=4))
        try:
            engine.load_checkpoint(tmp_path / "ckpt")
            assert engine.global_steps == 3 and not engine.is_gradient_accumulation_boundary()
            if manual:
                steps = [engine_train(engine, [ids]) and engine.global_steps for ids in data[6:10]]
                assert steps == [3, 3, 3, 4]
            else:
                engine.train_batch([(ids[:, :-1], ids[:, 1:]) for ids in data[6:10]])
                assert engine.global_steps == 4
            engine.save_checkpoint(tmp_path / "again")  # at a boundary
        finally:
            engine.close()


# -- verification ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A stage-3 bf16 checkpoint after 2 steps (optimizer and params on nvme), and the state it holds."""
    root = tmp_path_factory.mktemp("saved")
    engine = build("stage3-bf16-nvme", str(root))
    train(engine, 2)
    ckpt = root / "ckpt"
    engine.save_checkpoint(ckpt, tag="two")
    state = snapshot(engine)
    engine.close()
    return ckpt, state


def test_saving_again_under_a_tag_replaces_its_files_and_loads_the_new_state(saved, tmp_path):
    """A second save under the same tag writes its files beside the first's (each save's names carry an id), its
    manifest replaces the first in one rename, then the first's files go: the directory holds one checkpoint, the
    newer, and it loads bitwise. A temporary file of a dead process (an interrupted save's) goes too."""
    import shutil

    source, _ = saved
    ckpt = tmp_path / "ckpt"
    shutil.copytree(source, ckpt)
    first = sorted(os.listdir(ckpt / "two"))
    dead = ckpt / "two" / f".rank00000-of-00001.0123abcd.data.tmp-{this_host()}-{2 ** 22 + 1}-deadbeef"
    dead.write_bytes(b"left by a killed save")
    engine = build("stage3-bf16-nvme", str(tmp_path))
    try:
        engine.load_checkpoint(ckpt)
        train(engine, 1)
        engine.save_checkpoint(ckpt, tag="two")
        state = snapshot(engine)
    finally:
        engine.close()
    names = sorted(os.listdir(ckpt / "two"))
    assert len(names) == 3 and not set(names) & set(first) - {"manifest.json"}
    assert sorted(read_manifest(str(ckpt / "two"))["files"]) == [n for n in names if n != "manifest.json"]
    engine = build("stage3-bf16-nvme", str(tmp_path))
    try:
        engine.load_checkpoint(ckpt)
        assert_same(snapshot(engine), state)
    finally:
        engine.close()


def test_a_buffer_of_another_shape_is_refused_before_anything_loads(saved, tmp_path):
    """The checkpoint holds the 0-d buffer `tokens_seen`; an engine whose buffer is 3 long would take it by
    broadcasting (every element the saved count): refused, naming it and both shapes, with nothing changed."""
    ckpt, _ = saved
    engine = build("stage3-bf16-nvme", str(tmp_path))
    try:
        engine.module.register_buffer("tokens_seen", torch.zeros(3, dtype=torch.long))
        before = snapshot(engine)
        with pytest.raises(CheckpointMismatchError, match=r"'tokens_seen' as \[\], the engine as \[3\]"):
            engine.load_checkpoint(ckpt)
        assert_same(before, snapshot(engine))
        assert torch.equal(engine.module.tokens_seen, torch.zeros(3, dtype=torch.long))
    finally:
        engine.close()


def flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("target", ["data", "state", "manifest"])
def test_a_flipped_byte_in_a_checkpoint_file_is_refused_naming_the_file(saved, tmp_path, target):
    import shutil

    source, _ = saved
    ckpt = tmp_path / "ckpt"
    shutil.copytree(source, ckpt)
    tag_dir = ckpt / "two"
    manifest = read_manifest(str(tag_dir))
    rank = manifest["ranks"][0]
    name = {"data": rank["data"], "state": rank["state"], "manifest": "manifest.json"}[target]
    if target == "data":  # a byte inside unit 1's exp_avg record
        record = next(r for r in manifest["ranks"][0]["records"] if r.get("unit") == 1 and r["part"] == "exp_avg")
        flip(tag_dir / name, record["offset"] + 5)
    elif target == "manifest":
        text = (tag_dir / name).read_bytes()
        (tag_dir / name).write_bytes(text.replace(b'"global_steps": 2', b'"global_steps": 3'))
    else:
        flip(tag_dir / name, os.path.getsize(tag_dir / name) // 2)
    engine = build("stage3-bf16-nvme", str(tmp_path))
    try:
        before = snapshot(engine)
        with pytest.raises(CheckpointCorruptError) as info:
            engine.load_checkpoint(ckpt)
        assert info.value.path == str(tag_dir / name) and str(tag_dir / name) in str(info.value)
        if target == "data":
            assert "unit 1 exp_avg" in str(info.value)
        assert_same(before, snapshot(engine))  # refused before anything changed
    finally:
        engine.close()


def test_incomplete_mismatched_and_missing_checkpoints(saved, tmp_path):
    import shutil

    source, state = saved
    ckpt = tmp_path / "ckpt"
    shutil.copytree(source, ckpt)
    engine = build("stage3-bf16-nvme", str(tmp_path))
    try:
        with pytest.warns(UserWarning, match="no `latest` file"):
            assert engine.load_checkpoint(tmp_path / "empty-dir-that-is-not-there") == (None, None)
        (ckpt / "incomplete").mkdir()
        (ckpt / "incomplete" / "rank00000-of-00001.data").write_bytes(b"x")
        with pytest.raises(CheckpointIncompleteError, match="incomplete.*no manifest.json"):
            engine.load_checkpoint(ckpt, tag="incomplete")
        torch.manual_seed(777)
        drawn = torch.rand(4)
        torch.manual_seed(777)
        path, client = engine.load_checkpoint(ckpt, tag="two")  # the random streams stay the script's (DeepSpeed's)
        assert client is None and path == str(ckpt / "two")
        assert torch.equal(torch.rand(4), drawn)
        assert_same(state, snapshot(engine))
    finally:
        engine.close()
    other = zero.initialize(model=tiny_lm(), config=ds_config(3, "fp32", "nvme", str(tmp_path)))[0]
    try:
        with pytest.raises(CheckpointMismatchError, match="bfloat16"):
            other.load_checkpoint(ckpt, tag="two")
    finally:
        other.close()


def test_load_without_optimizer_states_takes_the_weights_only(saved, tmp_path):
    source, state = saved
    engine = build("stage3-bf16-nvme", str(tmp_path))
    try:
        engine.load_checkpoint(source, tag="two", load_optimizer_states=False)
        now = snapshot(engine)
        for key in state:
            if key.startswith(("param/", "master/", "module/")):
                assert torch.equal(now[key], state[key]), key
            elif key.startswith("exp_avg"):
                assert not now[key].any(), key
        assert now["counters"] == (2, 4, 0, 0)
        assert now["lr"] == state["lr"]  # the schedule was loaded
    finally:
        engine.close()


# -- world size -----------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_saved_with_two_ranks_loads_into_one_and_back(tmp_path):
    """Two gloo ranks train and save; they also load a one-rank checkpoint saved here. One rank here loads
    theirs. Each side's parameters and optimizer state, assembled per unit, equal the other's."""
    one = build("stage3-bf16-nvme", str(tmp_path))
    train(one, 2)
    one.save_checkpoint(tmp_path / "one", tag="t")
    mine = {part: full_units(unit_pieces(one, part), one.units) for part in ("param", "master", "exp_avg", "exp_avg_sq")}
    one.close()

    port = free_port()
    children = []
    for rank in range(2):
        env = child_env() | {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        children.append(subprocess.Popen([sys.executable, THIS, "two-ranks", str(tmp_path)], env=env,
                                         cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for child in children:
        try:
            _, err = child.communicate(timeout=240)
        finally:
            if child.poll() is None:
                child.kill()
        assert child.returncode == 0, err[-4000:]
    dumps = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    manifest = read_manifest(str(tmp_path / "two" / "t"))
    assert manifest["world_size"] == 2 and len(manifest["ranks"]) == 2
    fresh = build("stage3-bf16-nvme", str(tmp_path))
    try:
        with pytest.warns(UserWarning, match="saved with 2 ranks, loaded into 1"):
            fresh.load_checkpoint(tmp_path / "two", tag="t", load_rng_states=True)
        for part in ("param", "master", "exp_avg", "exp_avg_sq"):
            theirs = full_units([p for d in dumps for p in d["trained"][part]], fresh.units)
            loaded = full_units(unit_pieces(fresh, part), fresh.units)
            for index, (a, b) in enumerate(zip(theirs, loaded)):
                assert torch.equal(a, b), f"2 -> 1 ranks: unit {index} {part}"
            back = full_units([p for d in dumps for p in d["loaded"][part]], fresh.units)
            for index, (a, b) in enumerate(zip(mine[part], back)):
                assert torch.equal(a, b), f"1 -> 2 ranks: unit {index} {part}"
        assert fresh.global_steps == 2 and fresh.optimizer.step_count == 2
        assert all(d["loaded_counters"] == (2, 4, 0, 2) for d in dumps)
        for d in dumps:  # neither rank waited for the other: both refused, naming what
            assert "rank 0: 't', rank 1: None" in d["refused"]["latest"]
        for where in ("fill", "apply"):
            assert "refused by the test" in dumps[1]["refused"][where]
            assert "failed on 1 rank(s): rank 1: CheckpointError" in dumps[0]["refused"][where]
    finally:
        fresh.close()


def child_two_ranks(root: str) -> None:
    nvme = os.path.join(root, "nvme-two")
    os.makedirs(nvme, exist_ok=True)
    engine = build("stage3-bf16-nvme", nvme)
    rank = engine.dp.rank
    assert engine.dp.world_size == 2
    train(engine, 2)
    engine.save_checkpoint(os.path.join(root, "two"), tag="t")
    parts = ("param", "master", "exp_avg", "exp_avg_sq")
    trained = {part: unit_pieces(engine, part) for part in parts}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine.load_checkpoint(os.path.join(root, "one"), tag="t")
    loaded = {part: unit_pieces(engine, part) for part in parts}
    counters = (engine.global_steps, engine.micro_steps, engine.skipped_steps, engine.optimizer.step_count)
    refused = {}
    # Each rank's own `latest` (node-local directories): rank 0's names "t", rank 1's directory has none.
    own = os.path.join(root, "two" if rank == 0 else "empty")
    os.makedirs(own, exist_ok=True)
    with pytest.raises(CheckpointMismatchError) as info:
        engine.load_checkpoint(own)
    refused["latest"] = str(info.value)
    # A failure after verification on rank 1 alone, reading a tensor or applying the counters: every rank raises
    # (none goes on into the collectives that refill the gathered units).
    def refuse(*args) -> None:
        raise RuntimeError("refused by the test")

    from zero.checkpoint import load
    for where, target, name in (("fill", load, "fill"), ("apply", engine.counters, "load_state_dict")):
        original = getattr(target, name)
        if rank == 1:
            setattr(target, name, refuse)
        with pytest.raises(CheckpointError) as info:
            engine.load_checkpoint(os.path.join(root, "two"), tag="t")
        setattr(target, name, original)
        refused[where] = str(info.value)
    engine.close()
    torch.save({"trained": trained, "loaded": loaded, "loaded_counters": counters, "refused": refused},
               os.path.join(root, f"rank{rank}.pt"))


@pytest.mark.parametrize("name, tiering", [("stage3-fp32-nvme-dropout", {}), ("stage3-bf16-nvme", {}),
                                          ("stage3-bf16-nvme", {"moments": "int8", "master": "bf16-kahan"})])
def test_a_load_rewrites_state_a_failed_step_left_discarded(tmp_path, name, tiering):
    """A step cut by a fault can leave a state segment discarded (its fetch to be overwritten failed making
    room): loading the last checkpoint writes every state tensor whole, reading none of the stored bytes, so the
    load recovers it and training goes on as from the checkpoint (shared fp32 masters, bf16, compact state)."""
    engine = build(name, str(tmp_path), tiering={"host_budget": 128 << 10, **tiering}, sub_group_size=2048)
    try:
        train(engine, 1)
        engine.save_checkpoint(tmp_path / "ckpt", tag="a")
        saved = snapshot(engine)
        torch.manual_seed(1)
        ahead = train(engine, 1)
        state = [unit.segment for unit in engine.units] + [
            sg.segment(part) for sg in engine.driver.sub_groups for part in sg.stored_parts if sg.whole(part)]
        for segment in state:
            engine.swap.discard(segment)
        engine.load_checkpoint(tmp_path / "ckpt", tag="a")
        assert_same(snapshot(engine), saved)
        torch.manual_seed(1)
        assert [x.item() for x in train(engine, 1)] == [x.item() for x in ahead]
    finally:
        engine.close()


if __name__ == "__main__":
    command, *arguments = sys.argv[1:]
    {"resume": child_resume, "two-ranks": child_two_ranks}[command](*arguments)


def test_checkpoint_moves_between_shared_and_separate_fp32_masters(tmp_path):
    """fp32 with parameters and optimizer state on nvme keeps one copy (the parameter shard is the master);
    with parameters on cpu the master is a copy of its own. The checkpoint records masters alike, so each
    loads into the other: the same state, and the same next steps."""
    layouts = {"shared": {}, "separate": {"offload_param": {"device": "cpu"}}}
    engines = {}
    for name, overrides in layouts.items():
        (tmp_path / name).mkdir()
        engines[name] = build("stage3-fp32-nvme-dropout", str(tmp_path / name), **overrides)
    try:
        assert all(sg.master_in is not None for sg in engines["shared"].driver.sub_groups)
        assert all(sg.master_in is None for sg in engines["separate"].driver.sub_groups)
        train(engines["shared"], 2)
        engines["shared"].save_checkpoint(tmp_path / "ckpt", tag="a")
        engines["separate"].load_checkpoint(tmp_path / "ckpt", tag="a")
        assert_same(snapshot(engines["separate"]), snapshot(engines["shared"]))
        torch.manual_seed(1)  # dropout draws the same masks in both
        ahead = train(engines["shared"], 1)
        torch.manual_seed(1)
        assert [x.item() for x in train(engines["separate"], 1)] == [x.item() for x in ahead]
        engines["separate"].save_checkpoint(tmp_path / "ckpt", tag="b")
        engines["shared"].load_checkpoint(tmp_path / "ckpt", tag="b")
        assert_same(snapshot(engines["shared"]), snapshot(engines["separate"]))
    finally:
        for engine in engines.values():
            engine.close()
