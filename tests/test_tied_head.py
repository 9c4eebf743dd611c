"""A weight tied between an embedding and the head (zero/params/tied_head.py): the head's gradient waits on the
host through the blocks' backward and is added back before the unit's reduction, so the bits are plain PyTorch's
(the device peak this saves: test_stage3_memory.py). Found in the models that tie; a forward that leaves the
embedding unused, or reads the head twice, still trains as plain PyTorch does."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zero
from zero.params.flat_unit import ParamSlot
from zero.params.tied_head import tied_heads
from zero.params.unit import GRADIENTS

from stage3_models import (
    VOCAB, batches, engine_train, full_state, one_thread, own_gpt, reference_train, stage3_config, tiny_gpt2,
    tiny_llama,
)


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


class TiedToy(nn.Module):
    """An embedding, two blocks and a head tied to the embedding. `embed`: how the inputs reach the blocks
    ("embedding", or "one-hot" through a linear map: the tied weight then gets the head's gradient alone);
    `heads`: how many times the head reads the weight (twice: two gradients of its own in one backward)."""

    def __init__(self, embed: str = "embedding", heads: int = 1, dim: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.heads = embed, heads
        self.wte = nn.Embedding(VOCAB, dim)
        if embed == "one-hot":  # (a parameter no forward uses would step differently: torch's AdamW skips it)
            self.one_hot = nn.Linear(VOCAB, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.Tanh())
                                    for _ in range(2))
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        x = self.wte(idx) if self.embed == "embedding" else self.one_hot(F.one_hot(idx, VOCAB).float())
        for block in self.blocks:
            x = x + block(x)
        loss = F.cross_entropy(self.head(x).flatten(0, 1), targets.reshape(-1))
        if self.heads == 2:
            loss = loss + F.cross_entropy(self.head(x * 0.5).flatten(0, 1), targets.reshape(-1))
        return loss


def test_tied_weights_are_found_where_models_tie():
    def slots(model):
        return [ParamSlot(name, p, 0, p.numel(), p.shape) for name, p in model.named_parameters()]

    gpt2, own, llama = tiny_gpt2(), own_gpt(), tiny_llama()
    (slot, head, name, embedding), = tied_heads(gpt2, slots(gpt2))
    assert head is gpt2.lm_head and name == "weight" and embedding is gpt2.transformer.wte
    assert slot.param is gpt2.transformer.wte.weight
    assert len(tied_heads(own, slots(own))) == 1
    assert tied_heads(llama, slots(llama)) == []  # the tiny Llama does not tie: nothing to do


@pytest.mark.parametrize("embed, heads", [("embedding", 1), ("one-hot", 1), ("embedding", 2)])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_the_head_gradient_through_the_host_trains_as_plain_pytorch(embed, heads, tier, tmp_path):
    """Three steps of accumulation 2 with clipping: losses and every weight the same bits as plain PyTorch's
    (two head reads: the second part joins the first on the host, which is the order autograd adds them in)."""
    data = batches(6)
    model = TiedToy(embed, heads)
    reference = copy.deepcopy(model)
    expected = reference_train(reference, data, accum=2, clip=1.0)
    engine, *_ = zero.initialize(model=model, config=stage3_config(tier, tier, nvme_path=tmp_path, accum=2,
                                                                   clip=1.0))
    try:
        assert len(engine.placement._tied) == 1
        assert engine_train(engine, data) == expected
        state = full_state(engine)
        for name, value in reference.state_dict().items():
            assert torch.equal(state[name], value), name
        assert engine.swap.device_tier.parts().get(GRADIENTS, 0) == 0  # every reservation given back
    finally:
        engine.close()
