"""ZeRO stages 0-2 in fp32 train exactly as plain PyTorch does (and stage 3, for parameters of odd sizes).

The reference is `torch.optim.AdamW(fused=True)` (the kernel CPU-Adam calls), with the loss divided by the
accumulation steps and `clip_grad_norm_` before `step()`; same seed, same data. On the CPU the engine's
arithmetic is the reference's, operation for operation, so losses and parameters are compared bitwise there
(within 1e-5 relative on an accelerator, where kernels may pick other algorithms for other alignments).
Against torch's default (foreach) AdamW only the losses are compared, within 1e-4: its rounding differs, and
Adam amplifies that on parameters whose gradient is rounding noise (GPT-2's attention key bias).

Every stage meets every offload device once (a Latin square over the three models), and each stage and
each offload device runs with gradient accumulation 4 and clipping 1.0 at least once.
"""
from __future__ import annotations

import math
import re
import warnings

import pytest
import torch

import zero
from zero.config import ConfigError

from models import one_thread  # noqa: F401  (autouse fixture)
from models import (LR, MODELS, WEIGHT_DECAY, assert_losses_equal, assert_params_equal, batches, engine_train,
                    make_config, named_params, no_decay_groups, reference_train)

STEPS = 20

MATRIX = [  # (model, stage, offload_optimizer, gradient_accumulation_steps, gradient_clipping)
    ("gpt2", 0, "none", 1, 0.0),
    ("gpt2", 1, "cpu", 4, 1.0),
    ("gpt2", 2, "nvme", 4, 1.0),
    ("llama", 0, "cpu", 4, 1.0),
    ("llama", 1, "nvme", 1, 1.0),
    ("llama", 2, "none", 4, 1.0),
    ("tied", 0, "nvme", 4, 1.0),
    ("tied", 1, "none", 4, 0.0),
    ("tied", 2, "cpu", 1, 0.0),
]


def train_pair(name, config, *, steps=STEPS, accum=1, clip=0.0, make_reference_optimizer=None,
               model_parameters=None, optimizer=None, lrs=None, norms=None, engine_norms=None):
    """Train the engine and the plain-PyTorch reference on the same data; returns (engine, engine model,
    engine losses, reference model, reference losses). `model_parameters(model)` and `optimizer(model)`
    build what is passed to initialize; `make_reference_optimizer(model)` the reference's optimizer. The
    gradient norms of every step are appended to `norms` (the reference's) and `engine_norms`."""
    data = batches(steps * accum)
    model = MODELS[name](0)
    engine, _, _, _ = zero.initialize(
        model=model, config=config,
        model_parameters=model_parameters(model) if model_parameters else None,
        optimizer=optimizer(model) if optimizer else None)
    try:
        losses = engine_train(engine, data, norms=engine_norms)
    finally:
        engine.close()
    reference = MODELS[name](0).to(engine.device)
    make_reference_optimizer = make_reference_optimizer or (
        lambda m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True))
    reference_losses = reference_train(reference, make_reference_optimizer(reference), data, accum=accum, clip=clip,
                                       lrs=lrs, norms=norms)
    return engine, model, losses, reference, reference_losses


def exact(engine) -> bool:
    return engine.device.type == "cpu"


@pytest.mark.parametrize("name,stage,offload,accum,clip", MATRIX,
                         ids=[f"{m}-stage{s}-{o}-gas{a}-clip{c:g}" for m, s, o, a, c in MATRIX])
def test_fp32_matches_fused_adamw(name, stage, offload, accum, clip, tmp_path):
    config = make_config(stage, offload, accum=accum, clip=clip, nvme_path=tmp_path)
    norms: list[float] = []
    engine_norms: list[float] = []
    engine, model, losses, reference, reference_losses = train_pair(name, config, accum=accum, clip=clip, norms=norms,
                                                                    engine_norms=engine_norms)
    assert_losses_equal(losses, reference_losses, exact=exact(engine))
    assert_params_equal(named_params(model), named_params(reference), exact=exact(engine))
    assert engine.global_steps == STEPS and engine.skipped_steps == 0
    assert sum(losses[-accum:]) < sum(losses[:accum]), "the run must train (losses fall), or parity proves little"
    if clip:
        assert max(norms) > clip, "clipping never acted: this case would not notice a clipping bug"
        assert engine_norms == pytest.approx(norms, rel=0 if exact(engine) else 1e-5), "gradient norms differ"
    if offload == "nvme":
        assert engine.swap.stats.bytes_moved["nvme->host"] > 0, "the optimizer state never came from nvme"
        assert not any(tmp_path.iterdir()), "close() leaves the nvme store's file behind"


