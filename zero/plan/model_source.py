"""The model a plan is for, built on the meta device (no memory): a preset of the main job, a Hugging Face
config.json, or an importable factory `package.module:function`. What the planner needs of it is summed up
in a ModelShape."""
from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..train.chunked_loss import chunk_rows
from ..train.gpt import GPT, PRESETS


SEQ_LEN = 128
"""Tokens a sequence when --seq-len is not given: the main job's default."""


class PlanInputError(ValueError):
    """A plan's input (model, machine figure, path) is unusable; the message names it and says why."""


@dataclass(frozen=True)
class ModelShape:
    model: nn.Module
    """The model, on meta."""
    params: int
    """Trainable parameters."""
    matmul_params: int
    """Parameters of the Linear and Conv1D layers (and a tied LM head), what the FLOP count multiplies by tokens;
    of a mixture of experts' stacked expert weights, the share a token uses (num_experts_per_tok of them)."""
    layers: int
    hidden: int
    vocab: int
    seq_len: int
    loss_rows: int | None = None
    """Tokens whose logits the loss makes at once (the main job's chunked head); None: all of a micro-batch's."""


def from_preset(name: str, *, layers: int | None = None, hidden: int | None = None, heads: int | None = None,
                seq_len: int = SEQ_LEN) -> ModelShape:
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


NEEDED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
"""The sizes a config.json must state itself: transformers fills a missing one with its class default (a llama
without num_hidden_layers has 32), which would price another model without a word."""
OTHER_SPELLINGS = {"num_hidden_layers": ("n_layer", "num_layers", "n_layers"), "hidden_size": ("n_embd", "d_model"),
                   "num_attention_heads": ("n_head", "num_heads", "n_heads")}
"""Other models' names for the NEEDED sizes, named when a config.json uses one its own class does not read."""
FLAGS = {"num_hidden_layers": "--layers", "hidden_size": "--hidden", "num_attention_heads": "--heads"}


