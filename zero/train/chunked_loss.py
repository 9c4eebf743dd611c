"""The language-model head and its cross-entropy, a chunk of rows at a time: a long sequence's logits (4096
tokens x 50304 words are 786 MiB in fp32, on the device beside the gathered units and gradients) never exist
whole. The forward keeps only the head's input; the backward recomputes each chunk's logits (as Liger's fused
linear cross-entropy and torchtune's chunked loss do), so what the device holds at once is one chunk's."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
"""Targets equal to it add nothing, as in F.cross_entropy."""


def chunk_rows(vocab: int, chunk_bytes: int) -> int:
    """Rows of logits per chunk: their fp32 copy within `chunk_bytes` (one row at least)."""
    return max(1, chunk_bytes // (4 * vocab))


class ChunkedCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of (hidden @ weight.T) in fp32 (or wider) against targets, `rows` rows at a time;
    saves hidden, weight and targets, not the logits."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
        wide = torch.promote_types(hidden.dtype, torch.float32)
        total = torch.zeros((), dtype=wide, device=hidden.device)
        for start in range(0, hidden.shape[0], rows):
            logits = F.linear(hidden[start:start + rows], weight).to(wide)
            total += F.cross_entropy(logits, targets[start:start + rows], reduction="sum", ignore_index=IGNORE_INDEX)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.rows = rows
        return total / (targets != IGNORE_INDEX).sum()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, weight, targets = ctx.saved_tensors
        scale = grad_loss / (targets != IGNORE_INDEX).sum()
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.rows):
            rows = hidden[start:start + ctx.rows]
            logits = F.linear(rows, weight).to(scale.dtype).requires_grad_()
            with torch.enable_grad():
                loss = F.cross_entropy(logits, targets[start:start + ctx.rows], reduction="sum",
                                       ignore_index=IGNORE_INDEX)
            (grad_logits,) = torch.autograd.grad(loss, logits, grad_outputs=scale)
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[start:start + ctx.rows])
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), rows)  # in the weight's dtype, as one matmul's output would be
        return grad_hidden, grad_weight, None, None


class LMHead(nn.Linear):
    """nn.Linear(hidden, vocab, bias=False) that, given targets, returns the mean cross-entropy of its logits
    (fp32), computed whole when the fp32 logits fit in `chunk_bytes` and in chunks of rows beyond."""

    def __init__(self, hidden: int, vocab: int, chunk_bytes: int):
        super().__init__(hidden, vocab, bias=False)
        self.chunk_bytes = chunk_bytes

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        hidden, targets = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
        rows = chunk_rows(self.out_features, self.chunk_bytes)
        if hidden.shape[0] <= rows:
            return F.cross_entropy(super().forward(hidden).float(), targets, ignore_index=IGNORE_INDEX)
        return ChunkedCrossEntropy.apply(hidden, self.weight, targets, rows)
