"""bf16 and fp16 training: fp32 master weights, low-precision compute, fp16 dynamic loss scaling.

Two references. Against plain-PyTorch mixed precision written out by hand (`mixed_reference_train`: fp32
masters stepped by AdamW(fused=True), the model cast to bf16/fp16, each micro-batch's gradient cast to fp32
and summed) the engine is exact on the CPU: it is the same arithmetic. Against the fp32 reference it is
within bf16 tolerance, stated in `test_bf16_within_tolerance_of_fp32`.
"""
from __future__ import annotations

import pytest
import torch

import zero

from models import one_thread  # noqa: F401  (autouse fixture)
from models import (LR, MODELS, WEIGHT_DECAY, assert_losses_equal, assert_params_equal, batches, engine_train,
                    make_config, mixed_reference_train, named_params, reference_train)


def exact(engine) -> bool:
    return engine.device.type == "cpu"


@pytest.mark.parametrize("name,stage,offload", [("gpt2", 2, "cpu"), ("llama", 1, "none"), ("tied", 0, "nvme")])
def test_bf16_matches_mixed_precision_reference(name, stage, offload, tmp_path):
    accum, clip, steps = 2, 1.0, 8
    data = batches(steps * accum)
    model = MODELS[name](0)
    engine, *_ = zero.initialize(model=model, config=make_config(stage, offload, accum=accum, clip=clip,
                                                                 nvme_path=tmp_path, bf16={"enabled": True}))
    losses = engine_train(engine, data)
    engine.close()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters()), "the model does not compute in bf16"
    reference = MODELS[name](0).to(engine.device)
    reference_losses = mixed_reference_train(reference, torch.bfloat16, data, accum=accum, clip=clip)
    assert_losses_equal(losses, reference_losses, exact=exact(engine))
    assert_params_equal(named_params(model), named_params(reference), exact=exact(engine))


@pytest.mark.parametrize("accum", [1, 2])
def test_bf16_gradient_is_kept_in_16_bits_only_without_accumulation(accum, tmp_path):
    """Without accumulation a step's gradient is stored once, exactly as the bf16 reduction left it: kept in
    bf16 it holds the same values in half the bytes (on nvme, half the gradient writes and reads), and the run
    still matches the mixed-precision reference exactly. Accumulating needs fp32 sums."""
    steps, clip = 4, 1.0
    data = batches(steps * accum)
    model = MODELS["gpt2"](0)
    engine, *_ = zero.initialize(model=model, config=make_config(3, "nvme", accum=accum, clip=clip,
                                                                 nvme_path=tmp_path, bf16={"enabled": True}))
    kept = {engine.swap.segments[sg.segment("grad")].dtype for sg in engine.driver.sub_groups}
    losses = engine_train(engine, data)
    engine.close()
    assert kept == {torch.bfloat16 if accum == 1 else torch.float32}
    reference = MODELS["gpt2"](0).to(engine.device)
    reference_losses = mixed_reference_train(reference, torch.bfloat16, data, accum=accum, clip=clip)
    assert_losses_equal(losses, reference_losses, exact=exact(engine))
    assert_params_equal(named_params(model), named_params(reference), exact=exact(engine))


