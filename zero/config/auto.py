"""Filling the "auto" values the Hugging Face Trainer writes into ds_config.json, by the Trainer integration's
rules (transformers.integrations.deepspeed: trainer_config_process / trainer_config_finalize).

Resolution takes its facts explicitly: the world size and the model's hidden size from the engine, and the
training arguments as `TrainingArgs`. A value the facts cannot give is an UnresolvedAutoError that names the
key and what to pass or write. As in the Trainer, a key written out that contradicts a given training
argument is an error too: the run would otherwise silently use one of the two.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from .batch import ACCUM, MICRO, TRAIN
from .errors import ConfigError, UnresolvedAutoError
from .schema import AUTO


@dataclass(frozen=True, kw_only=True)
class TrainingArgs:
    """The training arguments that fill "auto", named as in Hugging Face `TrainingArguments` so they can be
    copied across. None: not given (an "auto" that needs it stays unresolved)."""

    per_device_train_batch_size: int | None = None
    """Fills train_micro_batch_size_per_gpu."""

    gradient_accumulation_steps: int | None = None
    """Fills gradient_accumulation_steps."""

    max_grad_norm: float | None = None
    """Fills gradient_clipping."""

    learning_rate: float | None = None
    """Fills optimizer.params.lr and scheduler.params.warmup_max_lr."""

    adam_beta1: float | None = None
    """With adam_beta2, fills optimizer.params.betas."""

    adam_beta2: float | None = None
    """With adam_beta1, fills optimizer.params.betas."""

    adam_epsilon: float | None = None
    """Fills optimizer.params.eps."""

    weight_decay: float | None = None
    """Fills optimizer.params.weight_decay."""

    warmup_steps: int | None = None
    """Fills scheduler.params.warmup_num_steps (the Trainer's `args.get_warmup_steps(num_training_steps)`)."""

    num_training_steps: int | None = None
    """Fills scheduler.params.total_num_steps: optimizer steps of the whole run."""

    fp16: bool | None = None
    """Fills fp16.enabled."""

    bf16: bool | None = None
    """Fills bf16.enabled."""

    zero3_save_16bit_model: bool | None = None
    """Fills zero_optimization.stage3_gather_16bit_weights_on_model_save (Accelerate's name for it)."""


class Facts(NamedTuple):
    """Everything a rule may read."""

    world_size: int
    hidden_size: int | None
    args: TrainingArgs


@dataclass(frozen=True)
class Rule:
    """How one key's "auto" is filled: `fill` gives the value or None when the facts lack it."""

    path: tuple[str, ...]
    fill: Callable[[Facts], Any]
    needs: str
    """What to pass to load_config, for the message."""

    must_match: bool = True
    """A value written out must agree with the fact (the Trainer's fill_match; False: its fill_only)."""


def _arg(path: tuple[str, ...], name: str) -> Rule:
    return Rule(path, lambda f: getattr(f.args, name), f"args=TrainingArgs({name}=...)")


def _hidden(path: tuple[str, ...], rule: Callable[[int], int], formula: str) -> Rule:
    return Rule(path, lambda f: None if f.hidden_size is None else rule(f.hidden_size),
                f"the model's hidden size, hidden_size=... (the rule is {formula})", must_match=False)


def _train_batch(f: Facts) -> int | None:
    micro, accum = f.args.per_device_train_batch_size, f.args.gradient_accumulation_steps
    return None if micro is None or accum is None else f.world_size * micro * accum


def _betas(f: Facts) -> list[float] | None:
    b1, b2 = f.args.adam_beta1, f.args.adam_beta2
    return None if b1 is None or b2 is None else [b1, b2]


ZERO = "zero_optimization"
BATCH_RULES = (
    _arg((MICRO,), "per_device_train_batch_size"),
    _arg((ACCUM,), "gradient_accumulation_steps"),
    Rule((TRAIN,), _train_batch, "world_size * per_device_train_batch_size * gradient_accumulation_steps "
                                 "(args=TrainingArgs(per_device_train_batch_size=..., "
                                 "gradient_accumulation_steps=...))"),
)
"""Batch keys whose "auto" the facts cannot fill are left to DeepSpeed's derivation (batch.py)."""

RULES = (
    _arg(("gradient_clipping",), "max_grad_norm"),
    _arg(("fp16", "enabled"), "fp16"),
    _arg(("bf16", "enabled"), "bf16"),
    _arg(("bfloat16", "enabled"), "bf16"),
    _arg(("optimizer", "params", "lr"), "learning_rate"),
    Rule(("optimizer", "params", "betas"), _betas, "args=TrainingArgs(adam_beta1=..., adam_beta2=...)"),
    _arg(("optimizer", "params", "eps"), "adam_epsilon"),
    _arg(("optimizer", "params", "weight_decay"), "weight_decay"),
    Rule(("scheduler", "params", "warmup_min_lr"), lambda f: 0, "", must_match=False),
    _arg(("scheduler", "params", "warmup_max_lr"), "learning_rate"),
    _arg(("scheduler", "params", "warmup_num_steps"), "warmup_steps"),
    _arg(("scheduler", "params", "total_num_steps"), "num_training_steps"),
    _hidden((ZERO, "reduce_bucket_size"), lambda h: h * h, "hidden_size * hidden_size"),
    *(_hidden((ZERO, key), lambda h: int(0.9 * h * h), "int(0.9 * hidden_size * hidden_size)")
      for key in ("stage3_prefetch_bucket_size", "prefetch_bucket_size")),
    *(_hidden((ZERO, key), lambda h: 10 * h, "10 * hidden_size")
      for key in ("stage3_param_persistence_threshold", "param_persistence_threshold")),
    *(Rule((ZERO, key), lambda f: f.args.zero3_save_16bit_model, "args=TrainingArgs(zero3_save_16bit_model=...)",
           must_match=False)  # a written false is the config's (DeepSpeed scripts write it): transformers keeps it
      for key in ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save")),
)


def resolve_auto(raw: dict[str, Any], *, world_size: int, hidden_size: int | None, args: TrainingArgs) -> None:
    """Fill the "auto" values of the parsed JSON `raw` in place. Batch keys the facts cannot fill are removed
    (DeepSpeed derives them); other unfillable ones raise. Keys no rule knows are left to the sections,
    which reject a leftover "auto" by name."""
    facts = Facts(world_size, hidden_size, args)
    batch_autos = [rule.path[0] for rule in BATCH_RULES if raw.get(rule.path[0]) == AUTO]
    for rule in BATCH_RULES:
        if not _fill(rule, raw, facts):
            del raw[rule.path[0]]
    if TRAIN not in raw and MICRO not in raw:
        for rule in BATCH_RULES:
            if rule.path[0] in batch_autos and rule.path[0] != ACCUM:
                raise UnresolvedAutoError(rule.path[0], f'"auto" needs {rule.needs}, or write a number',
                                          value=AUTO)
    for rule in RULES:
        if not _fill(rule, raw, facts):
            raise UnresolvedAutoError(".".join(rule.path), f'"auto" needs {rule.needs}, or write a value',
                                      value=AUTO)


def _fill(rule: Rule, raw: dict[str, Any], facts: Facts) -> bool:
    """Fill the rule's key if it is "auto", or check it against the fact if written out. False: it is
    "auto" and the facts cannot fill it."""
    node: object = raw
    for part in rule.path[:-1]:
        node = node.get(part) if isinstance(node, Mapping) else None
    key = rule.path[-1]
    if not isinstance(node, dict) or key not in node:
        return True
    fact = rule.fill(facts)
    if isinstance(node[key], str) and node[key] == AUTO:
        if fact is None:
            return False
        node[key] = fact
    elif rule.must_match and fact is not None and not _same(node[key], fact):
        raise ConfigError(".".join(rule.path), f"disagrees with the training arguments, which give {fact!r} "
                                               f'({rule.needs}); make them agree or write "auto"', value=node[key])
    return True


def _same(written: object, fact: object) -> bool:
    """Equal as JSON means it (5e8 == 500000000, [0.9, 0.999] == (0.9, 0.999)); true is not 1."""
    if isinstance(written, (list, tuple)) and isinstance(fact, (list, tuple)):
        return len(written) == len(fact) and all(map(_same, written, fact))
    if isinstance(written, bool) or isinstance(fact, bool):
        return written is fact
    return written == fact