def from_hf_config(path: str, seq_len: int | None = None, *, layers: int | None = None, hidden: int | None = None,
                   heads: int | None = None) -> ModelShape:
    """A transformers causal LM, or a vision-language model built on one (its sizes those of its text_config, its
    image encoder's parameters counted, their compute priced per text token as the rest), from its config.json (or
    the directory holding one), built from the config (no weights read). Sizes are read through the config
    class's attribute_map, so each model's own spellings count (GPT-2's n_embd, n_layer, n_head); --layers, --hidden
    and --heads replace them under the same spelling."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanInputError(f"model config {path!r}: {exc}") from exc
    where = f"model config {path!r}"
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise PlanInputError(f"{where} has no 'model_type': a Hugging Face config.json is a JSON object naming its "
                             "model type (gpt2, llama, ...)")
    try:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                            MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    except ImportError as exc:
        raise PlanInputError(f"{where}: planning a Hugging Face model needs transformers "
                             f"(pip install transformers): {exc}") from exc
    kind = raw["model_type"]
    if kind not in CONFIG_MAPPING:
        raise PlanInputError(f"{where}: model_type {kind!r} is not one this transformers knows")
    if kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        auto = AutoModelForCausalLM
    elif kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        auto = AutoModelForImageTextToText  # a vision-language model: an image encoder beside a causal LM
    else:
        raise PlanInputError(f"{where}: model_type {kind!r} is not a causal LM (transformers' AutoModelForCausalLM "
                             "builds none for it: an encoder-decoder, encoder-only or vision model); the planner plans "
                             "causal LMs (gpt2, llama, ...) and vision-language models built on one")
    config_class = CONFIG_MAPPING[kind]
    flags = {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads}
    if isinstance(raw.get("text_config"), dict):  # the sizes are the language model's
        text_class = _text_config_class(where, raw["text_config"], config_class, CONFIG_MAPPING)
        raw = {**raw, "text_config": _with_overrides(f"{where} (its text_config)", raw["text_config"], text_class,
                                                     flags, kind=kind)}
    else:
        raw = _with_overrides(where, raw, config_class, flags)
    try:
        config = config_class.from_dict(raw)
    except Exception as exc:  # noqa: BLE001  transformers' own validation errors vary by model and version
        raise PlanInputError(f"{where}: transformers cannot read it: {_one_line(exc)}") from exc
    text = getattr(config, "text_config", None) if isinstance(raw.get("text_config"), dict) else config
    sizes = {key: getattr(text, key, None) for key in ("num_hidden_layers", "hidden_size", "vocab_size")}
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanInputError(f"{where}: {key} = {value!r}: the planner needs the width, the layer count and the "
                                 "vocabulary size, each a positive integer")
    stated = raw["text_config"] if text is not config else raw
    seq_len = _seq_len(seq_len, where, text, _spelling(stated, type(text), "max_position_embeddings"))
    try:
        with torch.device("meta"):
            model = auto.from_config(config)
    except Exception as exc:  # noqa: BLE001  a size transformers accepted but a layer refuses (a negative width)
        raise PlanInputError(f"{where}: transformers cannot build a causal LM from it: {_one_line(exc)}") from exc
    return _shape(model, sizes["num_hidden_layers"], sizes["hidden_size"], sizes["vocab_size"], seq_len)


def _text_config_class(where: str, text_raw: dict, config_class: type, mapping) -> type:
    """The config class of a vision-language model's text_config: its own model_type's, else the one the model's
    config builds by default."""
    kind = text_raw.get("model_type")
    if isinstance(kind, str) and kind in mapping:
        return mapping[kind]
    try:
        return type(config_class().text_config)
    except Exception as exc:  # noqa: BLE001  a class that needs arguments to say its text model
        raise PlanInputError(f"{where}: its text_config names no model_type this transformers knows ({kind!r})") \
            from exc


def _spelling(raw: dict, config_class: type, key: str) -> str | None:
    """The key `raw` states `key` under (its own name, or the model's spelling in the class's attribute_map)."""
    alias = getattr(config_class, "attribute_map", {}).get(key)
    return next((name for name in (key, alias) if name is not None and name in raw), None)


def _with_overrides(where: str, raw: dict, config_class: type, overrides: dict, *, kind: str | None = None) -> dict:
    """`raw` checked for the NEEDED sizes (those its class has), with the flags' values put under its own
    spellings: a head width that was hidden / heads stays so. `kind`: the model's type where `raw` is a part of
    its config (a text_config)."""
    kind = kind or raw["model_type"]
    try:
        defaults = config_class()
    except Exception:  # noqa: BLE001  a class that needs arguments: every size is asked for
        defaults = None
    raw = dict(raw)
    old = {}
    for key in NEEDED:
        name = _spelling(raw, config_class, key)
        alias = getattr(config_class, "attribute_map", {}).get(key)
        if name is None and (defaults is None or getattr(defaults, key, None) is not None):
            also = f" (or {alias!r})" if alias else ""
            other = [spelled for spelled in OTHER_SPELLINGS.get(key, ()) if spelled in raw and spelled != alias]
            other = f"; it states {other[0]!r}, which {kind} does not read" if other else ""
            default = f"; transformers would take its default, {getattr(defaults, key)}" if defaults else ""
            raise PlanInputError(f"{where} has no {key!r}{also}{other}{default}: the planner needs the layer "
                                 "count, the width, the head count and the vocabulary size as the file states them")
        if name is None:
            if overrides.get(key) is not None:
                raise PlanInputError(f"{FLAGS[key]} {overrides[key]}: model_type {kind!r} has no "
                                     f"{key!r} to override")
            continue
        old[key] = raw[name]
        if overrides.get(key) is not None:
            raw[name] = overrides[key]
        value = raw[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            if overrides.get(key) is not None:
                raise PlanInputError(f"{FLAGS[key]} {value!r} ({name} of {where}): expected a positive integer")
            raise PlanInputError(f"{where}: {name} = {value!r}: expected a positive integer")
    head_dim = _spelling(raw, config_class, "head_dim")
    if (head_dim and (overrides.get("hidden_size") or overrides.get("num_attention_heads")) and
            {"hidden_size", "num_attention_heads"} <= old.keys() and
            raw[head_dim] == old["hidden_size"] // old["num_attention_heads"]):
        hidden, heads = (raw[_spelling(raw, config_class, key)] for key in ("hidden_size", "num_attention_heads"))
        if hidden % heads == 0:
            raw[head_dim] = hidden // heads
    return raw


def _seq_len(seq_len: int | None, where: str, config, positions_key: str | None) -> int:
    """At least one token; no more than the positions the config states (GPT-2's n_positions, a llama's
    max_position_embeddings): a longer sequence has no position embedding to take. Not given: SEQ_LEN, or the
    positions where fewer."""
    positions = getattr(config, "max_position_embeddings", None) if positions_key else None
    positions = positions if isinstance(positions, int) and not isinstance(positions, bool) else None
    if seq_len is None:
        return min(SEQ_LEN, positions or SEQ_LEN)
    _check_positive_seq_len(seq_len)
    if positions is not None and seq_len > positions:
        raise PlanInputError(f"--seq-len {seq_len}: {where} states {positions_key} = {positions}, the most "
                             "tokens a sequence of this model takes")
    return seq_len


def _check_positive_seq_len(seq_len: int) -> None:
    if seq_len < 1:
        raise PlanInputError(f"--seq-len {seq_len}: tokens a sequence, at least 1")


def _one_line(exc: BaseException) -> str:
    """An exception as one line: its type and every line of its message (transformers' validation puts the
    useful part on the second), shortened past 400 characters."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text if len(text) <= 400 else text[:400] + '...'}"