def test_stage3_shards_the_step_rewrites_are_given_up_first_and_training_stays_exact(tmp_path):
    """At the accumulation boundary each unit's backward ends by telling the swap manager that the coming step
    overwrites its bf16 shard (from the fp32 master), so their room goes first (the order is
    test_swap_manager's to check). A mid-accumulation backward does not (the next forward reads them), and the
    step's overwrite ends the hint. Under a host budget below the state, where shards are given up this way,
    training stays exactly the mixed-precision reference's."""
    accum, clip, steps = 2, 1.0, 4
    data = batches(steps * accum)
    model = MODELS["gpt2"](0)
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    config = make_config(3, "nvme", accum=accum, clip=clip, nvme_path=tmp_path, bf16={"enabled": True},
                         zero_optimization={"offload_param": nvme, "stage3_param_persistence_threshold": 0},
                         zero_tiering={"host_budget": "320KiB"})
    engine, *_ = zero.initialize(model=model, config=config)
    state = sum(seg.nbytes for seg in engine.swap.segments.values())
    hinted, losses = [], []
    for ids in data:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        hinted.append({engine.swap.segments[unit.segment].overwrite_expected for unit in engine.units})
        engine.step()
        losses.append(loss.item())
    after = {seg.overwrite_expected for seg in engine.swap.segments.values()}
    with engine.gathered_parameters():
        params = named_params(model)
    engine.close()
    assert state > 320 << 10
    assert hinted == [{False}, {True}] * steps and after == {False}
    reference = MODELS["gpt2"](0)
    reference_losses = mixed_reference_train(reference, torch.bfloat16, data, accum=accum, clip=clip)
    assert_losses_equal(losses, reference_losses, exact=True)
    assert_params_equal(params, named_params(reference), exact=True)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_bf16_within_tolerance_of_fp32(name):
    """bf16 keeps 8 significant bits: every matmul input is rounded by up to 2^-9 relative, so the loss of
    a 2-layer model carries an error of a fraction of a percent, and the trajectory drifts a little from
    the fp32 one as training goes. Measured here: losses within 0.1% per micro-batch, parameters 0.035-0.05
    of the way from the fp32-trained ones back to the initial ones (global norms). Bounds: 1% on losses,
    0.2 on that ratio: far inside what a real defect gives (a lost update, or weights never written back,
    leave the ratio at 1; a wrong gradient scale moves losses by far more than 1%), with ~5x headroom
    for other CPUs and kernels. Per-parameter ratios are not bounded: a parameter whose exact gradient is
    zero (GPT-2's attention key bias) is steered by rounding noise in both runs."""
    steps, clip = 20, 1.0
    data = batches(steps)
    initial = named_params(MODELS[name](0))
    model = MODELS[name](0)
    engine, *_ = zero.initialize(model=model, config=make_config(2, "cpu", clip=clip, bf16={"enabled": True}))
    losses = engine_train(engine, data)
    engine.close()
    reference = MODELS[name](0).to(engine.device)
    reference_losses = reference_train(
        reference, torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True), data,
        accum=1, clip=clip)
    torch.testing.assert_close(losses, reference_losses, rtol=1e-2, atol=0.0)
    trained, fp32 = named_params(model), named_params(reference)
    off = sum(((trained[k] - fp32[k]) ** 2).sum() for k in fp32).sqrt()
    moved = sum(((fp32[k] - initial[k]) ** 2).sum() for k in fp32).sqrt()
    assert off < 0.2 * moved, f"bf16 ends {off:.3g} from the fp32 run, which moved {moved:.3g} from the start"


def test_bf16_updates_below_resolution_accumulate_in_fp32_masters():
    """With lr 1e-5 and no weight decay, Adam moves each weight by about 1e-5 per step: less than half a
    bf16 ulp for every weight with |w| >= 2^-6 (ulp 2^-13 = 1.2e-4), so bf16 weights stepped alone would
    never change. fp32 masters add the steps up until the rounded weight moves."""
    lr, steps = 1e-5, 20
    model = MODELS["llama"](0)
    config = make_config(2, "cpu", lr=lr, weight_decay=0.0, bf16={"enabled": True})
    engine, *_ = zero.initialize(model=model, config=config)
    large = {name: p.detach().abs() >= 2 ** -6 for name, p in model.named_parameters() if p.dim() == 2}
    start = named_params(model)
    engine_train(engine, batches(steps))
    engine.close()
    after = named_params(model)
    changed = sum((after[k] != start[k])[mask].sum().item() for k, mask in large.items())
    total = sum(mask.sum().item() for mask in large.values())
    assert total > 1000
    assert changed > total // 4, f"only {changed} of {total} weights moved: the masters are not fp32"


