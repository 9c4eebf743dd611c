"""The checkpoint tests' model, config, data and loop (tests/test_checkpoint.py and its children,
tests/test_export.py, tests/test_faults.py): the same in the test process and in the processes it starts."""
from __future__ import annotations

from collections import namedtuple

import torch
import torch.nn.functional as F
from torch import nn

import zero

VOCAB, BATCH, SEQ = 97, 2, 16
GAS = 2
"""Micro-batches per optimizer step in every checkpoint test."""


Output = namedtuple("Output", "loss logits")


class TinyBlock(nn.Module):
    def __init__(self, dim: int, dropout: float):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class TinyLM(nn.Module):
    """Embedding and positions, two residual MLP blocks with dropout (so resuming needs the RNG states), a
    final norm, a head tied to the embedding, and a persistent buffer that forward changes (so resuming needs
    the buffers). No transformers import: children start fast."""

    def __init__(self, dropout: float = 0.0, dim: int = 32, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.randn(SEQ, dim) * 0.02)
        self.blocks = nn.ModuleList(TinyBlock(dim, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.long))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        if self.training:
            self.tokens_seen += input_ids.numel()
        x = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return Output(loss, logits)  # a namedtuple: the partitioner finds the tensors in it (pytree)


def tiny_lm(seed: int = 0, dropout: float = 0.0, dim: int = 32) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(dropout, dim)


def gpt2(seed: int = 0):
    """A tiny transformers GPT-2 (for what needs transformers: the export's config.json, from_pretrained)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def ds_config(stage: int, dtype: str, offload: str, nvme_path: str, sub_group_size: int = 4096) -> dict:
    """ZeRO `stage` with the optimizer state (and, for stage 3, the parameters) offloaded to `offload`."""
    return {
        "train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
        "bf16": {"enabled": dtype == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-3,
                                                     "warmup_num_steps": 5, "warmup_type": "linear"}},
        "zero_optimization": {
            "stage": stage, "stage3_param_persistence_threshold": 0, "sub_group_size": sub_group_size,
            "offload_param": {"device": offload if stage == 3 else "none", "nvme_path": nvme_path},
            "offload_optimizer": {"device": offload, "nvme_path": nvme_path},
        },
    }


CONFIGS = {  # name: (stage, dtype, offload, dropout)
    "stage3-fp32-nvme-dropout": (3, "fp32", "nvme", 0.1),
    "stage3-bf16-nvme": (3, "bf16", "nvme", 0.0),
    "stage2-bf16-nvme": (2, "bf16", "nvme", 0.0),
}


def build(name: str, nvme_path: str, tiering: dict | None = None, dim: int = 32, **overrides):
    """The engine of a CONFIGS entry on a TinyLM `dim` wide; `overrides` go to zero_optimization, `tiering` is
    the zero_tiering section."""
    stage, dtype, offload, dropout = CONFIGS[name]
    config = ds_config(stage, dtype, offload, nvme_path)
    config["zero_optimization"].update(overrides)
    if tiering:
        config["zero_tiering"] = tiering
    engine, *_ = zero.initialize(model=tiny_lm(dropout=dropout, dim=dim), config=config)
    return engine


def batch(micro_step: int) -> torch.Tensor:
    """The micro-batch of a given micro step: the same whoever asks, whatever ran before."""
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(10_000 + micro_step))


def train(engine, steps: int) -> list[torch.Tensor]:
    """`steps` optimizer steps from where the engine stands; returns every micro-batch's loss."""
    losses = []
    for _ in range(steps * GAS):
        ids = batch(engine.micro_steps)
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
    return losses


def unit_pieces(engine, part: str) -> list[tuple[int, int, torch.Tensor]]:
    """(unit index, start, values) of this rank's `part` ('param' or an optimizer state) in unit coordinates."""
    out = []
    for piece in engine.state_tensors():
        if piece.part == part:
            with piece.held(False) as t:
                out.append((piece.unit, piece.start, t.detach().cpu().clone()))
    return out


def snapshot(engine) -> dict:
    """Everything a resumed run must reproduce, as host tensors and numbers."""
    state = {f"module/{k}": v.detach().cpu().clone() for k, v in engine.module_state_dict().items()}
    for part in ("param", "master", "exp_avg", "exp_avg_sq"):
        for index, start, values in unit_pieces(engine, part):
            state[f"{part}/{index}/{start}"] = values
    state["counters"] = (engine.global_steps, engine.micro_steps, engine.skipped_steps, engine.optimizer.step_count)
    state["lr"] = engine.get_lr()
    return state


def full_units(pieces: list[tuple[int, int, torch.Tensor]], units) -> list[torch.Tensor]:
    """Each unit's first `numel` elements assembled from (index, start, values) pieces of any ranks; `units`
    are an engine's."""
    out = [torch.full((unit.flat.numel,), float("nan")) for unit in units]
    for index, start, values in pieces:
        end = min(start + values.numel(), units[index].flat.numel)
        if start < end:
            out[index][start:end] = values[: end - start].float()
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), f"{key} differs"
        else:
            assert a[key] == b[key], f"{key}: {a[key]} != {b[key]}"