def test_nvme_state_streamed_under_a_small_host_budget(tmp_path):
    """A host budget (200 KiB) smaller than the optimizer state (368 KiB of fp32 masters and moments) with
    sub-groups of 2048 elements: every step streams the state nvme -> host -> nvme within the budget, and
    the result is still exact (no clipping here: with sub-groups cut inside parameters the clipping norm is
    summed by pieces, see test_sub_groups_smaller_than_units)."""
    accum, budget = 2, 200 * 1024
    config = make_config(2, "nvme", accum=accum, nvme_path=tmp_path, zero_optimization={"sub_group_size": 2048},
                         zero_tiering={"host_budget": budget})
    engine, model, losses, reference, reference_losses = train_pair("gpt2", config, steps=4, accum=accum)
    stats = engine.swap.stats
    state_bytes = 3 * 4 * sum(sg.numel for sg in engine.driver.sub_groups)
    assert state_bytes > budget
    assert stats.peak_bytes["host"] <= budget
    assert stats.bytes_moved["nvme->host"] >= 3 * state_bytes, "the state was not streamed from nvme every step"
    assert_losses_equal(losses, reference_losses, exact=exact(engine))
    assert_params_equal(named_params(model), named_params(reference), exact=exact(engine))


def test_communication_data_type_rounds_each_gradient_for_the_reduction():
    """fp32 training with bf16 communication (DeepSpeed's communication_data_type): each gradient is reduced
    in bf16, so the engine equals a reference whose gradients a hook rounds to bf16, bit for bit."""
    config = make_config(2, "cpu", clip=1.0, communication_data_type="bf16")

    def rounding_adamw(model):
        for p in model.parameters():
            p.register_hook(lambda g: g.bfloat16().float())
        return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    engine, model, losses, reference, reference_losses = train_pair("llama", config, steps=6, clip=1.0,
                                                                    make_reference_optimizer=rounding_adamw)
    assert_losses_equal(losses, reference_losses, exact=exact(engine))
    assert_params_equal(named_params(model), named_params(reference), exact=exact(engine))
    _, fp32_model, *_ = train_pair("llama", make_config(2, "cpu", clip=1.0), steps=6, clip=1.0)
    assert any(not torch.equal(a, b) for a, b in zip(named_params(model).values(), named_params(fp32_model).values()))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_fp32_losses_match_default_adamw(name, tmp_path):
    """The default (foreach) AdamW rounds differently; losses still agree closely over 20 steps."""
    accum, clip = 4, 1.0
    config = make_config(2, "cpu", accum=accum, clip=clip)
    engine, model, losses, reference, reference_losses = train_pair(
        name, config, accum=accum, clip=clip,
        make_reference_optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WEIGHT_DECAY))
    torch.testing.assert_close(losses, reference_losses, rtol=1e-4, atol=0.0)


@pytest.mark.parametrize("stage,offload", [(0, "cpu"), (2, "nvme")])
def test_sub_groups_smaller_than_units(stage, offload, tmp_path):
    """sub_group_size cuts each unit into sub-groups whose edges fall inside parameters (1000 elements, not
    a multiple of any row): the step and the clipping norm still cover every element once. Only the
    norm's summation order changes (per-piece norms), hence a tolerance, and Llama (no biases: GPT-2's
    attention key bias has a gradient of pure rounding noise, which Adam turns into visible differences)."""
    accum, clip = 2, 1.0
    config = make_config(stage, offload, accum=accum, clip=clip, nvme_path=tmp_path,
                         zero_optimization={"sub_group_size": 1000})
    engine, model, losses, reference, reference_losses = train_pair("llama", config, steps=8, accum=accum, clip=clip)
    assert len(engine.driver.sub_groups) > len(engine.units), "sub_group_size did not split any unit"
    assert_losses_equal(losses, reference_losses, exact=False)
    assert_params_equal(named_params(model), named_params(reference), exact=False)


