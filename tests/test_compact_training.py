"""Compact state formats through the engine: every format trains the tiny Llama with the same bits whichever path
steps it (ZeRO-3 with state on nvme, cpu or the device, serial or speculative with roll backs, ZeRO-2 on cpu or the
device), accumulation 3
and clipping that acts on some steps; two ranks over gloo agree; a save resumes in a fresh process bit for bit the
uninterrupted run; an exact checkpoint loads into a compact run and the reverse, converted with one line saying
so. What a format costs in loss is measured by bench/quality.py, not asserted here beyond "it trains": its losses
stay within a few percent of exact AdamW's over these steps.

Children run this file as a script (`python tests/test_compact_training.py resume ...`) for the fresh-process
resume, and spawn ranks for the two-rank case.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zero  # noqa: E402

from conftest import child_env  # noqa: E402
from stage3_models import (  # noqa: E402
    batches, engine_train, free_port, full_state, one_thread, stage3_config, tiny_llama,
)


def model(seed: int):
    """The tiny Llama with MLP weights of 32 x 128 = 4096 elements: the smallest parameters whose moments are int8,
    so a layer's sub-group holds int8 tiles (the MLP) beside fp32 ones (the norms, the 32 x 32 projections)."""
    return tiny_llama(seed, intermediate_size=128)

pytestmark = [pytest.mark.filterwarnings("ignore:bf16 compute:UserWarning"),
              pytest.mark.filterwarnings("ignore:fp16 compute:UserWarning")]

FORMATS = {  # name: (zero_tiering keys, compute dtype)
    "int8": ({"moments": "int8"}, "fp32"),
    "bf16-moments": ({"moments": "bf16"}, "fp32"),
    "int8-bf16-sr": ({"moments": "int8", "master": "bf16-sr"}, "bf16"),
    "int8-bf16-kahan": ({"moments": "int8", "master": "bf16-kahan"}, "bf16"),
    "bf16-bf16": ({"moments": "bf16", "master": "bf16"}, "bf16"),
    # fp16 with dynamic loss scaling: the scale folded into the compact step, an overflowing first step skipped
    "int8-fp16": ({"moments": "int8"}, "fp16"),
}
STEPS, ACCUM = 5, 3
CLIP = 1.0
"""The tiny Llama's gradient norms over these batches run about 1.11, 0.98, 0.94, 0.96, 1.09: clipping acts on the
first and last steps, so a speculative run (which does not bet right after a clipped step) commits steps 3 and 4 and
rolls back step 5."""


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def config(fmt: str, tmp_path, *, tier: str = "nvme", stage: int = 3, speculate: bool | None = None,
           accum: int = ACCUM, micro: int = 2) -> dict:
    keys, dtype = FORMATS[fmt] if fmt != "exact" else ({}, "fp32")
    os.makedirs(tmp_path, exist_ok=True)
    cfg = stage3_config(tier, tier, nvme_path=tmp_path, accum=accum, clip=CLIP, bf16=dtype == "bf16", micro=micro,
                        sub_group_size=10**9, zero_tiering={**keys, "speculative_step": speculate})
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 32}
    if stage != 3:
        cfg["zero_optimization"] = {"stage": stage, "offload_optimizer": {"device": tier}}
    return cfg


def train(cfg: dict, steps: int = STEPS, *, accum: int = ACCUM, rows: slice = slice(None),
          frozen: bool = False) -> dict:
    """`frozen`: the first layer's parameters do not train (an adapter's base)."""
    net = model(0)
    if frozen:
        net.model.layers[0].requires_grad_(False)
    trained = [p for p in net.parameters() if p.requires_grad]
    engine, *_ = zero.initialize(model=net, config=cfg, model_parameters=trained)
    try:
        losses = engine_train(engine, [ids[rows] for ids in batches(steps * accum)])
        stats = None if engine.speculation is None else vars(engine.speculation.stats).copy()
        return dict(losses=losses, state=full_state(engine), speculation=stats, skipped=engine.skipped_steps)
    finally:
        engine.close()


