"""The model a plan is for, built on the meta device (no memory): a preset of the main job, a Hugging Face
config.json, or an importable factory `package.module:function`. What the planner needs of it is summed up
in a ModelShape."""
from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..train.chunked_loss import chunk_rows
from ..train.gpt import GPT, PRESETS


class PlanInputError(ValueError):
    """A plan's input (model, machine figure, path) is unusable; the message names it and says why."""


@dataclass(frozen=True)
class ModelShape:
    model: nn.Module
    """The model, on meta."""
    params: int
    """Trainable parameters."""
    matmul_params: int
    """Parameters of the Linear layers (and a tied LM head), what the FLOP count multiplies by tokens."""
    layers: int
    hidden: int
    vocab: int
    seq_len: int
    loss_rows: int | None = None
    """Tokens whose logits the loss makes at once (the main job's chunked head); None: all of a micro-batch's."""


def from_preset(name: str, *, layers: int | None = None, hidden: int | None = None, heads: int | None = None,
                seq_len: int = 128) -> ModelShape:
    if name not in PRESETS:
        raise PlanInputError(f"model {name!r}: not a preset of the main job ({', '.join(sorted(PRESETS))}), an "
                             "existing config.json, or a factory `package.module:function`")
    overrides = {"seq_len": seq_len}
    for field, value in (("n_layer", layers), ("n_embd", hidden), ("n_head", heads)):
        if value is not None:
            overrides[field] = value
    try:
        config = replace(PRESETS[name], **overrides)
    except ValueError as exc:  # GPTConfig's own check: a size below 1, a width the heads do not divide
        raise PlanInputError(f"model {name!r}: {exc}") from exc
    with torch.device("meta"):
        model = GPT(config)
    shape = _shape(model, config.n_layer, config.n_embd, config.vocab_size, seq_len)
    return replace(shape, loss_rows=chunk_rows(config.vocab_size, config.loss_chunk_bytes))


def from_hf_config(path: str, seq_len: int) -> ModelShape:
    """A transformers causal LM from its config.json (or the directory holding one), built from the config (no
    weights read). Sizes are read through transformers' config class, so each model's own spellings count
    (GPT-2's n_embd, n_layer, n_head)."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanInputError(f"model config {path!r}: {exc}") from exc
    if "model_type" not in raw:
        raise PlanInputError(f"model config {path!r} has no 'model_type': a Hugging Face config.json names its "
                             "model type (gpt2, llama, ...)")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:
        raise PlanInputError(f"model config {path!r}: planning a Hugging Face model needs transformers "
                             f"(pip install transformers): {exc}") from exc
    try:
        config = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(path)) if os.path.basename(path) ==
                                            "config.json" else path)
    except Exception as exc:  # noqa: BLE001  transformers' own validation errors vary by model and version
        raise PlanInputError(f"model config {path!r}: transformers cannot read it: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0]}") from exc
    sizes = {}
    for key, spellings in (("hidden_size", "n_embd, d_model"), ("num_hidden_layers", "n_layer, num_layers"),
                           ("vocab_size", "")):
        sizes[key] = getattr(config, key, None)
        if not isinstance(sizes[key], int):
            also = f" (or {spellings})" if spellings else ""
            raise PlanInputError(f"model config {path!r} has no {key!r}{also}: the planner needs the width, the "
                                 "layer count and the vocabulary size")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return _shape(model, sizes["num_hidden_layers"], sizes["hidden_size"], sizes["vocab_size"], seq_len)


def from_factory(spec: str, seq_len: int) -> ModelShape:
    """`package.module:function`, called with no arguments under the meta device."""
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise PlanInputError(f"model factory {spec!r}: {exc}") from exc
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise PlanInputError(f"model factory {spec!r} returned {type(model).__name__}, not an nn.Module")
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None) or max(
        (m.in_features for m in model.modules() if isinstance(m, nn.Linear)), default=0)
    layers = getattr(config, "num_hidden_layers", None) or 0
    vocab = getattr(config, "vocab_size", None) or max(
        (m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=0)
    return _shape(model, layers, hidden, vocab, seq_len)


def load_model(spec: str, **preset_overrides) -> ModelShape:
    """A preset name, a config.json (or a directory holding one), or `package.module:function`."""
    seq_len = preset_overrides.get("seq_len", 128)
    if os.path.isfile(spec) or os.path.isfile(os.path.join(spec, "config.json")):
        return from_hf_config(spec, seq_len)
    if ":" in spec:
        return from_factory(spec, seq_len)
    if spec.endswith(".json") or os.sep in spec:
        raise PlanInputError(f"model {spec!r}: no such file")
    return from_preset(spec, **preset_overrides)


def _shape(model: nn.Module, layers: int, hidden: int, vocab: int, seq_len: int) -> ModelShape:
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    linear = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)}
    return ModelShape(model, params, sum(linear.values()) or params, layers, hidden, vocab, seq_len)
