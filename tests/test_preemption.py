"""Preemption: SIGTERM or SIGUSR1 (a scheduler's warning) makes the main job save a checkpoint at the next step
boundary and exit 0 saying where; `--resume auto` continues from it, and the losses of the interrupted run and
its continuation are bitwise the uninterrupted run's, on one rank and on two (the signal reaching one rank
alone: the ranks agree at the boundary); set up on some ranks alone, it is an error on every rank, not a hang. A nan
loss is a typed error naming the step, or a skipped step."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import zero
from zero.engine import NonFiniteLossError

from conftest import REPO_ROOT, child_env
from models import one_thread  # noqa: F401  (autouse fixture)
from stage3_models import batches, free_port, stage3_config, tiny_gpt2

STEPS = 6


def job(tmp_path, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "zero.train", "--preset", "tiny", "--steps", str(STEPS), "--nvme-path",
            str(tmp_path / f"nvme-{name}"), "--save-dir", str(tmp_path / "ckpt"), "--summary-json",
            str(tmp_path / f"{name}.json"), *extra]


def launch(argv: list[str], world: int, port: int) -> list[subprocess.Popen]:
    """`world` ranks of the main job, started as torchrun starts them (no agent that would stop the others)."""
    procs = []
    for rank in range(world):
        env = child_env() | {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      cwd=REPO_ROOT))
    return procs


def finish(procs: list[subprocess.Popen]) -> str:
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"exit {p.returncode}:\n{out}\n{err[-3000:]}"
    return outs[0][0]


def losses(tmp_path, name: str) -> list[float]:
    return [s["loss"] for s in json.loads((tmp_path / f"{name}.json").read_text())["steps"]]


@pytest.mark.parametrize("world, sig", [(1, signal.SIGTERM), (2, signal.SIGUSR1)])
def test_a_signal_saves_at_the_boundary_and_the_resume_is_bitwise(tmp_path, world, sig):
    # --resume auto with nothing saved starts afresh; no signal, nothing is saved
    whole = finish(launch(job(tmp_path, "whole", "--save-dir", str(tmp_path / "unused"), "--resume", "auto"), world,
                          free_port()))
    assert "held-out loss" in whole and "resumed" not in whole and not os.path.exists(tmp_path / "unused")
    assert len(losses(tmp_path, "whole")) == STEPS

    procs = launch(job(tmp_path, "first"), world, free_port())
    for line in procs[0].stdout:  # rank 0 reports; the signal goes to the last rank alone
        if line.startswith("step 1:"):
            procs[-1].send_signal(sig)
            break
    rest, _ = procs[0].communicate(timeout=300)
    finish(procs)
    saved = [line for line in rest.splitlines() if line.startswith("zero: ")]
    assert len(saved) == 1 and f"to {tmp_path / 'ckpt'}" in saved[0] and saved[0].endswith("; exiting")
    assert (sig.name if world == 1 else "a signal to another rank") in saved[0]
    first = losses(tmp_path, "first")
    assert 2 <= len(first) < STEPS and f"saved a checkpoint at step {len(first)}" in saved[0]

    out = finish(launch(job(tmp_path, "second", "--resume", "auto"), world, free_port()))
    assert f"resumed from {tmp_path / 'ckpt'}/global_step{len(first)} at step {len(first)}" in out
    assert first + losses(tmp_path, "second") == losses(tmp_path, "whole")


UNEVEN = """
import os, sys
sys.path.insert(0, sys.argv[1])
import torch, zero
from stage3_models import batches, stage3_config, tiny_gpt2
torch.set_num_threads(1)
engine, *_ = zero.initialize(model=tiny_gpt2(), config=stage3_config("cpu", "cpu"))
if os.environ["RANK"] == "0":
    engine.save_on_signal(sys.argv[2])
ids = batches(1)[0]
engine.backward(engine(input_ids=ids, labels=ids).loss)
try:
    engine.step()
except RuntimeError as err:  # UnevenWatchError
    print(type(err).__name__, err, flush=True)
    engine.close()
    sys.exit(3)
