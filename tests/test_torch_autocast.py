"""DeepSpeed's `torch_autocast`: the engine's forward under torch.autocast over fp32 parameters trains as plain
PyTorch does under the same autocast (bitwise on the CPU; within 1e-3 relative on a GPU), and autograd keeps no
copy of a parameter's cast from the forward to the backward (zero/services/autocast.py).

The reference: the same model in fp32, its forward (loss included) under torch.autocast with its cache of casts
off, as the engine runs it, AdamW(fused=True); for fp16, torch.amp.GradScaler as DeepSpeed steps an fp16 autocast
run (scale 2^16, halved on an overflow). (With the cache on, torch's default, a parameter read twice in one forward,
as the tied model's shared `up` Linear, is cast once and its two gradients are summed in the autocast dtype before
the cast back; with it off each read has its cast and the sum is in fp32.)"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import zero
from zero.config import ConfigError

from models import one_thread  # noqa: F401  (autouse fixture)
from models import (LR, MODELS, WEIGHT_DECAY, assert_losses_equal, batches, engine_train, make_config,
                    named_params)
from stage3_models import assert_state_equal, full_state


pytestmark = pytest.mark.filterwarnings("ignore:bf16 compute:UserWarning", "ignore:fp16 compute:UserWarning")


def autocast_config(stage, offload, tmp_path, *, dtype="bfloat16", accum=1, clip=0.0, **extra):
    zo = {}
    if stage == 3:
        zo["offload_param"] = {"device": offload, **({"nvme_path": str(tmp_path)} if offload == "nvme" else {})}
    return make_config(stage, offload, accum=accum, clip=clip, nvme_path=tmp_path, zero_optimization=zo,
                       torch_autocast={"enabled": True, "dtype": dtype}, **extra)


def autocast_reference(model, data, *, dtype, accum, clip, device=torch.device("cpu"), overflow=()):
    """Plain PyTorch under torch.autocast on `device`: AdamW(fused=True); fp16 with a GradScaler (unscale_ before
    clipping). `overflow`: micro-batches whose loss is multiplied by inf. Returns every loss."""
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    losses = []
    for start in range(0, len(data), accum):
        for index in range(start, start + accum):
            ids = data[index].to(device)
            with torch.autocast(device.type, dtype=dtype, cache_enabled=False):
                loss = model(input_ids=ids, labels=ids).loss
            factor = float("inf") if index in overflow else 1.0
            scaler.scale(loss.float() * factor / accum).backward()
            losses.append(loss.item())
        scaler.unscale_(optimizer)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return losses


@pytest.mark.parametrize("name,stage,offload,accum,clip", [
    ("gpt2", 3, "cpu", 2, 1.0),
    ("llama", 3, "nvme", 1, 0.0),
    ("tied", 3, "cpu", 1, 1.0),
    ("llama", 2, "cpu", 2, 1.0),
    ("gpt2", 0, "none", 1, 0.0),
])
def test_bf16_autocast_trains_as_plain_pytorch_under_autocast(name, stage, offload, accum, clip, tmp_path):
    data = batches(6 * accum)
    model = MODELS[name](0)
    engine, _, _, _ = zero.initialize(model=model, config=autocast_config(stage, offload, tmp_path, accum=accum,
                                                                          clip=clip))
    try:
        assert engine.torch_autocast_enabled() and engine.torch_autocast_dtype() == torch.bfloat16
        losses = engine_train(engine, data)
        trained = full_state(engine)
    finally:
        engine.close()
    reference, exact = MODELS[name](0), engine.device.type == "cpu"  # elsewhere kernels differ with alignment
    expected = autocast_reference(reference, data, dtype=torch.bfloat16, accum=accum, clip=clip, device=engine.device)
    assert_losses_equal(losses, expected, exact=exact, rtol=1e-3)
    assert_state_equal(trained, cpu_state(reference), exact=exact, rtol=1e-3, atol=1e-5)
    assert losses != autocast_reference(MODELS[name](0), data, dtype=torch.float16, accum=accum, clip=clip), \
        "the autocast dtype changes nothing here: the comparison would not see a forward run outside autocast"


def test_fp16_autocast_scales_the_loss_as_a_grad_scaler_and_skips_an_overflow(tmp_path):
    data = batches(6)
    model = MODELS["gpt2"](0)
    engine, _, _, _ = zero.initialize(model=model, config=autocast_config(3, "cpu", tmp_path, dtype="torch.float16",
                                                                          clip=1.0))
    try:
        assert engine.cur_scale == 2.0**16
        losses = engine_train(engine, data, loss_factor={2: float("inf")})
        assert engine.skipped_steps == 1 and engine.cur_scale == 2.0**15
        trained = full_state(engine)
    finally:
        engine.close()
    reference, exact = MODELS["gpt2"](0), engine.device.type == "cpu"
    expected = autocast_reference(reference, data, dtype=torch.float16, accum=1, clip=1.0, device=engine.device,
                                  overflow={2})
    assert_losses_equal([x for i, x in enumerate(losses) if i != 2], [x for i, x in enumerate(expected) if i != 2],
                        exact=exact, rtol=1e-3)
    assert_state_equal(trained, cpu_state(reference), exact=exact, rtol=1e-3, atol=1e-5)


def cpu_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


class LiveCasts(TorchDispatchMode):
    """Weak references to every cast to `dtype` of a tensor shaped as one of `shapes` made while active."""

    def __init__(self, dtype, shapes):
        super().__init__()
        self.dtype, self.shapes, self.made = dtype, shapes, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func is torch.ops.aten._to_copy.default and out.dtype == self.dtype
                and tuple(out.shape) in self.shapes and args[0].dtype != self.dtype):
            self.made.append(weakref.ref(out))
        return out

    def alive(self) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.made)


@pytest.mark.parametrize("stage,offload,activation_offload", [(3, "cpu", None), (3, "nvme", "cpu"), (0, "none", None)])
def test_no_cast_of_a_parameter_is_kept_from_the_forward_to_the_backward(stage, offload, activation_offload,
                                                                        tmp_path):
    model = MODELS["llama"](0)
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    extra = {"zero_tiering": {"activation_offload": activation_offload}} if activation_offload else {}
    engine, _, _, _ = zero.initialize(model=model, config=autocast_config(stage, offload, tmp_path, **extra))
    try:
        ids = batches(1)[0].to(engine.device)
        casts = LiveCasts(torch.bfloat16, shapes)
        with casts:
            loss = engine(input_ids=ids, labels=ids).loss
        assert len(casts.made) >= len(shapes), "the forward cast no weight: the test would see nothing"
        assert casts.alive() == 0
        before = named_params(model) if stage == 0 else None
        engine.backward(loss)
        engine.step()
        if before is not None:
            assert any(not torch.equal(before[k], v) for k, v in named_params(model).items())
    finally:
        engine.close()


def test_a_parameter_written_between_forward_and_backward_is_named():
    model = MODELS["gpt2"](0)
    engine, _, _, _ = zero.initialize(model=model, config=autocast_config(0, "none", None))
    try:
        ids = batches(1)[0].to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        with torch.no_grad():
            model.lm_head.weight.mul_(2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation.*written after the forward cast it"):
            engine.backward(loss)
    finally:
        engine.close()


@pytest.mark.parametrize("section,key,match", [
    ({"enabled": True, "dtype": "float32"}, "torch_autocast.dtype", "bfloat16 or float16 only"),
    ({"enabled": True, "dtype": "int4"}, "torch_autocast.dtype", "expected one of"),
    ({"enabled": True, "lower_precision_safe_modules": ["torch.nn.Linearr"]},
     "torch_autocast.lower_precision_safe_modules", "'torch.nn.Linearr' is not an importable class"),
])
def test_bad_torch_autocast_sections_are_named(section, key, match):
    with pytest.raises(ConfigError, match=match) as error:
        zero.initialize(model=MODELS["gpt2"](0), config=make_config(torch_autocast=section))
    assert error.value.key == key


def test_autocast_in_another_dtype_than_the_models_is_refused():
    with pytest.raises(ConfigError, match="bf16.enabled casts the model to bf16"):
        zero.initialize(model=MODELS["gpt2"](0), config=make_config(
            bf16={"enabled": True}, torch_autocast={"enabled": True, "dtype": "fp16"}))
