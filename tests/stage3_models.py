"""Small models, data, configs and the plain-PyTorch reference loop shared by the stage-3 tests.

Every model here is built from a seed, so two calls give identical weights: one copy goes to
`zero.initialize`, the other to the reference (`torch.optim.AdamW(fused=True)`, which the engine's CPU-Adam
and fused device Adam match bitwise). `loss_of(forward, ids)` runs either copy (the engine or the plain
model) and returns its loss, whether the model is a transformers causal LM or one of ours.
"""
from __future__ import annotations

import contextlib
import os
import socket

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zero.optim.gradients import REDUCTION_SCRATCH
from zero.params.unit import UnitState
from zero.train.gpt import GPT, PRESETS, GPTConfig

VOCAB = 96
BATCH, SEQ = 2, 16
LR = 3e-3
"""High enough that losses visibly fall in 20 steps."""
WEIGHT_DECAY = 0.01


@contextlib.contextmanager
def one_thread():
    """Tiny models on a busy 2-core machine: one intra-op thread is ~10x faster than two fighting over
    cores. Restores the previous setting, so other test files are unaffected."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# -- models ----------------------------------------------------------------------------------------------------


def gpt2_config(**overrides):
    from transformers import GPT2Config

    options = dict(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                   embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM")
    options.update(overrides)
    return GPT2Config(**options)


def tiny_gpt2(seed: int = 0, **overrides) -> nn.Module:
    """transformers GPT-2, 2 layers, hidden 32, dropout 0; lm_head.weight is transformer.wte.weight."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(gpt2_config(**overrides))


def llama_config(**overrides):
    from transformers import LlamaConfig

    options = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=SEQ,
                   attention_dropout=0.0)
    options.update(overrides)
    return LlamaConfig(**options)


def tiny_llama(seed: int = 0, **overrides) -> nn.Module:
    """transformers Llama, 2 layers, hidden 32 (untied embeddings, a rotary `inv_freq` buffer)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(**overrides))


OWN_CONFIG = PRESETS["tiny"]
"""zero.train.gpt's tiny preset: 2 blocks, width 64, vocab 256, tied wte/lm_head (our inputs use ids < VOCAB)."""


class CheckpointedGPT(GPT):
    """zero.train.gpt.GPT whose blocks may run under torch.utils.checkpoint: `checkpointing` None (plain),
    "nonreentrant" (use_reentrant=False) or "reentrant" (use_reentrant=True)."""

    def __init__(self, config: GPTConfig = OWN_CONFIG, checkpointing: str | None = None):
        super().__init__(config)
        self.checkpointing = checkpointing

    def run_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing is None or not torch.is_grad_enabled():
            return block(x)
        return checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant")

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = self.run_block(block, x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def own_gpt(seed: int = 0, checkpointing: str | None = None, config: GPTConfig = OWN_CONFIG) -> CheckpointedGPT:
    torch.manual_seed(seed)
    return CheckpointedGPT(config, checkpointing)


class TwiceGPT(CheckpointedGPT):
    """Block 0 runs twice per forward (a module called twice per step: its unit is gathered twice in forward
    and its gradient is the sum of both calls)."""

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        x = self.run_block(self.blocks[0], x)
        for block in self.blocks:
            x = self.run_block(block, x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


class PartlyUnusedGPT(CheckpointedGPT):
    """Block 1 never runs and the position embedding is never used: a unit none of whose parameters gets a
    gradient, and the root unit, some of whose parameters get none. Parameters start with zero gradients
    (as after torch's zero_grad(set_to_none=False)), so torch's AdamW steps every one of them."""

    def __init__(self, config: GPTConfig = OWN_CONFIG):
        super().__init__(config)
        for p in self.parameters():
            p.grad = torch.zeros_like(p)

    def forward(self, idx, targets=None):
        x = self.run_block(self.blocks[0], self.wte(idx))
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


class ScaledBlock(nn.Module):
    """A block that multiplies its output by a parameter it does not own (handed in as a closure), keeps a
    persistent buffer (a fixed per-channel shift) and a running buffer updated in training forwards."""

    def __init__(self, dim: int, scale_of):
        super().__init__()
        self.scale_of = scale_of  # a closure, not a submodule: the parameter belongs to the root unit
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, dim))
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(x.detach().mean((0, 1)), alpha=0.1)
                self.calls += 1
        return x + torch.tanh(self.fc(self.norm(x)) + self.shift) * self.scale_of()


