"""A graph kept alive beside the backward pins no frozen unit (zero/params/frozen.py): a frozen unit is held from the
moment a backward reaches its block's outputs until its block's inputs have their gradients, so a grad-enabled
forward whose loss is kept (for logging, or to be backwarded later) leaves every block's base to be released as its
block's backward ends, as without it; a kept loss backwarded later gathers the base again, layer by layer. The runs
are plain PyTorch's doing the same, bit for bit (LoRA on a 4-layer Llama, ZeRO-3 offloaded to cpu, accumulation 2).
"""
from __future__ import annotations

import pytest
import torch

import zero

from stage3_models import LR, WEIGHT_DECAY, assert_state_equal, batches, full_state, one_thread, stage3_config, \
    units_held
from test_frozen import CLIP, lora, trainable

ACCUM, LAYERS = 2, 4


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def run(forward, backward, step, data: list[torch.Tensor], kept: str | None) -> list[float]:
    """The script: per step, micro-batches of forward and backward. `kept` "logged": every micro-batch also computes
    a grad-enabled loss on the next batch, kept to the end and never backwarded; "later": the first micro-batch of a
    step computes the second's loss with its own, and the second backwards it. Returns the backwarded losses."""
    logged, losses = [], []
    for first in range(0, len(data), ACCUM):
        later = None
        for index in range(first, first + ACCUM):
            ids = data[index]
            if kept == "logged":
                logged.append(forward(data[(index + 1) % len(data)]))
            if later is None or kept != "later":
                loss = forward(ids)
                if kept == "later" and index == first:
                    later = forward(data[index + 1])
            else:
                loss = later
            backward(loss)
            step(index)
            losses.append(loss.item())
    return losses


def plain(data: list[torch.Tensor], kept: str | None) -> tuple[list[float], dict]:
    model = lora("llama", num_hidden_layers=LAYERS)
    optimizer = torch.optim.AdamW(trainable(model), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def step(index: int) -> None:
        if (index + 1) % ACCUM == 0:
            torch.nn.utils.clip_grad_norm_(trainable(model), CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    losses = run(lambda ids: model(input_ids=ids, labels=ids).loss, lambda loss: (loss / ACCUM).backward(), step,
                 data, kept)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine_run(data: list[torch.Tensor], kept: str | None) -> tuple[list[float], dict, list[int], list[int]]:
    """The engine's run, and for each backward the most blocks whose frozen units were gathered at once and the
    device tier's peak."""
    model = lora("llama", num_hidden_layers=LAYERS)
    engine, *_ = zero.initialize(model=model, config=stage3_config("cpu", "cpu", accum=ACCUM, clip=CLIP),
                                 model_parameters=trainable(model))
    placement, tier, most, peaks = engine.placement, engine.swap.device_tier, [], []
    gather = placement.gather

    def counting(unit):
        gather(unit)
        if torch._C._current_graph_task_id() == -1:
            return  # a forward's
        blocks = {id(u.block) for u in placement.units if u.frozen and u.gathered and u.block is not model}
        most[-1] = max(most[-1], len(blocks))

    def backward(loss: torch.Tensor) -> None:
        most.append(0)
        tier.peak = tier.in_use
        engine.backward(loss)
        peaks.append(tier.peak)
        assert units_held(engine) == []

    placement.gather = counting
    try:
        losses = run(lambda ids: engine(input_ids=ids, labels=ids).loss, backward, lambda index: engine.step(),
                     data, kept)
        return losses, full_state(engine), most, peaks
    finally:
        engine.close()


@pytest.mark.parametrize("kept", ["logged", "later"])
def test_a_kept_graph_pins_no_frozen_unit_and_trains_as_plain_pytorch(kept):
    """Through every backward at most one block's frozen units are gathered at once (held until the backward's end,
    all four would be), and the device peak of each backward is the run's without kept graphs; losses and weights
    are plain PyTorch's bits."""
    data = batches(2 * ACCUM)
    expected_losses, expected_state = plain(data, kept)
    losses, state, most, peaks = engine_run(data, kept)
    assert losses == expected_losses
    assert_state_equal(state, expected_state)
    assert most == [1] * len(data), most
    if kept == "logged":
        assert peaks == engine_run(data, None)[3]