def assert_same_bits(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    assert a["state"].keys() == b["state"].keys()
    for key in a["state"]:
        assert torch.equal(a["state"][key], b["state"][key]), key


@pytest.fixture(scope="module")
def exact_run(tmp_path_factory):
    with one_thread():
        return train(config("exact", tmp_path_factory.mktemp("exact")))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_path_steps_a_format_to_the_same_bits(fmt, tmp_path, exact_run):
    serial = train(config(fmt, tmp_path / "serial", speculate=False))
    speculative = train(config(fmt, tmp_path / "speculative", speculate=True))
    bets = speculative["speculation"]
    assert bets["rolled_back"] > 0, bets  # a bet failed (clipped, or overflowed in fp16) and was rolled back
    if FORMATS[fmt][1] == "fp16":
        assert serial["skipped"] > 0, "the first steps overflow at a scale of 2^32"
    else:
        assert bets["stepped_early"] > bets["rolled_back"], bets  # and others held
    assert_same_bits(speculative, serial)
    assert_same_bits(train(config(fmt, tmp_path / "cpu", tier="cpu", speculate=False)), serial)
    assert_same_bits(train(config(fmt, tmp_path / "stage2", tier="cpu", stage=2)), serial)
    # State kept on the device (offload_optimizer none), as DeepSpeed runs its bf16 keys without offload
    assert_same_bits(train(config(fmt, tmp_path / "device", tier="none", speculate=False)), serial)
    assert_same_bits(train(config(fmt, tmp_path / "device2", tier="none", stage=2)), serial)
    if FORMATS[fmt][1] == "fp16":
        return  # its skipped steps make exact fp32's losses no yardstick
    # It trains: losses fall and stay within a few percent of exact AdamW's (bench/quality.py measures the price).
    losses, exact = torch.tensor(serial["losses"]), torch.tensor(exact_run["losses"])
    assert losses[-ACCUM:].mean() < losses[:ACCUM].mean()
    assert ((losses - exact).abs() / exact).max() < 0.03, ((losses - exact).abs() / exact).max()


@pytest.mark.parametrize("fmt", ["int8-bf16-sr", "int8-bf16-kahan"])
def test_a_frozen_layer_trains_alike_at_stage_2_and_stage_3(fmt, tmp_path):
    """Stage 3 numbers frozen units among its units, stages 1 and 2 do not: stochastic rounding keyed by that
    number rounded otherwise; it is keyed by the unit's ordinal among the trained ones, the same at every stage."""
    stage3 = train(config(fmt, tmp_path / "stage3", tier="cpu"), steps=2, frozen=True)
    assert_same_bits(train(config(fmt, tmp_path / "stage2", tier="cpu", stage=2), steps=2, frozen=True), stage3)


def _rank(rank: int, port: int, root: str, fmt: str) -> None:
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    result = train(config(fmt, os.path.join(root, f"nvme{rank}"), micro=1), rows=slice(rank, rank + 1))
    torch.save(result, os.path.join(root, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("fmt", ["int8-bf16-sr", "int8-bf16-kahan"])
def test_two_ranks_agree_and_train_as_one(fmt, tmp_path):
    """Two ranks (each a row of every batch) hold the same full parameters; their losses average to one rank's
    within 1%: int8 blocks start where each rank's shard does, so the bits differ from one rank's; stochastic
    rounding is keyed by an element's place in its unit, not by who holds it."""
    context = mp.start_processes(_rank, args=(free_port(), str(tmp_path), fmt), nprocs=2, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + 240
    try:
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, "two-rank training did not finish in 240 s"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for key in ranks[0]["state"]:
        assert torch.equal(ranks[0]["state"][key], ranks[1]["state"][key]), key
    one = train(config(fmt, tmp_path / "one"))
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    torch.testing.assert_close(mean, one["losses"], rtol=1e-2, atol=0.0)


def resume(fmt: str, root: str) -> None:
    """Child: load the checkpoint saved after 2 steps and train the remaining steps; write the result."""
    torch.set_num_threads(1)
    engine, *_ = zero.initialize(model=model(1), config=config(fmt, os.path.join(root, "child")))
    engine.load_checkpoint(os.path.join(root, "ckpt"))
    data = batches(STEPS * ACCUM)[2 * ACCUM:]
    losses = engine_train(engine, data)
    torch.save(dict(losses=losses, state=full_state(engine)), os.path.join(root, "child.pt"))
    engine.close()


@pytest.mark.parametrize("fmt", ["int8", "int8-bf16-sr", "int8-bf16-kahan"])
def test_a_save_resumes_bit_for_bit_in_a_fresh_process(fmt, tmp_path):
    engine, *_ = zero.initialize(model=model(0), config=config(fmt, tmp_path / "parent"))
    data = batches(STEPS * ACCUM)
    first = engine_train(engine, data[:2 * ACCUM])
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    rest = engine_train(engine, data[2 * ACCUM:])
    state = full_state(engine)
    engine.close()
    subprocess.run([sys.executable, __file__, "resume", fmt, str(tmp_path)], check=True, env=child_env(), timeout=300)
    child = torch.load(tmp_path / "child.pt")
    assert first and child["losses"] == rest
    for key in state:
        assert torch.equal(child["state"][key], state[key]), key


def layer_weight(engine) -> torch.nn.Parameter:
    """A weight of a layer's unit (4096 elements: its moments are int8)."""
    return dict(engine.module.named_parameters())["model.layers.0.mlp.gate_proj.weight"]


def test_exact_and_compact_checkpoints_convert_both_ways(tmp_path):
    """An exact checkpoint loads into an int8 run (one warning line), its moments quantized as the format stores
    them; saved again and loaded into an exact run, the values come back as the int8 run held them."""
    exact, *_ = zero.initialize(model=model(0), config=config("exact", tmp_path / "a"))
    engine_train(exact, batches(2 * ACCUM))
    exact.save_checkpoint(str(tmp_path / "exact"))
    param = layer_weight(exact)
    moment = exact.full_state(param, "exp_avg")
    master = exact.full_state(param, "master")
    exact.close()

    compact, *_ = zero.initialize(model=model(1), config=config("int8", tmp_path / "b"))
    with pytest.warns(UserWarning, match=r"holds exact \(fp32 master and moments\) optimizer state; this run stores "
                                         r"moments int8, master fp32: converted on load"):
        compact.load_checkpoint(str(tmp_path / "exact"))
    cparam = layer_weight(compact)
    tiles = {tile.codec.name for sg in compact.driver.sub_groups for tile in getattr(sg.codecs.exp_avg, "tiles", ())}
    assert tiles == {"fp32", "int8"}  # a layer's sub-group: its MLP weights int8, its norms and projections fp32
    assert torch.equal(compact.full_state(cparam, "master"), master)
    quantized = compact.full_state(cparam, "exp_avg")
    assert not torch.equal(quantized, moment)
    torch.testing.assert_close(quantized, moment, rtol=0.0, atol=float(moment.abs().max()) * 0.02)
    compact.save_checkpoint(str(tmp_path / "compact"))
    compact.close()

    back, *_ = zero.initialize(model=model(2), config=config("exact", tmp_path / "c"))
    with pytest.warns(UserWarning, match="converted on load"):
        back.load_checkpoint(str(tmp_path / "compact"))
    bparam = layer_weight(back)
    assert torch.equal(back.full_state(bparam, "exp_avg"), quantized)
    back.close()


def test_a_vanished_gradient_moves_an_int8_moment_s_weight_by_at_most_a_few_lr(tmp_path):
    """A dead input: step 1 its gradient is 1e-5 of its block's largest (the second moment 1e-10 of the block's,
    under the first code's midpoint), step 2 exactly 0. Encoded as 0, that moment made the step lr * m / eps,
    ~370 x lr. Adam's step is at most about lr (1 - beta1) / sqrt(1 - beta2) ~ 3.2 lr (Kingma & Ba, 2.1), and a
    second moment rounded up to the smallest code only shrinks it: 10 x lr leaves room for quantization."""
    lr = 0.01
    cfg = stage3_config("cpu", "cpu", micro=1, lr=lr, zero_tiering={"moments": "int8"})
    cfg["optimizer"]["params"]["weight_decay"] = 0.0
    torch.manual_seed(0)
    engine, *_ = zero.initialize(model=torch.nn.Sequential(torch.nn.Linear(128, 64, bias=False)), config=cfg)
    try:
        weight = dict(engine.module.named_parameters())["0.weight"]  # 8192 elements: int8 moments
        x = torch.cat([torch.ones(64), torch.full((64,), 1e-5)])[None]  # d loss / d weight[i, j] = x[j]
        engine.backward(engine(x).sum())
        engine.step()
        before = engine.full_state(weight, "master").clone()
        x[:, 64:] = 0
        engine.backward(engine(x).sum())
        engine.step()
        moved = (engine.full_state(weight, "master") - before).abs()
    finally:
        engine.close()
    assert float(moved[:, :64].min()) > 0.5 * lr  # the premise: the live inputs' weights stepped
    assert float(moved.max()) <= 10 * lr


@pytest.mark.parametrize("fmt", ["bf16-moments", "bf16-bf16"])
def test_where_sub_groups_cut_the_parameters_changes_no_bit(fmt, tmp_path):
    """torch's fused Adam rounds each tensor's last numel % 8 elements with its scalar loop: the compact step does
    so where each parameter ends (`tails`, as the exact step), not where a sub-group ends, so the bits are the same
    however sub_group_size cuts the unit (parameters of 4500, 45, 585 and 13 elements). (int8 moments are not
    among the formats: a sub-group's piece of a parameter is its tile, so its blocks move with the cut.)"""
    def run(sub_group_size: int) -> dict:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(100, 45), torch.nn.Tanh(), torch.nn.Linear(45, 13))
        cfg = config(fmt, tmp_path / str(sub_group_size), tier="cpu", stage=2, accum=1)
        cfg["zero_optimization"]["sub_group_size"] = sub_group_size
        cfg["gradient_clipping"] = 0.0  # a norm summed over pieces cut elsewhere rounds otherwise (the README's note)
        engine, *_ = zero.initialize(model=net, config=cfg)
        try:
            gen = torch.Generator().manual_seed(1)
            for _ in range(3):
                x = torch.randn(4, 100, generator=gen).to(engine.compute_dtype)
                engine.backward(engine(x).float().pow(2).mean())
                engine.step()
            return {name: p.detach().float().clone() for name, p in net.named_parameters()}
        finally:
            engine.close()

    whole = run(10**9)
    for size in (100, 333):
        cut = run(size)
        assert all(torch.equal(whole[name], cut[name]) for name in whole), size


if __name__ == "__main__":
    if sys.argv[1] == "resume":
        resume(sys.argv[2], sys.argv[3])
