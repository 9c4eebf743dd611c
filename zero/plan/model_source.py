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
    of a mixture of experts' experts, the share a token runs through (top_k of them); of a vision-language model,
    its language model's only."""
    layers: int
    hidden: int
    vocab: int
    seq_len: int
    loss_rows: int | None = None
    """Tokens whose logits the loss makes at once (the main job's chunked head); None: all of a micro-batch's."""
    note: str | None = None
    """What the plan leaves out, said beside the model (a vision-language model's image encoder: its compute)."""


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
PLANNED = "causal LMs (gpt2, llama, ...), encoders as masked LMs (bert, ...) and vision-language models"
"""What a config.json may state, named where one is refused."""


def from_hf_config(path: str, seq_len: int | None = None, *, layers: int | None = None, hidden: int | None = None,
                   heads: int | None = None) -> ModelShape:
    """A transformers model from its config.json (or the directory holding one), built from the config (no weights
    read) as the class a user trains from it: a causal LM; an encoder's masked LM (BERT, RoBERTa, DistilBERT: not
    the decoder variant transformers also lists as a causal LM); or a vision-language model, sized by its language
    model (its text_config, or the top of a flat config: Qwen2-VL's), its image encoder stored and stepped but its
    compute (per image) not priced. Sizes are read through the config class's attribute_map, so each model's own
    spellings count (GPT-2's n_embd, n_layer, n_head); --layers, --hidden and --heads replace them under the same
    spelling."""
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
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForMaskedLM
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                            MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
                                                            MODEL_FOR_MASKED_LM_MAPPING_NAMES)
    except ImportError as exc:
        raise PlanInputError(f"{where}: planning a Hugging Face model needs transformers "
                             f"(pip install transformers): {exc}") from exc
    kind = raw["model_type"]
    if kind not in CONFIG_MAPPING:
        raise PlanInputError(f"{where}: model_type {kind!r} is not one this transformers knows")
    # A vision-language model whole, unless transformers also lists a causal LM for it that is its language model
    # alone (mllama's, llama4's) and the file states no image encoder.
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(kind)
    vision = kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and (
        causal in (None, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[kind]) or "vision_config" in raw)
    if not vision and causal is None and kind not in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        raise PlanInputError(f"{where}: model_type {kind!r} is not a causal LM (transformers builds no causal LM, "
                             "masked LM or vision-language model for it: an encoder-decoder or a vision model); the "
                             f"planner plans {PLANNED}")
    config_class = CONFIG_MAPPING[kind]
    flags = {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads}
    if isinstance(raw.get("text_config"), dict):  # the sizes are the language model's
        text_class = _text_config_class(where, raw, config_class, CONFIG_MAPPING)
        raw = {**raw, "text_config": _with_overrides(f"{where} (its text_config)", raw["text_config"], text_class,
                                                     flags, kind=kind, stated=False)}
    else:  # the sizes at the top: a language model's, or a flat vision-language config's (Qwen2-VL's)
        text_class = _text_config_class(where, raw, config_class, CONFIG_MAPPING) if vision else config_class
        raw = _with_overrides(where, raw, text_class, flags, kind=kind)
    try:
        config = config_class.from_dict(raw)
    except Exception as exc:  # noqa: BLE001  transformers' own validation errors vary by model and version
        raise PlanInputError(f"{where}: transformers cannot read it: {_one_line(exc)}") from exc
    if vision:
        auto, what = AutoModelForImageTextToText, "a vision-language model"
    elif getattr(config, "is_encoder_decoder", False):
        raise PlanInputError(f"{where}: model_type {kind!r} is an encoder-decoder (transformers' causal LM for it is "
                             f"its decoder alone); the planner plans {PLANNED}")
    elif kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        auto, what = AutoModelForMaskedLM, "a masked LM"  # an encoder: BERT's causal LM is a decoder made of it
    else:
        auto, what = AutoModelForCausalLM, "a causal LM"
    text = config.get_text_config()
    sizes = {key: getattr(text, key, None) for key in ("num_hidden_layers", "hidden_size", "vocab_size")}
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanInputError(f"{where}: {key} = {value!r}: the planner needs the width, the layer count and the "
                                 "vocabulary size, each a positive integer")
    stated = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    seq_len = _seq_len(seq_len, where, text, _spelling(stated, type(text), "max_position_embeddings"))
    try:
        with torch.device("meta"):
            model = auto.from_config(config)
    except Exception as exc:  # noqa: BLE001  a size transformers accepted but a layer refuses (a negative width)
        raise PlanInputError(f"{where}: transformers cannot build {what} from it: {_one_line(exc)}") from exc
    language = [part for part in (model.get_decoder(), model.get_output_embeddings()) if part is not None] \
        if vision else None
    return _shape(model, sizes["num_hidden_layers"], sizes["hidden_size"], sizes["vocab_size"], seq_len,
                  language=language)