def fp16_config(accum, clip, hysteresis, *, window=1000, **extra):
    return make_config(2, "cpu", accum=accum, clip=clip, fp16={
        "enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": window,
        "hysteresis": hysteresis, "min_loss_scale": 1}, **extra)


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_fp16_overflow_skips_exactly_that_step(hysteresis):
    """An inf loss in one micro-batch of optimizer step 2 (and, with hysteresis 2, of step 3 too) makes its
    gradient overflow. DeepSpeed's rules: the step is skipped (parameters unchanged, skipped_steps counts
    it, global_steps still advances, the lr schedule does not), and the scale halves on the overflow that
    uses up the hysteresis (the first with hysteresis 1; with 2 the first only spends one unit of it), and
    `engine.optimizer.overflow` says whether the last step was skipped.
    Every other step trains, exactly as the by-hand fp16 mixed-precision reference that drops the same
    steps, with the same scales and lrs."""
    accum, clip, steps = 2, 1.0, 7
    overflow_steps = [2] if hysteresis == 1 else [2, 3]
    factor = {s * accum + 1: float("inf") for s in overflow_steps}  # the second micro-batch of each
    warmup = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 4e-3,
                                             "warmup_num_steps": 4, "warmup_type": "linear"}}
    data = batches(steps * accum)
    model = MODELS["tied"](0)
    engine, *_ = zero.initialize(model=model, config=fp16_config(accum, clip, hysteresis, scheduler=warmup))
    assert all(p.dtype == torch.float16 for p in model.parameters())
    initial_scale = engine.cur_scale
    assert initial_scale == 2.0 ** 12
    scales, lrs, params, skipped = [], [], [named_params(model)], []
    losses = []
    for step in range(steps):
        scales.append(engine.cur_scale)
        lrs.append(engine.get_lr()[0])
        losses += engine_train(engine, data[step * accum:(step + 1) * accum],
                               loss_factor={i - step * accum: f for i, f in factor.items()})
        params.append(named_params(model))
        skipped.append(engine.skipped_steps)
        assert engine.global_steps == step + 1
        # DeepSpeed's ZeRO optimizers' flag, which DeepSpeed-Chat's PPO trainer reads after each step
        assert engine.optimizer.overflow == (step in overflow_steps)
    for step in range(steps):
        unchanged = all(torch.equal(params[step][k], params[step + 1][k]) for k in params[step])
        assert unchanged == (step in overflow_steps), f"step {step}: parameters {'un' if unchanged else ''}changed"
    assert skipped == [sum(s <= step for s in overflow_steps) for step in range(steps)]
    halved_after = overflow_steps[-1]
    assert scales == [initial_scale] * (halved_after + 1) + [initial_scale / 2] * (steps - halved_after - 1)
    taken = [step for step in range(steps) if step not in overflow_steps]
    schedule = [1e-3 + 3e-3 * min(max(k - 1, 0) / 4, 1.0) for k in range(len(taken))]  # k - 1: DeepSpeed's
    assert [lrs[step] for step in taken] == pytest.approx(schedule, rel=1e-12), "a skipped step advanced the lr"

    reference = MODELS["tied"](0)
    reference_losses = mixed_reference_train(reference, torch.float16, data, accum=accum, clip=clip,
                                             loss_scales=scales, skip=overflow_steps, lrs=[lrs[s] for s in taken])
    kept = [i for i in range(len(data)) if i // accum not in overflow_steps]
    assert_losses_equal([losses[i] for i in kept], [reference_losses[i] for i in kept], exact=exact(engine))
    assert_params_equal(named_params(model), named_params(reference), exact=exact(engine))
    engine.close()


def test_fp16_skipped_step_reports_the_grad_norm_as_deepspeed_does():
    """get_global_grad_norm() as DeepSpeed's engine reports it: None before the first boundary; after a step skipped
    on an overflow, the norm of the last step taken (its ZeRO and fp16 optimizers stash the norm only after the
    overflow check lets the step run), or 0.0 where the first step was skipped (their initial value)."""
    engine, *_ = zero.initialize(model=MODELS["tied"](0), config=fp16_config(1, 1.0, 1))
    assert engine.get_global_grad_norm() is None
    norms = []
    for step, ids in enumerate(batches(4)):
        engine_train(engine, [ids], loss_factor={0: float("inf")} if step in (0, 2) else None)
        norms.append(engine.get_global_grad_norm())
    engine.close()
    assert engine.skipped_steps == 2
    assert norms[0] == 0.0 and norms[1] > 0.0 and norms[2] == norms[1] and norms[3] not in (0.0, norms[1]), norms


def test_fp16_scale_grows_after_clean_window():
    """With loss_scale_window 3 and no overflow, the scale doubles after every third step (DeepSpeed counts
    from iteration 0 with the last overflow at -1)."""
    model = MODELS["tied"](0)
    engine, *_ = zero.initialize(model=model, config=fp16_config(1, 0.0, 2, window=3))
    scales = []
    for ids in batches(7):
        engine_train(engine, [ids])
        scales.append(engine.cur_scale)
    engine.close()
    assert engine.skipped_steps == 0
    base = 2.0 ** 12
    assert scales == [base, base, 2 * base, 2 * base, 2 * base, 4 * base, 4 * base]


def test_fp16_auto_cast_casts_floating_inputs():
    """DeepSpeed's fp16.auto_cast: floating-point inputs of the forward (positional, keyword, in lists and
    dicts) are cast to fp16 before the model sees them; integer inputs are left alone."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    engine, *_ = zero.initialize(model=model, config=make_config(0, "none", fp16={"enabled": True, "auto_cast": True}))
    try:
        out = engine(torch.randn(4, 8))
        assert out.dtype == torch.float16
        engine.backward(out.float().pow(2).mean())
        engine.step()
        assert engine.global_steps == 1
    finally:
        engine.close()
