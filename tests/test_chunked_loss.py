"""The main job's LM head computes its cross-entropy a chunk of rows at a time (zero.train.chunked_loss): the loss
and gradients are the unchunked ones' (float64 gradcheck; fp32 to rounding), training through ZeRO-3 with
activation offload is bit for bit plain PyTorch's with the same model, and the logits never rest whole on the
device: the device tier's peak with offload drops by about their size."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import zero
from zero.train.chunked_loss import IGNORE_INDEX, ChunkedCrossEntropy, LMHead, chunk_rows
from zero.train.gpt import GPT, GPTConfig

from stage3_models import VOCAB, batches, engine_train, full_state, one_thread, reference_train, stage3_config
from test_stage3_parity import assert_bitwise

CHUNKED = GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=VOCAB, seq_len=16, loss_chunk_bytes=4 * VOCAB * 5)
"""Five rows of logits at a time: a 2 x 15 batch's loss is 6 chunks."""


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def targets_with_ignored(n: int, vocab: int) -> torch.Tensor:
    targets = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(3))
    targets[::4] = IGNORE_INDEX
    return targets


def test_gradients_are_the_loss_gradients_in_float64():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 6, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(7, 6, dtype=torch.float64, generator=generator, requires_grad=True)
    targets = targets_with_ignored(11, 7)
    assert torch.autograd.gradcheck(lambda h, w: ChunkedCrossEntropy.apply(h, w, targets, 3), (hidden, weight))


@pytest.mark.parametrize("rows", [1, 4, 11, 64])
def test_equal_to_unchunked_cross_entropy(rows):
    """fp32: the loss is the mean over the rows not ignored, the gradients the unchunked ones to rounding (a
    chunk's matrix product rounds as its own shape does; the weight's gradient sums the chunks')."""
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(11, 16, generator=generator)
    weight = torch.randn(32, 16, generator=generator)
    targets = targets_with_ignored(11, 32)
    results = []
    for chunked in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = (ChunkedCrossEntropy.apply(h, w, targets, rows) if chunked
                else F.cross_entropy(F.linear(h, w), targets, ignore_index=IGNORE_INDEX))
        (loss * 3).backward()
        results.append((loss.detach(), h.grad, w.grad))
    (loss, grad_h, grad_w), (ref_loss, ref_h, ref_w) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad_h, ref_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_w, ref_w, rtol=1e-5, atol=1e-6)


def test_head_below_its_chunk_is_plain_cross_entropy():
    """A batch whose fp32 logits fit in one chunk: exactly F.cross_entropy of the logits, as before chunking."""
    head = LMHead(16, 32, chunk_bytes=4 * 32 * 64)
    x = torch.randn(2, 5, 16)
    targets = torch.randint(0, 32, (2, 5))
    expected = F.cross_entropy(head(x).float().view(-1, 32), targets.reshape(-1))
    assert torch.equal(head(x, targets), expected)
    assert chunk_rows(32, 4 * 32 * 64) == 64 and chunk_rows(32, 1) == 1


def chunked_gpt(seed: int, config: GPTConfig = CHUNKED) -> GPT:
    torch.manual_seed(seed)
    model = GPT(config)
    model.gradient_checkpointing_enable()
    return model


@pytest.mark.parametrize("tier,activations", [("cpu", "cpu"), ("nvme", "nvme")])
def test_engine_trains_the_chunked_head_bit_for_bit(tier, activations, tmp_path):
    """ZeRO-3 (the tied head gathered for each forward and again for the backward's recomputation), every block
    checkpointed, activations offloaded: bitwise plain torch with the same model."""
    data = batches(4)
    config = stage3_config(tier, tier, nvme_path=tmp_path, clip=1.0, accum=2,
                           zero_tiering={"activation_offload": activations})
    engine, *_ = zero.initialize(model=chunked_gpt(0), config=config)
    try:
        losses = engine_train(engine, data)
        state = full_state(engine)
    finally:
        engine.close()
    net = chunked_gpt(0)
    ref_losses = reference_train(net, data, accum=2, clip=1.0)
    assert_bitwise(losses, state, ref_losses, {k: v.detach().clone() for k, v in net.state_dict().items()})


def test_offloaded_peak_drops_by_the_logits():
    """A head whose fp32 logits (16 x 15 tokens x 4096 words: 3.75 MiB) outweigh the rest of what the device
    holds: with the loss whole they are an activation on the device when made, whatever the offload does with
    them after; chunked, only the head's input is saved, and the device tier's peak falls by more than half
    their bytes."""
    wide = replace(CHUNKED, vocab_size=4096)
    logits_bytes, chunk_bytes = 16 * 15 * 4096 * 4, 4 * 4096 * 5
    peaks, saved = {}, {}
    for chunk in (logits_bytes, chunk_bytes):
        config = stage3_config("cpu", "cpu", micro=16, zero_tiering={"activation_offload": "cpu"})
        engine, *_ = zero.initialize(model=chunked_gpt(0, replace(wide, loss_chunk_bytes=chunk)), config=config)
        try:
            engine_train(engine, batches(2, batch=16))
            peaks[chunk], saved[chunk] = engine.swap.stats.peak_bytes["device"], engine.activations.saved_bytes
        finally:
            engine.close()
    assert saved[logits_bytes] - saved[chunk_bytes] >= 2 * logits_bytes  # two steps' logits no longer saved
    assert peaks[logits_bytes] - peaks[chunk_bytes] >= logits_bytes / 2, peaks
