"""backward() called on what the engine's forward returned, instead of engine.backward(loss) (DeepSpeed 0.18.3+ takes
it): a loss computed outside the model trains as engine.backward of the same loss does, at every stage. At stages 0-2
such a backward used to leave its gradients in p.grad and the step applied nothing, silently.

The accumulation steps are 2, a power of two: dividing the gradients (the direct backward) and the loss
(engine.backward) round alike, so the runs are compared bitwise.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zero

from models import one_thread  # noqa: F401  (autouse fixture)
from models import MODELS, assert_params_equal, batches, make_config, named_params

ACCUM = 2


def train(name: str, config: dict, data: list[torch.Tensor], *, direct: str | None) -> tuple[list[float], dict]:
    """Every micro-batch: the forward through the engine, the loss from its logits outside the model, then
    engine.backward(loss) (`direct` None), loss.backward() ("loss") or the logits' backward with their own
    gradient ("logits"), and engine.step(). Returns the losses and the trained parameters."""
    engine, *_ = zero.initialize(model=MODELS[name](0), config=config)
    try:
        losses = []
        for ids in data:
            logits = engine(input_ids=ids).logits
            if direct == "logits":
                leaf = logits.detach().requires_grad_()
                loss = F.cross_entropy(leaf[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
                loss.backward()
                logits.backward(leaf.grad)
            else:
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
                engine.backward(loss) if direct is None else loss.backward()
            engine.step()
            losses.append(loss.item())
        return losses, named_params(engine.module)
    finally:
        engine.close()


@pytest.mark.parametrize("name, stage, offload, direct", [
    ("llama", 0, "none", "loss"), ("gpt2", 1, "cpu", "loss"), ("llama", 2, "cpu", "logits"),
    ("tied", 3, "cpu", "loss"), ("gpt2", 3, "none", "logits")])
def test_a_backward_of_the_forwards_outputs_trains_as_engine_backward(name, stage, offload, direct):
    config = make_config(stage, offload, accum=ACCUM, clip=1.0)
    if stage == 3:
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    data = batches(4 * ACCUM)
    losses, params = train(name, config, data, direct=direct)
    expected_losses, expected = train(name, config, data, direct=None)
    assert losses == expected_losses
    assert_params_equal(params, expected, exact=True)
    initial = named_params(MODELS[name](0))
    assert not all(torch.equal(params[k], initial[k]) for k in params)  # it trained


def test_gradients_the_engine_never_saw_are_an_error_at_step():
    """A backward of something computed from the model's parameters around the engine's forward leaves its
    gradients in p.grad: step() after a micro-batch no engine backward saw says so instead of stepping without
    them."""
    model = MODELS["llama"](0)
    engine, *_ = zero.initialize(model=model, config=make_config(2, "cpu"))
    try:
        sum(p.sum() for p in engine.module.parameters()).backward()
        with pytest.raises(RuntimeError, match="hold gradients no engine backward took"):
            engine.step()
    finally:
        engine.close()


def test_fp16_needs_its_loss_scaled_for_a_direct_backward():
    """engine.scale(loss).backward() trains as engine.backward(loss), within fp16's rounding (the gradients are
    halved after the backward rather than the loss before it: a subnormal fp16 gradient rounds); an unscaled
    backward is an error (its fp16 gradients would underflow silently)."""
    config = make_config(2, "cpu", accum=ACCUM, fp16={"enabled": True, "initial_scale_power": 8})
    data = batches(2 * ACCUM)
    trained = {}
    for how in ("engine", "scaled", "unscaled"):
        engine, *_ = zero.initialize(model=MODELS["llama"](0), config=config)
        try:
            for ids in data:
                loss = engine(input_ids=ids, labels=ids).loss
                if how == "engine":
                    engine.backward(loss)
                elif how == "scaled":
                    engine.scale(loss).backward()
                else:
                    with pytest.raises(RuntimeError, match="engine.scale"):
                        loss.backward()
                    break
                engine.step()
            trained[how] = named_params(engine.module)
        finally:
            engine.close()
    assert_params_equal(trained["scaled"], trained["engine"], exact=False, rtol=1e-3, atol=1e-4)