def from_factory(spec: str, seq_len: int = SEQ_LEN) -> ModelShape:
    """`package.module:function`, called with no arguments under the meta device."""
    module_name, _, attr = spec.partition(":")
    _check_positive_seq_len(seq_len)
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:  # ValueError: an empty module name (":f")
        raise PlanInputError(f"model factory {spec!r}: {_one_line(exc)}") from exc
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as exc:  # noqa: BLE001  the user's code: a factory that needs arguments, a class, a bug
        raise PlanInputError(f"model factory {spec!r}: called with no arguments, it raised {_one_line(exc)}") \
            from exc
    if not isinstance(model, nn.Module):
        raise PlanInputError(f"model factory {spec!r} returned {type(model).__name__}, not an nn.Module")
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None) or max(
        (m.in_features for m in model.modules() if isinstance(m, nn.Linear)), default=0)
    layers = getattr(config, "num_hidden_layers", None) or 0
    vocab = getattr(config, "vocab_size", None) or max(
        (m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=0)
    return _shape(model, layers, hidden, vocab, seq_len)


def load_model(spec: str, *, layers: int | None = None, hidden: int | None = None, heads: int | None = None,
               seq_len: int | None = None) -> ModelShape:
    """A preset name, a config.json (or a directory holding one), or `package.module:function`. --layers, --hidden
    and --heads override a preset's or a config.json's sizes; a factory builds its own model, so they are refused.
    `seq_len` None: SEQ_LEN (fewer where a config.json states fewer positions)."""
    sizes = {"layers": layers, "hidden": hidden, "heads": heads}
    if os.path.isfile(spec) or os.path.isfile(os.path.join(spec, "config.json")):
        return from_hf_config(spec, seq_len, **sizes)
    if ":" in spec:
        given = [f"--{flag} {value}" for flag, value in sizes.items() if value is not None]
        if given:
            raise PlanInputError(f"{given[0]}: model factory {spec!r} builds its own model; --layers, --hidden and "
                                 "--heads override a preset or a config.json")
        return from_factory(spec, SEQ_LEN if seq_len is None else seq_len)
    if spec.endswith(".json") or os.sep in spec:
        raise PlanInputError(f"model {spec!r}: no such file")
    return from_preset(spec, seq_len=SEQ_LEN if seq_len is None else seq_len, **sizes)


def _shape(model: nn.Module, layers: int, hidden: int, vocab: int, seq_len: int) -> ModelShape:
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    kinds = _matmul_modules()
    linear = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, kinds)}
    return ModelShape(model, params, sum(linear.values()) + _active_expert_params(model) or params, layers, hidden,
                      vocab, seq_len)


def _active_expert_params(model: nn.Module) -> int:
    """A mixture of experts' weights stacked one matrix an expert (transformers' MoE layers: 3-D parameters of
    shape (experts, ., .)), counted at the share a token runs through: num_experts_per_tok of the experts."""
    per_token = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    total = 0
    for p in model.parameters():
        if p.dim() == 3:
            experts = p.shape[0]
            total += p.numel() * min(per_token or experts, experts) // experts
    return total


def _matmul_modules() -> tuple[type, ...]:
    """nn.Linear (and its subclasses), and transformers' Conv1D (GPT-2's blocks: a linear layer whose weight is
    stored (in, out)) where transformers is loaded: a model made of it imported it."""
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    return (nn.Linear,) if conv1d is None else (nn.Linear, conv1d)