@pytest.mark.parametrize("stage", [1, 3])
def test_odd_sized_params_cut_by_odd_sub_groups_match_fused_adamw_bitwise(stage):
    """torch's fused AdamW rounds the last numel % 8 elements of each parameter its own way (exp_avg_sq's FMA
    in its scalar tail): the step rounds those so wherever they lie in a sub-group, and no others, where
    sub_group_size 13 cuts parameters anywhere (stage 3: the master is the cpu parameter shard). The derived host
    budget counts each 13-element segment's 4 KiB page."""
    extra = {"sub_group_size": 13, **({"offload_param": {"device": "cpu"}} if stage == 3 else {})}
    config = make_config(stage, "cpu", zero_optimization=extra)
    engine, model, losses, reference, reference_losses = train_pair("odd", config, steps=15)
    assert len(engine.driver.sub_groups) > 10
    assert_losses_equal(losses, reference_losses, exact=True)
    assert_params_equal(named_params(model), named_params(reference), exact=True)


def test_no_decay_param_groups(tmp_path):
    """The Hugging Face Trainer's split (biases and norms without weight decay) through model_parameters,
    with a decay high enough that applying it to the wrong group shows."""
    decay, accum, clip = 0.1, 2, 1.0
    config = make_config(2, "cpu", accum=accum, clip=clip, weight_decay=decay)
    engine, model, losses, reference, reference_losses = train_pair(
        "gpt2", config, steps=10, accum=accum, clip=clip,
        model_parameters=lambda m: no_decay_groups(m, decay),
        make_reference_optimizer=lambda m: torch.optim.AdamW(no_decay_groups(m, decay), lr=LR, fused=True))
    assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [decay, 0.0]
    assert_losses_equal(losses, reference_losses, exact=exact(engine))
    assert_params_equal(named_params(model), named_params(reference), exact=exact(engine))


