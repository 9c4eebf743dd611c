"""Two ranks (gloo, CPU, spawned here) train as one rank does on the whole batch.

Each rank gets torchrun's environment (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and lets
`zero.initialize` join the group itself. Per optimizer step the global batch is 2 sequences x 2 micro-batches
(gradient accumulation 2, clipping 1.0): each rank trains on its own sequence of every micro-batch (micro
batch 1), the one-rank run on both (micro batch 2). Gradients are then the same sums in another order, so
the parameters agree within 1e-5 relative, and both ranks hold bitwise the same parameters. The model is
the tiny Llama: it has no parameter whose gradient is pure rounding noise (GPT-2's attention key bias),
which Adam would magnify past any tolerance once the summation order changes.
"""
from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

import zero

from models import one_thread  # noqa: F401  (autouse fixture)
from models import assert_params_equal, batches, engine_train, make_config, named_params, no_decay_groups, tiny_llama

WORLD = 2
STEPS, ACCUM, CLIP = 6, 2, 1.0

CASES = {  # name: (stage, offload, extra zero_optimization keys, use the no-decay param groups, extra keys)
    "stage0-cpu": (0, "cpu", {}, False, {}),
    "stage1-cpu": (1, "cpu", {}, False, {}),
    "stage2-cpu": (2, "cpu", {}, False, {}),
    # Shared nvme_path (two store files in one directory), sub-groups cut inside parameters, two param groups.
    "stage2-nvme-subgroups": (2, "nvme", {"sub_group_size": 3000}, True, {}),
    # DeepSpeed's gradient averaging variants: divided before the reduction, or by a factor before and after.
    "stage1-prescale": (1, "cpu", {}, False, {"prescale_gradients": True}),
    "stage2-predivide": (2, "cpu", {}, False, {"gradient_predivide_factor": 4.0, "communication_data_type": "fp32"}),
}


def case_config(name: str, micro: int, nvme_path: str) -> dict:
    stage, offload, zero_extra, _, extra = CASES[name]
    return make_config(stage, offload, accum=ACCUM, clip=CLIP, micro=micro, nvme_path=nvme_path,
                       zero_optimization=zero_extra, **extra)


def train_case(name: str, micro: int, rank: int, nvme_path: str):
    """Train one case; rank r of a two-rank run takes row r of every global batch, a one-rank run takes both."""
    model = tiny_llama(0)
    groups = no_decay_groups(model, 0.1) if CASES[name][3] else None
    engine, *_ = zero.initialize(model=model, model_parameters=groups, config=case_config(name, micro, nvme_path))
    try:
        data = [ids[rank * micro:(rank + 1) * micro] for ids in batches(STEPS * ACCUM)]
        norms: list[float] = []
        losses = engine_train(engine, data, norms=norms)
        return named_params(model), losses, norms, engine.dp.world_size, engine.global_steps
    finally:
        engine.close()


OVERFLOW_MICRO_BATCH = 3
"""fp16 case: the micro-batch whose loss rank 1 (only) multiplies by inf: the second of optimizer step 1."""


def train_fp16_overflow_on_one_rank(rank: int):
    """Stage 2, fp16, with only rank 1's gradient overflowing in one step: every rank must skip that step
    (the overflow test reads the all-reduced norm) and lower its scale, or the ranks' weights part ways."""
    model = tiny_llama(0)
    config = make_config(2, "cpu", accum=ACCUM, clip=CLIP, micro=1, fp16={
        "enabled": True, "initial_scale_power": 12, "hysteresis": 1})
    engine, *_ = zero.initialize(model=model, config=config)
    try:
        data = [ids[rank:rank + 1] for ids in batches(STEPS * ACCUM)]
        engine_train(engine, data, loss_factor={OVERFLOW_MICRO_BATCH: float("inf")} if rank == 1 else None)
        return named_params(model), engine.skipped_steps, engine.cur_scale, engine.global_steps
    finally:
        engine.close()


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    results = {name: train_case(name, 1, rank, out_dir) for name in CASES}
    results["fp16-overflow"] = train_fp16_overflow_on_one_rank(rank)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    """Every case trained by two spawned ranks; {rank: {case: (params, losses, grad norms, world_size,
    global_steps)}}."""
    out_dir = str(tmp_path_factory.mktemp("two_ranks"))
    context = mp.start_processes(_worker, args=(free_port(), out_dir), nprocs=WORLD, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + 240
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError("the two ranks did not finish in 240 s (a collective that never matched?)")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    leftovers = [f for f in os.listdir(out_dir) if not f.endswith(".pt")]
    assert not leftovers, f"close() left nvme files behind: {leftovers}"
    return {rank: torch.load(os.path.join(out_dir, f"rank{rank}.pt")) for rank in range(WORLD)}


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_match_one_rank(name, two_rank_results, tmp_path):
    assert "WORLD_SIZE" not in os.environ, "the one-rank run must not see a distributed environment"
    one_params, one_losses, one_norms, one_world, one_steps = train_case(name, WORLD, 0, str(tmp_path))
    assert one_world == 1
    params = []
    for rank in range(WORLD):
        rank_params, rank_losses, rank_norms, world, steps = two_rank_results[rank][name]
        assert world == WORLD and steps == STEPS
        params.append(rank_params)
        # Adam hardly sees a gradient's scale (a sum not divided by the world size would train the same):
        # the global norm, which every rank must agree on for clipping, does.
        torch.testing.assert_close(rank_norms, one_norms, rtol=1e-5, atol=0.0)
    assert max(one_norms) > CLIP, "clipping never acted"
    for key in params[0]:
        assert torch.equal(params[0][key], params[1][key]), f"{key}: the two ranks hold different parameters"
    assert_params_equal(params[0], one_params, exact=False)
    # The full batch's mean loss is the mean of the two halves' (every sequence has the same token count).
    halves = [two_rank_results[r][name][1] for r in range(WORLD)]
    torch.testing.assert_close([(a + b) / 2 for a, b in zip(*halves)], one_losses, rtol=1e-5, atol=0.0)


def test_fp16_overflow_on_one_rank_skips_the_step_on_all(two_rank_results):
    params = []
    for rank in range(WORLD):
        rank_params, skipped, scale, steps = two_rank_results[rank]["fp16-overflow"]
        assert (skipped, scale, steps) == (1, 2.0 ** 11, STEPS), f"rank {rank}"
        assert all(torch.isfinite(p).all() for p in rank_params.values())
        params.append(rank_params)
    for key in params[0]:
        assert torch.equal(params[0][key], params[1][key]), f"{key}: the ranks parted ways after the overflow"