class ClosureModel(nn.Module):
    """A root-level parameter (`gate`) used inside every block's forward through a closure, buffers in the
    blocks, and a BatchNorm (running statistics) at the root."""

    def __init__(self, dim: int = 32, layers: int = 3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.gate = nn.Parameter(torch.full((dim,), 0.5))
        self.blocks = nn.ModuleList(ScaledBlock(dim, lambda: self.gate) for _ in range(layers))
        self.bn = nn.BatchNorm1d(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, idx, targets):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        x = self.bn(x.transpose(1, 2)).transpose(1, 2)
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def closure_model(seed: int = 0) -> ClosureModel:
    torch.manual_seed(seed)
    return ClosureModel()


class CrossBlockTie(nn.Module):
    """The last block's fc Linear is the first block's: one parameter used by two units (the first block's
    unit owns it, so the last block's forward runs while the owner is released)."""

    def __init__(self, dim: int = 32, layers: int = 3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.gate = nn.Parameter(torch.ones(dim))
        self.blocks = nn.ModuleList(ScaledBlock(dim, lambda: self.gate) for _ in range(layers))
        self.blocks[-1].fc = self.blocks[0].fc
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, idx, targets):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).view(-1, VOCAB), targets.reshape(-1))


class BlockWeightAtRoot(nn.Module):
    """The root's forward reads a block's parameter directly (block 0's norm weight scales the logits'
    input), outside that block's forward."""

    def __init__(self, dim: int = 32, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.gate = nn.Parameter(torch.ones(dim))
        self.blocks = nn.ModuleList(ScaledBlock(dim, lambda: self.gate) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, idx, targets):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        x = x * self.blocks[0].norm.weight
        return F.cross_entropy(self.head(x).view(-1, VOCAB), targets.reshape(-1))


class BiasOutBlock(nn.Module):
    """Returns, beside its output, its own parameter's view (its bias, unsqueezed): the caller reads it after the
    block's forward, when the block's unit is released."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(x)), self.fc.bias.unsqueeze(0)


class ParameterViewOut(nn.Module):
    def __init__(self, dim: int = 32, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(BiasOutBlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, idx, targets):
        x = self.embed(idx)
        for block in self.blocks:
            x, bias = block(x)
            x = x + bias
        return F.cross_entropy(self.head(x).view(-1, VOCAB), targets.reshape(-1))


# -- running either copy ---------------------------------------------------------------------------------------


def is_hf(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model.config, "model_type")


def loss_of(forward, ids: torch.Tensor, hf: bool) -> torch.Tensor:
    """The next-token loss of `forward` (the engine or a plain model) on `ids`."""
    if hf:
        return forward(input_ids=ids, labels=ids).loss  # transformers shifts the labels itself
    return forward(ids[:, :-1], ids[:, 1:])


def batches(count: int, batch: int = BATCH, seed: int = 1234) -> list[torch.Tensor]:
    """`count` learnable batches of token ids (each row counts up by one from a random start, a tenth of the
    tokens replaced by noise); the same for every caller with the same seed."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        start = torch.randint(0, VOCAB, (batch, 1), generator=generator)
        ids = (start + torch.arange(SEQ)) % VOCAB
        noise = torch.rand(batch, SEQ, generator=generator) < 0.1
        out.append(torch.where(noise, torch.randint(0, VOCAB, (batch, SEQ), generator=generator), ids))
    return out


def stage3_config(param: str = "none", optimizer: str = "none", *, nvme_path=None, accum: int = 1,
                  clip: float = 0.0, micro: int = BATCH, persistence: int = 0, bf16: bool = False,
                  lr: float = LR, **zero_extra) -> dict:
    """A DeepSpeed-format stage-3 config; `zero_extra` keys go into zero_optimization, a `zero_tiering`
    dict into its own section."""
    tiering = zero_extra.pop("zero_tiering", None)
    zero = {"stage": 3, "stage3_param_persistence_threshold": persistence,
            "offload_param": {"device": param}, "offload_optimizer": {"device": optimizer}}
    for section in ("offload_param", "offload_optimizer"):
        if zero[section]["device"] == "nvme":
            zero[section]["nvme_path"] = str(nvme_path)
    zero.update(zero_extra)
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
              "gradient_clipping": clip, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": WEIGHT_DECAY}}}
    if bf16:
        config["bf16"] = {"enabled": True}
    if tiering is not None:
        config["zero_tiering"] = tiering
    return config


def reference_train(model: nn.Module, data: list[torch.Tensor], *, accum: int = 1, clip: float = 0.0,
                    optimizer: torch.optim.Optimizer | None = None, lr: float = LR,
                    set_to_none: bool = True, loss=None) -> list[float]:
    """Plain PyTorch: per optimizer step, `accum` micro-batches of (loss / accum).backward(), then
    clip_grad_norm_ (clip > 0), AdamW(fused=True).step(), zero_grad(set_to_none). Returns every micro-batch's
    loss. `loss(model, ids)`: a script's own loss (else `loss_of`)."""
    hf = is_hf(model)
    loss_fn = loss or (lambda model, ids: loss_of(model, ids, hf))
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer is None:
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY, fused=True)
    losses = []
    for index, ids in enumerate(data):
        value = loss_fn(model, ids)
        (value / accum).backward()
        losses.append(value.item())
        if (index + 1) % accum == 0:
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
    return losses