"""


def test_save_on_signal_on_some_ranks_alone_fails_on_every_rank_at_the_first_boundary(tmp_path):
    """Rank 0 watches for signals, rank 1 does not: at the first boundary both raise UnevenWatchError naming them,
    where a training loop used to hang (rank 0 in its agreement all-reduce, rank 1 in the next forward's gathers)."""
    procs = launch([sys.executable, "-c", UNEVEN, os.path.join(REPO_ROOT, "tests"), str(tmp_path / "ckpt")], 2,
                   free_port())
    try:
        outs = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 3, (p.returncode, out, err[-2000:])
        assert "UnevenWatchError save_on_signal (or save_on_signal=True) was set up on rank(s) [0] and not on [1] of " \
               "2: every rank must set it up" in out
    assert not os.path.exists(tmp_path / "ckpt")


@pytest.mark.parametrize("mode", ["error", "skip"])
def test_a_nan_loss_is_named_or_skipped(tmp_path, mode):
    config = stage3_config("nvme", "cpu", nvme_path=str(tmp_path))
    config["zero_tiering"] = {"nonfinite": mode}
    engine, *_ = zero.initialize(model=tiny_gpt2(), config=config)
    try:
        ids = batches(3)
        for ok in ids[:1]:
            engine.backward(engine(ok, labels=ok).loss)
            engine.step()
        before = {k: v.clone() for k, v in engine.module_state_dict().items()}
        loss = engine(ids[1], labels=ids[1]).loss * float("nan")
        engine.backward(loss)
        if mode == "error":
            with pytest.raises(NonFiniteLossError, match=r"step 2: the gradient norm is nan .*loss: nan"):
                engine.step()
        else:
            engine.step()
            assert engine.skipped_steps == 1
        after = engine.module_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), "the bad step changed the weights"
        engine.backward(engine(ids[2], labels=ids[2]).loss)  # training goes on from clean gradients
        engine.step()
        assert torch.isfinite(torch.tensor(engine.get_global_grad_norm()))
    finally:
        engine.close()


AFTER_THE_LAST_BOUNDARY = """
import os, signal, sys, torch
sys.path.insert(0, sys.argv[1])
import zero
from stage3_models import batches, stage3_config, tiny_gpt2
engine, *_ = zero.initialize(model=tiny_gpt2(), config=stage3_config("cpu", "cpu"))
engine.save_on_signal(sys.argv[2])
ids = batches(1)[0]
engine.backward(engine(input_ids=ids, labels=ids).loss)
engine.step()
os.kill(os.getpid(), signal.SIGTERM)  # noted: no boundary comes after it
print("closing", flush=True)
engine.close()
print("survived", flush=True)
"""


def test_a_signal_after_the_last_boundary_is_delivered_at_close(tmp_path):
    """The engine noted it for a boundary that never came: close frees everything, then hands it to the handler it
    had (the default: the process ends by it), instead of dropping it."""
    run = subprocess.run([sys.executable, "-c", AFTER_THE_LAST_BOUNDARY, os.path.join(REPO_ROOT, "tests"),
                          str(tmp_path / "ckpt")], env=child_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == -signal.SIGTERM, (run.returncode, run.stdout, run.stderr[-2000:])
    assert run.stdout.split() == ["closing"]


A_SAVE_THAT_FAILS = """
import os, signal, sys, torch
sys.path.insert(0, sys.argv[1])
import zero
from stage3_models import batches, stage3_config, tiny_gpt2
engine, *_ = zero.initialize(model=tiny_gpt2(), config=stage3_config("cpu", "cpu"))
open(sys.argv[2], "w").close()
engine.save_on_signal(os.path.join(sys.argv[2], "ckpt"))  # under a file: the save will fail
ids = batches(1)[0]
os.kill(os.getpid(), signal.SIGTERM)  # noted: the boundary below saves
engine.backward(engine(input_ids=ids, labels=ids).loss)
try:
    engine.step()
except Exception as exc:
    print("failed:", type(exc).__name__, flush=True)
engine.close()
print("survived", flush=True)
"""


def test_a_save_on_a_signal_that_fails_is_its_error_and_the_signal_is_not_delivered_again(tmp_path):
    """The save the signal asked for raised (a directory under a file here; a full or read-only disk alike): that
    error is what the caller meets; close does not deliver the signal again, which would end the process before
    anything could say why there is no checkpoint (zero.train exited 143 without a line)."""
    run = subprocess.run([sys.executable, "-c", A_SAVE_THAT_FAILS, os.path.join(REPO_ROOT, "tests"),
                          str(tmp_path / "a_file")], env=child_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr[-2000:])
    lines = run.stdout.split("\n")
    assert lines[0].startswith("failed: ") and lines[1] == "survived", run.stdout
