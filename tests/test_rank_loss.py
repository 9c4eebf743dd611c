"""A rank that dies (kill -9) or hangs (SIGSTOP) after a checkpoint: the other rank stops with RankLostError,
naming itself and the lost rank, within the config's collective_timeout instead of hanging, and the checkpoint
saved before is left as it was and still loads.

The two ranks get torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) but no torchrun, which SIGTERMs
the other workers once one dies: here nothing but zero ends rank 0. Children run this file as a script
(`python tests/test_rank_loss.py <dead|stopped> ROOT`), so the code they run is the code here.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoint_models import build, train  # noqa: E402
from conftest import REPO_ROOT, child_env  # noqa: E402
from stage3_models import free_port  # noqa: E402

from zero.comm import DataParallel, RankLostError  # noqa: E402

THIS = os.path.abspath(__file__)
TIMEOUT = 5.0
"""zero_tiering.collective_timeout in the children: seconds, against the 600 s default."""
FAULTS = {"dead": signal.SIGKILL, "stopped": signal.SIGSTOP}
"""What rank 1 does to itself once both ranks have saved: die (its sockets close), or stop answering."""


def listing(root: str) -> dict[str, list[int]]:
    """Every file under `root` with its size and modification time."""
    out = {}
    for directory, _, names in os.walk(root):
        for name in names:
            stat = os.stat(os.path.join(directory, name))
            out[os.path.relpath(os.path.join(directory, name), root)] = [stat.st_size, stat.st_mtime_ns]
    return out


def child(fault: str, root: str) -> None:
    """Train one optimizer step, save, then rank 1 kills or stops itself while rank 0 trains on."""
    nvme = os.path.join(root, "nvme")
    os.makedirs(nvme, exist_ok=True)
    engine = build("stage3-bf16-nvme", nvme, tiering={"collective_timeout": TIMEOUT})
    rank = engine.dp.rank
    try:
        train(engine, 1)
        engine.save_checkpoint(os.path.join(root, "ckpt"), tag="before")
        marker = os.path.join(root, "rank0-saved")
        if rank == 1:
            while not os.path.exists(marker):  # rank 0 is out of the save's last collective too
                time.sleep(0.01)
            os.kill(os.getpid(), FAULTS[fault])
        print("saved", json.dumps(listing(os.path.join(root, "ckpt"))), flush=True)
        open(marker, "w").close()
        start = time.monotonic()
        try:
            train(engine, 1)
        finally:
            print(f"gave up after {time.monotonic() - start:.2f} s", flush=True)
    finally:
        engine.close()


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_other_rank_stops_naming_the_lost_rank_and_the_checkpoint_loads(fault, tmp_path):
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, THIS, fault, str(tmp_path)], cwd=REPO_ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=child_env() | {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in range(2)]
    try:
        out, err = ranks[0].communicate(timeout=120)  # a hang would last the default's 600 s or for ever
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
            rank.communicate()
    assert ranks[0].returncode == 1, err[-4000:]
    assert "RankLostError: rank 0 of 2: " in err and "rank 1 stopped answering" in err, err[-4000:]
    waited = float(out.split("gave up after ")[1].split(" s")[0])
    if fault == "dead":
        assert ranks[1].returncode == -signal.SIGKILL
        assert waited < TIMEOUT and "connection closed" in err, err[-4000:]
    else:
        assert TIMEOUT * 0.9 < waited < TIMEOUT + 10 and "no reply within 5 s" in err, (waited, err[-4000:])

    saved = json.loads(out.split("saved ", 1)[1].splitlines()[0])
    assert listing(str(tmp_path / "ckpt")) == saved, "files of the checkpoint changed after the save"
    (tmp_path / "nvme-fresh").mkdir()  # not the dead rank's swap directory: its stale file is not ours to see
    fresh = build("stage3-bf16-nvme", str(tmp_path / "nvme-fresh"))
    try:
        fresh.load_checkpoint(tmp_path / "ckpt", tag="before")  # verifies every file against the manifest
        assert fresh.global_steps == 1
    finally:
        fresh.close()


def test_a_lost_peer_is_typed_and_other_errors_pass(monkeypatch):
    """The error a collective raises is classified from the backend's message: a peer gone or silent is a
    RankLostError naming the collective, anything else (a misuse) stays what it was."""
    dp = DataParallel()
    dp.world_size, dp.rank, dp.timeout = 4, 2, 30.0
    monkeypatch.setattr("torch.distributed.get_backend", lambda group=None: "gloo")
    closed = dp.lost("all_gather", RuntimeError("[pair.cc:553] Connection closed by peer [10.0.0.7]:5843"))
    assert isinstance(closed, RankLostError) and closed.suspects == () and closed.collective == "all_gather"
    assert str(closed).startswith("rank 2 of 4: all_gather failed: a peer rank (of 4) stopped answering")
    assert "[10.0.0.7]:5843" in str(closed)
    silent = dp.lost("barrier", RuntimeError("Timed out waiting 30000ms for recv operation to complete"))
    assert "no reply within 30 s, zero_tiering.collective_timeout" in str(silent)
    assert dp.lost("all_reduce_sum", RuntimeError("Tensors must be contiguous")) is None


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