def engine_train(engine, data: list[torch.Tensor]) -> list[float]:
    """The engine's loop: forward, backward, step on every micro-batch. Returns every loss."""
    hf = is_hf(engine.module)
    losses = []
    for ids in data:
        loss = loss_of(engine, ids.to(engine.device), hf)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def full_state(engine) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, full and on the CPU, from the engine's (gathering) state_dict."""
    return {k: v.detach().cpu().clone() for k, v in engine.module_state_dict().items()}


def assert_state_equal(actual: dict, expected: dict, *, exact: bool = True, rtol: float = 1e-5,
                       atol: float = 1e-7) -> None:
    assert actual.keys() == expected.keys(), sorted(set(actual) ^ set(expected))
    bad = []
    for name, value in expected.items():
        got = actual[name]
        if exact:
            ok = got.dtype == value.dtype and torch.equal(got, value)
        else:
            ok = torch.allclose(got.double(), value.double(), rtol=rtol, atol=atol)
        if not ok:
            diff = (got.double() - value.double()).abs().max().item() if got.shape == value.shape else "shape"
            bad.append(f"{name}: max abs diff {diff}")
    assert not bad, bad


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_held(engine) -> int:
    """Bytes the device tier counts, less the reduction's scratch (made at the first backward and kept)."""
    return engine.swap.device_tier.in_use - engine.swap.device_tier.parts().get(REDUCTION_SCRATCH, 0)


def units_held(engine) -> list[str]:
    """Names of the units that are still gathered or hold references or armed backward state; empty when
    everything was released (persistent units excepted)."""
    out = []
    for unit in engine.units:
        if unit.refs or unit.state is UnitState.BACKWARD or unit.backward_refs or (unit.gathered and not unit.persistent):
            out.append(f"{unit.flat.name or 'root'} refs={unit.refs} state={unit.state.name} "
                       f"backward_refs={unit.backward_refs} gathered={unit.gathered}")
    return out


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
