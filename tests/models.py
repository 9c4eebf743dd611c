"""Tiny models and the plain-PyTorch reference loop the engine tests compare against.

Every model takes `input_ids` (and `labels`) and returns an object with `.loss`, as Hugging Face causal LMs
do, so one training loop drives them all. Models are built from a seed, so two calls give identical
weights: one copy goes to `zero.initialize`, the other to the reference.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 96
BATCH, SEQ = 2, 16

LR = 3e-3
"""High enough that the tiny models' losses fall visibly in 20 steps on `batches()`."""

WEIGHT_DECAY = 0.01


@pytest.fixture(autouse=True)
def one_thread():
    """torch on one intra-op thread for the test, restored after. These models are tiny: a second thread
    buys nothing, and on a loaded machine its spin-waits made runs 5-10x slower. Engine and reference run
    alike, so exactness is unaffected. Autouse in every module that imports it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- models ---------------------------------------------------------------------------------------------------


def tiny_gpt2(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM")
    return GPT2LMHeadModel(config)


def tiny_llama(seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=SEQ,
                         attention_dropout=0.0)
    return LlamaForCausalLM(config)


class Block(nn.Module):
    """Pre-norm causal self-attention + MLP, in plain torch."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TiedBlocks(nn.Module):
    """Our own model: embedding, an nn.ModuleList of blocks, a final norm and an output head.

    Two ties cross unit boundaries: the head's weight is the embedding's (both in the root unit), and the
    last block's `up` Linear is the first block's (one parameter used by two units: the first block owns it,
    the last block's gradient must still reach it). A `frozen` buffer-like parameter with requires_grad False
    must be left alone."""

    def __init__(self, dim: int = 32, heads: int = 2, layers: int = 3, vocab: int = VOCAB):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.pos = nn.Parameter(torch.randn(SEQ, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.blocks[-1].up = self.blocks[0].up
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.frozen = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        x = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x) * self.frozen)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return SimpleNamespace(loss=loss, logits=logits)


def tied_blocks(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TiedBlocks()


class OddSizes(nn.Module):
    """Parameters whose sizes are no multiple of 8 (15, 3, 21, 7, 96): torch's fused AdamW rounds each one's last
    numel % 8 elements its own way."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 5)
        self.a = nn.Linear(5, 3)
        self.b = nn.Linear(3, 7)
        self.head = nn.Linear(7, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        logits = self.head(torch.tanh(self.b(torch.tanh(self.a(self.embed(input_ids))))))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return SimpleNamespace(loss=loss, logits=logits)


def odd_sizes(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return OddSizes()


MODELS: dict[str, Callable[[int], nn.Module]] = {"gpt2": tiny_gpt2, "llama": tiny_llama, "tied": tied_blocks,
                                                 "odd": odd_sizes}


# -- data -----------------------------------------------------------------------------------------------------


def batches(count: int, batch: int = BATCH, seed: int = 1234) -> list[torch.Tensor]:
    """`count` batches of token ids (batch x SEQ), the same for every caller with the same seed.

    Learnable, so losses fall over a short run: each sequence counts up by one (mod VOCAB) from a random
    start, and a tenth of the tokens are replaced by random ones."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        start = torch.randint(0, VOCAB, (batch, 1), generator=generator)
        ids = (start + torch.arange(SEQ)) % VOCAB
        noise = torch.rand(batch, SEQ, generator=generator) < 0.1
        out.append(torch.where(noise, torch.randint(0, VOCAB, (batch, SEQ), generator=generator), ids))
    return out


def no_decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The Hugging Face Trainer's split: biases and norm weights get no weight decay."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if name.endswith("bias") or "norm" in name or "ln_" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# -- configs ----------------------------------------------------------------------------------------------------


def make_config(stage: int = 0, offload: str = "none", *, accum: int = 1, clip: float = 0.0, nvme_path=None,
                lr: float = LR, weight_decay: float = WEIGHT_DECAY, optimizer: str | None = "AdamW",
                micro: int = BATCH, **extra) -> dict:
    """A DeepSpeed-format config dict; `optimizer=None` leaves the optimizer section out (the caller passes
    one); `extra` is merged in at the top level (a `zero_optimization` dict there is merged into ours)."""
    zero = {"stage": stage, "offload_optimizer": {"device": offload}}
    if offload == "nvme":
        zero["offload_optimizer"]["nvme_path"] = str(nvme_path)
    zero.update(extra.pop("zero_optimization", {}))
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
              "gradient_clipping": clip, "zero_optimization": zero}
    if optimizer is not None:
        config["optimizer"] = {"type": optimizer, "params": {"lr": lr, "weight_decay": weight_decay}}
    config.update(extra)
    return config


# -- the references ----------------------------------------------------------------------------------------------

