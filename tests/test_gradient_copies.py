"""The gradients' way to the host (zero/optim/gradient_copies.py): each sub-group's part of a unit's reduced
gradient is copied on the copy stream (on CPU the copy worker, slowed down here) into a staging buffer, in the
dtype it was reduced in, and added by the adder thread, never by the backward's. Training matches torch bit for
bit with every copy delayed; an add that fails fails the backward;
no copy sees its source (the device's reduction scratch) change in flight; and with the wait for a copy's event
taken out, the same test fails (so it checks the ordering, not a synchronous copy)."""
from __future__ import annotations

import threading

import pytest
import torch

import zero
from zero.optim.driver import AdamDriver
from zero.optim.gradient_copies import GradientCopies

from stage3_models import batches, engine_train, full_state, own_gpt, stage3_config
from test_stage3_copies import SMALL, DelayedCopies, _one_thread, reference  # noqa: F401  (autouse fixture)


def make():
    return own_gpt(0, None, SMALL)


def train_delayed(monkeypatch, tmp_path, offload: str, **config):
    delayed = DelayedCopies(monkeypatch, delay=0.003)
    sent: list[torch.dtype] = []
    send = GradientCopies.send
    monkeypatch.setattr(GradientCopies, "send", lambda self, scratch, part, add: (
        sent.append(part.dtype), send(self, scratch, part, add))[1])
    engine, *_ = zero.initialize(model=make(), config=stage3_config(offload, offload, nvme_path=tmp_path,
                                                                    sub_group_size=4096, **config))
    try:
        losses = engine_train(engine, batches(3))
        return losses, full_state(engine), delayed, sent
    finally:
        engine.close()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_delayed_gradient_copies_train_bit_for_bit(offload, monkeypatch, tmp_path):
    ref_losses, ref_state = reference(make, batches(3))
    losses, state, delayed, sent = train_delayed(monkeypatch, tmp_path, offload)
    assert sent and set(sent) == {torch.float32}
    assert not delayed.reused, delayed.reused
    assert losses == ref_losses
    assert all(torch.equal(state[k], v) for k, v in ref_state.items())


def test_bf16_gradients_cross_in_two_bytes(monkeypatch, tmp_path):
    _, _, delayed, sent = train_delayed(monkeypatch, tmp_path, "cpu", bf16=True)
    assert sent and set(sent) == {torch.bfloat16}
    assert not delayed.reused, delayed.reused


def test_without_the_wait_for_a_copy_the_test_fails(monkeypatch, tmp_path):
    """The add reads the staging buffer before the delayed copy has filled it: the results go wrong, which is
    what the tests above would see if the wait were missing."""
    def add_without_waiting(self, event, staged, add):
        with self.swap.untraced():
            add(staged)

    monkeypatch.setattr(GradientCopies, "_add", add_without_waiting)
    ref_losses, ref_state = reference(make, batches(3))
    losses, state, _, _ = train_delayed(monkeypatch, tmp_path, "cpu")
    assert losses != ref_losses or any(not torch.equal(state[k], v) for k, v in ref_state.items())


def test_without_the_wait_before_a_scratch_is_reused_the_test_fails(monkeypatch, tmp_path):
    """Every unit reduces into the same device scratch, not waiting for the copies still reading it: a delayed
    copy sees its source change in flight."""
    monkeypatch.setattr(GradientCopies, "scratch", lambda self: 0)
    _, _, delayed, _ = train_delayed(monkeypatch, tmp_path, "cpu")
    assert delayed.reused


def test_the_adder_adds_not_the_backwards_thread(monkeypatch, tmp_path):
    """The backward's thread only queues the adds (each after its delayed copy): its time goes to the next unit."""
    threads = []
    accumulate = AdamDriver.accumulate
    monkeypatch.setattr(AdamDriver, "accumulate", lambda self, *args, **kwargs: (
        threads.append(threading.current_thread().name), accumulate(self, *args, **kwargs))[1])
    ref_losses, ref_state = reference(make, batches(3))
    losses, state, _, _ = train_delayed(monkeypatch, tmp_path, "nvme")
    assert threads and {name.split("_")[0] for name in threads} == {"zero-gradient-add"}, set(threads)
    assert losses == ref_losses
    assert all(torch.equal(state[k], v) for k, v in ref_state.items())


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_an_add_that_fails_fails_the_backward(offload, monkeypatch, tmp_path):
    """The third add raises on the adder: the backward that queued it raises that error, the speculative round
    whose unit waited on it is rolled back (all sub-groups step at the boundary), and the engine closes."""
    calls = []
    accumulate = AdamDriver.accumulate

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device (injected)")
        return accumulate(self, *args, **kwargs)

    monkeypatch.setattr(AdamDriver, "accumulate", failing)
    engine, *_ = zero.initialize(model=make(), config=stage3_config(offload, offload, nvme_path=tmp_path,
                                                                    sub_group_size=4096))
    try:
        with pytest.raises(OSError, match="injected"):
            engine_train(engine, batches(1))
        if engine.speculation is not None:
            assert engine.speculation.settle(engine.optimizer.param_groups, engine.optimizer.step_count + 1, 1.0,
                                             clipped=False, overflow=False) == engine.driver.sub_groups  # all
    finally:
        engine.close()
