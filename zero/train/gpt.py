"""A GPT-style causal language model for the training command: byte-level by default (vocab 256), learned
positions, pre-norm blocks, tied input/output embeddings. Sizes by preset or by hand; built on meta by the
command so that only one unit at a time is ever materialized."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zero.train.chunked_loss import LMHead


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    """Tokens; 256 for the byte-level default corpus."""
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    seq_len: int = 128
    """Longest sequence (positions learned up to here)."""
    loss_chunk_bytes: int = 128 << 20
    """The most fp32 logits the loss makes at once: longer batches compute it in chunks of rows (LMHead)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "n_embd", "seq_len", "loss_chunk_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} = {getattr(self, name)}: must be >= 1")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd = {self.n_embd} is not a multiple of n_head = {self.n_head}")

    @property
    def params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        d = self.n_embd
        block = 12 * d * d + 13 * d
        return self.vocab_size * d + self.seq_len * d + self.n_layer * block + 2 * d


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=64),
    "small": GPTConfig(n_layer=6, n_head=8, n_embd=512),
    "124m": GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, seq_len=1024),
    "350m": GPTConfig(n_layer=24, n_head=16, n_embd=1024, vocab_size=50304, seq_len=1024),
    "1b": GPTConfig(n_layer=24, n_head=16, n_embd=2048, vocab_size=50304, seq_len=1024),
    "3b": GPTConfig(n_layer=32, n_head=32, n_embd=2560, vocab_size=50304, seq_len=1024),
    "7b": GPTConfig(n_layer=32, n_head=32, n_embd=4096, vocab_size=50304, seq_len=1024),
}


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        d = config.n_embd
        self.n_head = config.n_head
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.seq_len, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = LMHead(config.n_embd, config.vocab_size, config.loss_chunk_bytes)
        self.lm_head.weight = self.wte.weight
        self.gradient_checkpointing = False
        """Recompute each block in the backward (torch.utils.checkpoint): autograd keeps only the blocks' inputs."""
        self.apply(self._init_weights)  # on meta a no-op: zero-tiering's materializer calls it unit by unit

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2's initialization, per module (what zero-tiering's materializer calls, unit by unit)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02
            if module in [b.proj for b in self.blocks] + [b.fc_proj for b in self.blocks]:
                std = 0.02 / (2 * self.config.n_layer) ** 0.5  # residual projections
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def gradient_checkpointing_enable(self) -> None:
        """Hugging Face's name for it: checkpoint every block."""
        self.gradient_checkpointing = True

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        recompute = self.gradient_checkpointing and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return self.lm_head(self.ln_f(x), targets)