def reference_train(model: nn.Module, optimizer: torch.optim.Optimizer, data: list[torch.Tensor], *, accum: int,
                    clip: float, lrs: Iterable[list[float]] | None = None, norms: list[float] | None = None,
                    params: list[nn.Parameter] | None = None) -> list[float]:
    """Plain PyTorch: per optimizer step, `accum` micro-batches of (loss / accum).backward(), then
    clip_grad_norm_ over `params` (default: every trainable parameter) if clip > 0, step, zero_grad.
    `lrs` (one list per optimizer step, one lr per param group) is set before each step; the total norms
    clip_grad_norm_ returns are appended to `norms`. Returns every micro-batch's loss."""
    losses = []
    lrs = iter(lrs) if lrs is not None else None
    params = params if params is not None else [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    for start in range(0, len(data), accum):
        for ids in data[start:start + accum]:
            ids = ids.to(device)
            loss = model(input_ids=ids, labels=ids).loss
            (loss / accum).backward()
            losses.append(loss.item())
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
            if norms is not None:
                norms.append(norm.item())
        if lrs is not None:
            for group, lr in zip(optimizer.param_groups, next(lrs), strict=True):
                group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def mixed_reference_train(model: nn.Module, dtype: torch.dtype, data: list[torch.Tensor], *, accum: int,
                          clip: float, lr: float = LR, weight_decay: float = WEIGHT_DECAY,
                          loss_scales: list[float] | None = None, skip: Iterable[int] = (),
                          lrs: list[float] | None = None) -> list[float]:
    """Plain-PyTorch mixed precision, as DeepSpeed's bf16/fp16 training is defined: fp32 master copies of
    the (fp32-initialized) parameters stepped by AdamW(fused=True), the parameters cast to `dtype` for forward
    and backward (floating buffers keep their dtype, as DeepSpeed 0.19.3+ keeps them), each micro-batch's low-precision gradients cast to fp32 and summed into the masters'
    grads, (loss.float() * loss scale / accum) differentiated, the masters' grads unscaled by the loss
    scale and clipped, the updated masters copied (rounded) into the model. `loss_scales` gives the scale of
    each optimizer step (default 1); the optimizer steps listed in `skip` are dropped (their gradients
    discarded), as an fp16 overflow drops them; `lrs` gives the lr of each optimizer step taken. Returns
    every micro-batch's loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    for p in model.parameters():  # parameters in `dtype`; buffers (Llama's rotary inv_freq) keep theirs
        p.data = p.data.to(dtype)
    optimizer = torch.optim.AdamW(masters, lr=lr, weight_decay=weight_decay, fused=True)
    skip = set(skip)
    lrs = iter(lrs) if lrs is not None else None
    losses = []
    for step, start in enumerate(range(0, len(data), accum)):
        scale = loss_scales[step] if loss_scales is not None else 1.0
        for ids in data[start:start + accum]:
            ids = ids.to(params[0].device)
            loss = model(input_ids=ids, labels=ids).loss
            (loss.float() / accum * scale).backward()
            for p, m in zip(params, masters):
                g = p.grad.float() if p.grad is not None else torch.zeros_like(m)
                m.grad = g if m.grad is None else m.grad.add_(g)
                p.grad = None
            losses.append(loss.item())
        if step not in skip:
            for m in masters:
                m.grad.div_(scale)  # a power of two: exact
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(masters, clip)
            if lrs is not None:
                optimizer.param_groups[0]["lr"] = next(lrs)
            optimizer.step()
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
        optimizer.zero_grad(set_to_none=True)
    return losses


def engine_train(engine, data: list[torch.Tensor], *, loss_factor: dict[int, float] | None = None,
                 norms: list[float] | None = None) -> list[float]:
    """The engine's loop: forward, backward, step for every micro-batch. `loss_factor` multiplies the loss
    of the listed micro-batches before backward (inf forces an fp16 overflow); the gradient norm of every
    optimizer step is appended to `norms`. Returns every loss."""
    losses = []
    for index, ids in enumerate(data):
        ids = ids.to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        if loss_factor and index in loss_factor:
            loss = loss * loss_factor[index]
        engine.backward(loss)
        steps = engine.global_steps
        engine.step()
        if norms is not None and engine.global_steps > steps:
            norms.append(engine.get_global_grad_norm())
        losses.append(loss.item())
    return losses


def named_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached fp32 CPU copies of every parameter (tied ones once)."""
    return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}


def assert_params_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *,
                        exact: bool, rtol: float = 1e-5, atol: float = 1e-7) -> None:
    """Every parameter equal: bitwise if `exact`, else within rtol (relative) + atol."""
    assert actual.keys() == expected.keys()
    for name in actual:
        if exact:
            if not torch.equal(actual[name], expected[name]):
                diff = (actual[name] - expected[name]).abs().max().item()
                raise AssertionError(f"{name} differs from the reference (max abs diff {diff:.3g})")
        else:
            torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=atol,
                                       msg=lambda m, name=name: f"{name}: {m}")


def assert_losses_equal(actual: list[float], expected: list[float], *, exact: bool, rtol: float = 1e-5) -> None:
    assert len(actual) == len(expected)
    if exact:
        assert actual == expected, [(i, a, e) for i, (a, e) in enumerate(zip(actual, expected)) if a != e][:5]
    else:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=0.0)