def test_param_groups_with_own_lr_under_warmup_cosine(tmp_path):
    """WarmupCosineLR scales each group's own lr: two groups with different lrs, the reference given the
    schedule by hand (DeepSpeed's formula, written out here)."""
    accum, steps, warmup, total, min_ratio, cos_min = 1, 12, 4, 10, 0.1, 0.2
    lrs_of_groups = (LR, LR / 3)

    def groups(m):
        g = no_decay_groups(m, WEIGHT_DECAY)
        return [{**g[0], "lr": lrs_of_groups[0]}, {**g[1], "lr": lrs_of_groups[1]}]

    def ratio(k):  # DeepSpeed's WarmupCosineLR (log warmup) at iteration k: optimizer step k + 1 runs at it
        if k < 0:
            return 0.0
        if k < warmup:
            return min_ratio + (1 - min_ratio) * math.log(k + 1) / math.log(warmup)
        progress = min(k - warmup + 1, total - warmup) / (total - warmup)
        return max(0.0, cos_min + (1 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)

    schedule = [[lr * ratio(k - 1) for lr in lrs_of_groups] for k in range(steps)]
    config = make_config(1, "cpu", accum=accum, scheduler={"type": "WarmupCosineLR", "params": {
        "total_num_steps": total, "warmup_num_steps": warmup, "warmup_min_ratio": min_ratio,
        "cos_min_ratio": cos_min}})
    data = batches(steps)
    model = MODELS["tied"](0)
    engine, _, _, scheduler = zero.initialize(model=model, config=config, model_parameters=groups(model))
    seen = []
    for ids in data:
        seen.append(engine.get_lr())
        engine_train(engine, [ids])
    assert scheduler is not None
    for k in range(steps):
        assert seen[k] == pytest.approx(schedule[k], rel=1e-12), f"lr at optimizer step {k}"
    reference = MODELS["tied"](0)
    reference_losses = reference_train(reference, torch.optim.AdamW(groups(reference), fused=True), data,
                                       accum=accum, clip=0.0, lrs=seen)
    assert_params_equal(named_params(model), named_params(reference), exact=exact(engine))
    engine.close()


@pytest.mark.parametrize("kind,warmup_type", [("WarmupLR", "log"), ("WarmupLR", "linear"), ("WarmupDecayLR", "log")])
def test_warmup_schedules(kind, warmup_type, tmp_path):
    """WarmupLR / WarmupDecayLR from the config: the lr of optimizer step k (counted from 0, stepped once per
    accumulation boundary) is the schedule at iteration k - 1, warmup_min_lr before the start, as under
    DeepSpeed's engine; the same sequence the reference is given by hand (DeepSpeed's formulas, written out
    here)."""
    accum, steps, warmup, total, low, high = 2, 8, 4, 7, 1e-4, 4e-3
    params = {"warmup_min_lr": low, "warmup_max_lr": high, "warmup_num_steps": warmup, "warmup_type": warmup_type}
    if kind == "WarmupDecayLR":
        params["total_num_steps"] = total
    config = make_config(0, "nvme", accum=accum, clip=1.0, nvme_path=tmp_path,
                         scheduler={"type": kind, "params": params})

    def gamma(k):
        if k < 0:
            return 0.0
        if k < warmup:
            return math.log(k + 1) / math.log(warmup) if warmup_type == "log" else k / warmup
        return 1.0 if kind == "WarmupLR" else max(0.0, (total - k) / (total - warmup))

    schedule = [[low + (high - low) * gamma(k - 1)] for k in range(steps)]
    data = batches(steps * accum)
    model = MODELS["llama"](0)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    seen = []
    for index, ids in enumerate(data):
        if index % accum == 0:
            seen.append(engine.get_lr())
        else:
            assert engine.get_lr() == seen[-1], "the lr moved inside an accumulation window"
        engine_train(engine, [ids])
    engine.close()
    assert seen == [pytest.approx(lrs, rel=1e-12) for lrs in schedule]
    reference = MODELS["llama"](0)
    reference_train(reference, torch.optim.AdamW(reference.parameters(), weight_decay=WEIGHT_DECAY, fused=True),
                    data, accum=accum, clip=1.0, lrs=schedule)
    assert_params_equal(named_params(model), named_params(reference), exact=exact(engine))


@pytest.mark.parametrize("kind", ["AdamW", "Adam", "CPUAdam"])
def test_user_optimizer_instead_of_config(kind):
    """A torch.optim.AdamW / Adam or our CPUAdam passed to initialize (no optimizer section): its
    hyperparameters and param groups are taken over; Adam's weight decay is classic L2 (added to the
    gradient), CPUAdam's (adamw_mode by default) decoupled."""
    config = make_config(1, "cpu", accum=2, clip=1.0, optimizer=None)
    options = dict(lr=2e-3, betas=(0.8, 0.99), eps=1e-7)
    cls = zero.CPUAdam if kind == "CPUAdam" else getattr(torch.optim, kind)
    reference_cls = torch.optim.AdamW if kind == "CPUAdam" else cls
    engine, model, losses, reference, reference_losses = train_pair(
        "tied", config, steps=10, accum=2, clip=1.0, optimizer=lambda m: cls(no_decay_groups(m, 0.05), **options),
        make_reference_optimizer=lambda m: reference_cls(no_decay_groups(m, 0.05), **options, fused=True))
    assert engine.optimizer.param_groups[0]["decoupled"] is (kind != "Adam")
    assert_losses_equal(losses, reference_losses, exact=exact(engine))
    assert_params_equal(named_params(model), named_params(reference), exact=exact(engine))


@pytest.mark.parametrize("adam_w_mode", [False, True])
def test_config_adam_type(adam_w_mode, tmp_path):
    """Config type "Adam": DeepSpeed's adam_w_mode (default true) decides AdamW vs classic Adam."""
    decay = 0.1
    config = make_config(2, "nvme", nvme_path=tmp_path, optimizer="Adam", weight_decay=decay)
    config["optimizer"]["params"]["adam_w_mode"] = adam_w_mode
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    engine, model, losses, reference, reference_losses = train_pair(
        "gpt2", config, steps=10, make_reference_optimizer=lambda m: cls(m.parameters(), lr=LR, weight_decay=decay,
                                                                         fused=True))
    assert_losses_equal(losses, reference_losses, exact=exact(engine))
    assert_params_equal(named_params(model), named_params(reference), exact=exact(engine))


def test_model_parameters_subset_trains_only_those():
    """Parameters left out of model_parameters (and frozen ones) are not trained; the rest match a
    reference whose optimizer and clipping see only the same subset."""
    accum, clip = 2, 1.0
    config = make_config(2, "cpu", accum=accum, clip=clip)
    data = batches(6 * accum)

    def subset(m):
        return [p for name, p in m.named_parameters() if name.startswith("blocks.")]

    model = MODELS["tied"](0)
    before = named_params(model)
    engine, *_ = zero.initialize(model=model, config=config, model_parameters=subset(model))
    engine_train(engine, data)
    engine.close()
    reference = MODELS["tied"](0)
    params = subset(reference)
    reference_train(reference, torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True), data,
                    accum=accum, clip=clip, params=params)
    after = named_params(model)
    for name in ("embed.weight", "pos", "norm.weight", "frozen"):
        assert torch.equal(after[name], before[name]), f"{name} was not in model_parameters but changed"
    assert_params_equal(after, named_params(reference), exact=exact(engine))