def _text_config_class(where: str, raw: dict, config_class: type, mapping) -> type:
    """The config class of a vision-language model's language model: its text_config's own model_type's, else the
    one the model's config builds by default (the config's own class where it has no text_config: git, fuyu)."""
    kind = raw.get("text_config", {}).get("model_type")
    if isinstance(kind, str) and kind in mapping:
        return mapping[kind]
    try:
        return type(config_class().get_text_config())
    except Exception as exc:  # noqa: BLE001  a class that needs arguments to say its text model
        raise PlanInputError(f"{where}: its text_config names no model_type this transformers knows ({kind!r})") \
            from exc


def _spelling(raw: dict, config_class: type, key: str) -> str | None:
    """The key `raw` states `key` under (its own name, or the model's spelling in the class's attribute_map)."""
    alias = getattr(config_class, "attribute_map", {}).get(key)
    return next((name for name in (key, alias) if name is not None and name in raw), None)


def _with_overrides(where: str, raw: dict, config_class: type, overrides: dict, *, kind: str,
                    stated: bool = True) -> dict:
    """`raw` checked for the NEEDED sizes (those its class has), with the flags' values put under its own
    spellings: a head width that was hidden / heads stays so. `kind`: the model's type, named in errors.
    `stated` False: `raw` is a sub-config (a text_config), which transformers saves as its difference from the
    class's defaults (llava-1.5-7b's states no width), so a size it leaves out is the default, filled in."""
    try:
        defaults = config_class()
    except Exception:  # noqa: BLE001  a class that needs arguments: every size is asked for
        defaults = None
    raw = dict(raw)
    if not stated and defaults is not None:
        for key in NEEDED:
            if _spelling(raw, config_class, key) is None and getattr(defaults, key, None) is not None:
                raw[key] = getattr(defaults, key)
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


def _shape(model: nn.Module, layers: int, hidden: int, vocab: int, seq_len: int, *,
           language: list[nn.Module] | None = None) -> ModelShape:
    """`language`: of a vision-language model, the parts a text token runs through (its language model and head),
    whose matmuls are priced; the rest (the image encoder, its projector) runs per image, a count no config states."""
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    text = {id(p) for part in language or [model] for p in part.parameters()}
    images = sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in text)
    note = (f"its image encoder ({images / 1e6:.1f}M parameters) is stored and stepped, its compute (per image) not "
            "priced") if images else None
    return ModelShape(model, params, _matmul_params(language or [model]) or params, layers, hidden, vocab, seq_len,
                      note=note)


def _matmul_params(parts: list[nn.Module]) -> int:
    """The weights a token is multiplied by, each once (a tied head is its embedding): every Linear and Conv1D
    weight, and of a mixture of experts' experts the share a token runs through."""
    kinds = _matmul_modules()
    weights = {id(m.weight): m.weight.numel() for part in parts for m in part.modules() if isinstance(m, kinds)}
    for part in parts:
        for weight, active, experts in _expert_weights(part):
            weights[id(weight)] = weight.numel() * active // experts
    return sum(weights.values())


TOP_K = ("top_k", "num_experts_per_tok", "moe_top_k")
"""The attributes a mixture of experts' block, or its router, states the experts a token runs through under."""
EXPERTS = ("num_experts", "moe_num_experts")
"""The attributes a module of stacked experts states their count under (else a 3-D weight's first size)."""


def _expert_weights(root: nn.Module):
    """A mixture of experts' expert weights, each with the experts a token runs through and the experts there are.
    Both layouts transformers has used: a block's `experts`, a ModuleList (or ModuleDict) of one module an expert
    (transformers 4, DeepSeek's own code); or a module of class *Experts holding them stacked, no Linear layer in
    it (transformers 5: 3-D weights (experts, out, in), DBRX's 2-D (experts x inner, hidden)). Shared experts (a
    child named shared_*) and those of a block that states no top_k run for every token."""
    kinds = _matmul_modules()
    for block in root.modules():
        for name, child in block.named_children():
            listed = name == "experts" and isinstance(child, (nn.ModuleList, nn.ModuleDict))
            stacked = type(child).__name__.endswith("Experts") and not any(isinstance(m, kinds)
                                                                            for m in child.modules())
            if not (listed or stacked):
                continue
            count = len(child) if listed else next((getattr(child, attr) for attr in EXPERTS if hasattr(child, attr)),
                                                   None)
            top_k = None if "shared" in name else _top_k(block)
            for weight_name, weight in child.named_parameters():
                if weight.dim() >= 2 and not weight_name.endswith("bias"):  # gpt-oss's biases are (experts, out)
                    experts = count or weight.shape[0]
                    yield weight, min(top_k or experts, experts), experts


def _top_k(block: nn.Module) -> int | None:
    """The experts a token runs through, as the block or one of its children (the router) states it."""
    for module in (block, *block.children()):
        for attr in TOP_K:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _matmul_modules() -> tuple[type, ...]:
    """nn.Linear (and its subclasses), and transformers' Conv1D (GPT-2's blocks: a linear layer whose weight is
    stored (in, out)) where transformers is loaded: a model made of it imported it."""
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    return (nn.Linear,) if conv1d is None else (nn.Linear, conv1d)
