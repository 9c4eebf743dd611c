"""`load_config`: a user's ds_config.json (a path or a dict) to a validated `Config`.

Order: read (duplicate keys are an error, as in DeepSpeed), fill "auto" from the facts given, derive the
batch sizes, build the typed sections (unknown, unsupported and ignored keys are found here), then let
tiering validate the `aio` settings it will run with."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from tiering.errors import TieringConfigError

from .aio import AioSection
from .auto import TrainingArgs, resolve_auto
from .batch import ACCUM, MICRO, TRAIN, resolve_batch_sizes
from .errors import ConfigError
from .schema import spelling
from .toplevel import Config


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any],
    *,
    world_size: int = 1,
    hidden_size: int | None = None,
    args: TrainingArgs | None = None,
) -> Config:
    """Parse and validate a DeepSpeed-format config.

    source: a path to a JSON file, or the parsed dict (not modified).
    world_size: ranks in the job; the batch sizes must agree with it.
    hidden_size: the model's hidden size, for the "auto" bucket sizes (the HF Trainer's rules).
    args: training arguments for the other "auto" values (learning rate, batch size, ...).

    Raises ConfigError (UnknownKeyError, UnsupportedKeyError, UnresolvedAutoError) naming the key."""
    for name, value, optional in (("world_size", world_size, False), ("hidden_size", hidden_size, True)):
        if not (optional and value is None) and (type(value) is not int or value < 1):
            raise ValueError(f"{name} = {value!r}: expected a positive integer")
    raw = _read(source)
    resolve_auto(raw, world_size=world_size, hidden_size=hidden_size, args=args or TrainingArgs())
    batch = resolve_batch_sizes(raw.get(TRAIN), raw.get(MICRO), raw.get(ACCUM), world_size=world_size)
    raw.update(zip((TRAIN, MICRO, ACCUM), batch))
    ignored: list[str] = []
    config = Config.from_json(raw, "", ignored)
    config = dataclasses.replace(config, ignored=tuple(ignored))
    try:
        config.to_aio_config()
    except TieringConfigError as err:
        raise _json_key_error(err, raw) from err
    return config


def _read(source: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    return read_json(source)


def read_json(source: str | os.PathLike[str]) -> dict[str, Any]:
    """A ds_config.json file as a dict, read as `load_config` reads it: JSON, or else hjson as DeepSpeed reads its
    config files (comments, trailing commas: a config that DeepSpeed loads loads here too; strict JSON is parsed
    by `json` first, so it reads exactly as before); a key twice in one object, text neither reads, or a top level
    that is not an object is a ConfigError (DeepSpeed refuses duplicate keys too; `json.load` would keep the last
    one silently). For tools that adjust a user's config before loading it."""
    path = os.fspath(source)
    with open(path, encoding="utf-8") as fh:
        try:
            text = fh.read()
        except UnicodeDecodeError as err:
            raise ConfigError(path, f"not UTF-8 text (byte {err.start}): not a JSON config") from None
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as err:
        try:  # hjson only for what strict JSON refuses (a machine without it still reads JSON configs)
            import hjson
        except ImportError:
            raise ConfigError(path, f"not valid JSON: {err} (hjson, which DeepSpeed also reads, is not "
                                    f"installed: pip install hjson)") from None
        try:
            data = hjson.loads(text, object_pairs_hook=_no_duplicates)
        except hjson.HjsonDecodeError as err:
            raise ConfigError(path, f"not valid JSON (nor hjson, which DeepSpeed also reads): {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(path, "expected a JSON object ({...}) at the top level")
    return data


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ConfigError(key, "appears twice in one object; keep one")
        data[key] = value
    return data


def _json_key_error(err: TieringConfigError, raw: Mapping[str, Any]) -> ConfigError:
    """tiering names its fields `aio.<name>`; say instead the key the user wrote (e.g. `aio.thread_count`)."""
    section = raw.get("aio")
    name = spelling(section if isinstance(section, Mapping) else {}, AioSection, err.field.removeprefix("aio."))
    problem = str(err).removeprefix(f"{err.field} = {err.value!r}: ")
    return ConfigError(f"aio.{name}", problem, value=err.value)