class _Halving:
    def __init__(self, gamma: float = 0.5):
        self.gamma = gamma

    def __call__(self, step: int) -> float:
        return self.gamma ** step


def test_torch_scheduler_on_user_optimizer():
    """deepspeed.initialize(optimizer=opt, lr_scheduler=LambdaLR(opt, ...)) is the common way to bring a
    torch schedule: the engine steps the scheduler at each boundary, and the lr it steps with must follow."""
    steps = 6
    model = MODELS["tied"](0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _Halving())
    engine, _, _, returned = zero.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                             config=make_config(1, "cpu", optimizer=None))
    assert returned is scheduler
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the engine's step comes first: torch has nothing to warn of
        for ids in batches(steps):
            seen.append(engine.get_lr())
            engine_train(engine, [ids])
    assert seen == [[LR * 0.5 ** k] for k in range(steps)]


@pytest.mark.parametrize("source", ["config optimizer", "user optimizer"])
def test_torch_scheduler_factory(source):
    """lr_scheduler may be a callable taking the optimizer (deepspeed.initialize's contract). The Hugging Face
    Trainer passes one whenever the config has an optimizer and no scheduler: it builds its torch schedule
    (e.g. get_linear_schedule_with_warmup, a LambdaLR) on the optimizer DeepSpeed hands it."""
    model = MODELS["tied"](0)
    if source == "config optimizer":
        kwargs = dict(config=make_config(0, "none"))
    else:
        kwargs = dict(config=make_config(0, "none", optimizer=None),
                      optimizer=torch.optim.AdamW(model.parameters(), lr=LR))
    engine, _, _, scheduler = zero.initialize(
        model=model, lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _Halving()), **kwargs)
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine_train(engine, batches(2))
    assert engine.get_lr() == [LR * 0.25]


def test_an_optimizer_in_the_call_overrides_the_configs():
    """As DeepSpeed's initialize documents (a GAN script of DeepSpeedExamples passes one beside its config's)."""
    model = MODELS["tied"](0)
    with pytest.warns(UserWarning, match="optimizer section .* is ignored"):
        engine, *_ = zero.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.0123),
                                     config=make_config(lr=LR))
    try:
        assert engine.get_lr() == [0.0123]
    finally:
        engine.close()


def test_unsupported_user_optimizer_is_named():
    model = MODELS["tied"](0)
    with pytest.raises(ConfigError, match="SGD"):
        zero.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        config=make_config(optimizer=None))


@pytest.mark.parametrize("flag", ["amsgrad", "maximize", "capturable", "differentiable"])
@pytest.mark.parametrize("source", ["optimizer", "model_parameters"])
def test_an_unsupported_option_on_one_param_group_is_named(flag, source):
    """torch honours these per param group: one group asking for one raises, naming the group and the option
    (it was stepped as plain AdamW)."""
    model = MODELS["odd"](0)
    groups = [{"params": [model.embed.weight]}, {"params": list(model.head.parameters()), flag: True}]
    if source == "optimizer":
        kwargs = dict(optimizer=torch.optim.AdamW(groups, lr=LR), config=make_config(optimizer=None))
    else:
        kwargs = dict(model_parameters=groups, config=make_config())
    key = f"optimizer.param_groups[1].{flag}" if source == "optimizer" else f"model_parameters[1].{flag}"
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)} = True: not supported"):
        zero.initialize(model=model, **kwargs)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_complex_parameter_to_train_is_refused(stage):
    """The units hold real elements: a complex parameter was left out of them and silently never stepped."""
    from zero.integrations.unsupported import UnsupportedFeatureError

    model = MODELS["odd"](0)
    model.phase = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
    with pytest.raises(UnsupportedFeatureError, match=r"training a torch.complex64 parameter of shape \(4,\)"):
        zero.initialize(model=model, model_parameters=model.parameters(), config=make_config(stage=stage))
    model.phase.requires_grad_(False)  # frozen, it stays as it is
    zero.initialize(model=model, model_parameters=model.parameters(), config=make_config(stage=stage))[0].close()
