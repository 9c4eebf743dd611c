"""What every config section shares: declaring a JSON key (`setting`), checking and coercing values from the
field annotations, and building a section from DeepSpeed-format JSON.

A section is a keyword-only frozen dataclass deriving from `Section`; its fields are its JSON keys, typed
with `bool`, `int`, `float`, `str`, `Literal[...]`, `tuple[...]`, another section, or `X | None`.
`__post_init__` checks every field against its annotation, so a section built in Python is held to the
same rules as one read from JSON. Building from JSON adds the rules that only make sense for a file:
aliases, unknown keys (named with the closest known key), DeepSpeed keys we do not support, keys accepted
and ignored, and leftover "auto" values; every error names the full key path.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass
from typing import Any, Literal, get_args, get_origin, get_type_hints

from .errors import ConfigError, UnknownKeyError, UnresolvedAutoError, UnsupportedKeyError

AUTO = "auto"


def setting(
    default: Any = MISSING,
    *,
    factory: Any = MISSING,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    aliases: tuple[str, ...] = (),
    convert: Callable[[Any], Any] | None = None,
    casefold: bool = False,
    in_json: bool = True,
) -> Any:
    """A dataclass field for one JSON key. No default and no factory: the key is required.

    ge/gt/le/lt bound numbers; `aliases` are other JSON spellings of the key (DeepSpeed's `stage3_` names);
    `convert` maps a JSON value before the type check (raising ValueError with the reason); `casefold`
    matches a Literal's choices ignoring case; `in_json=False` keeps a field out of the file's keys."""
    metadata = {"ge": ge, "gt": gt, "le": le, "lt": lt, "aliases": aliases, "convert": convert, "casefold": casefold,
                "in_json": in_json}
    return dataclasses.field(default=default, default_factory=factory, metadata=metadata)


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# ---------------------------------------------------------------------------------------------------------
# DeepSpeed keys we know but do not implement, and keys we accept and ignore


NEVER = object()
"""`Unsupported(off=NEVER)`: the key has no value that asks for nothing; its presence is the error."""

DISABLED = object()
"""`Unsupported(off=DISABLED)`: a section that is off while its "enabled" is false or absent."""


@dataclass(frozen=True)
class Unsupported:
    """A DeepSpeed key zero-tiering knows and does not implement. Users' files often spell out defaults, so
    the key is accepted while it asks for nothing (`off`); any other value is an UnsupportedKeyError."""

    what: str
    """The DeepSpeed feature, named in the message."""

    off: object = NEVER
    """NEVER, DISABLED, a JSON value meaning "feature off", or a predicate over the JSON value."""

    fix: str = ""
    """What to do instead; by default derived from `off`."""

    def is_off(self, value: object) -> bool:
        if self.off is NEVER:
            return False
        if self.off is DISABLED:
            return value is None or (isinstance(value, Mapping) and value.get("enabled", False) is False)
        if callable(self.off):
            return bool(self.off(value))
        return value is None or (value == self.off and isinstance(value, bool) == isinstance(self.off, bool))

    def problem(self) -> str:
        if self.fix:
            fix = self.fix
        elif self.off is DISABLED:
            fix = 'remove it or set "enabled": false'
        elif self.off is NEVER or callable(self.off):
            fix = "remove it"
        else:
            fix = f"remove it or set it to {json.dumps(self.off)}"
        return f"a DeepSpeed key zero-tiering does not support ({self.what}); {fix}"


class Section:
    """Base of every config section (see the module docstring)."""

    UNSUPPORTED: Mapping[str, Unsupported] = {}
    """DeepSpeed keys of this section that zero-tiering rejects unless they are off."""

    IGNORED: Mapping[str, str] = {}
    """DeepSpeed keys of this section accepted and ignored, each with why ignoring cannot change results.
    The loader lists the ones a file carried in `Config.ignored`."""

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def from_json(cls, data: object, path: str, ignored: list[str]) -> Any:
        """Build from the JSON object at `path`; keys accepted and ignored are appended to `ignored`."""
        return build(cls, data, path, ignored)


# ---------------------------------------------------------------------------------------------------------
# Checking values against annotations


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def check_fields(obj: Any) -> None:
    """Check and coerce every field of a section in place (an integral float becomes an int, an int a float
    where a float is declared). Raises ConfigError keyed by the field's name."""
    hints = type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        checked = check_value(f.name, value, hints[f.name], f.metadata)
        if checked is not value:
            object.__setattr__(obj, f.name, checked)


def check_value(key: str, value: Any, hint: Any, meta: Mapping[str, Any] = types.MappingProxyType({})) -> Any:
    """`value` checked against `hint` and the bounds in `meta`, coerced; ConfigError naming `key` if wrong."""
    convert = meta.get("convert")
    if convert is not None and value is not None:
        try:
            value = convert(value)
        except ValueError as err:
            raise ConfigError(key, str(err), value=value) from None
    ok, result, expected = _coerce(value, hint, meta)
    if not ok:
        raise ConfigError(key, f"expected {expected}", value=value)
    return result


def _coerce(value: Any, hint: Any, meta: Mapping[str, Any]) -> tuple[bool, Any, str]:
    """(ok, coerced value, what was expected)."""
    origin = get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = get_args(hint)
        if value is None and type(None) in options:
            return True, None, ""
        expected = []
        for option in options:
            if option is not type(None):
                ok, result, what = _coerce(value, option, meta)
                if ok:
                    return True, result, ""
                expected.append(what)
        if type(None) in options:
            expected.append("null")
        return False, value, " or ".join(expected)
    if origin is Literal:
        return _coerce_choice(value, get_args(hint), meta.get("casefold", False))
    if hint is bool:
        return isinstance(value, bool), value, "true or false"
    if hint is int or hint is float:
        return _coerce_number(value, hint, meta)
    if hint is str:
        return isinstance(value, str), value, "a string"
    if origin is tuple:
        return _coerce_tuple(value, get_args(hint), meta)
    if isinstance(hint, type) and issubclass(hint, Section):
        return isinstance(value, hint), value, "an object ({...})"
    raise TypeError(f"no rule for annotation {hint!r}")


def _coerce_choice(value: Any, choices: tuple, casefold: bool) -> tuple[bool, Any, str]:
    expected = "one of " + ", ".join(json.dumps(c) if not isinstance(c, str) else repr(c) for c in choices)
    for choice in choices:
        if isinstance(choice, str) and isinstance(value, str):
            if choice == value or (casefold and choice.lower() == value.lower()):
                return True, choice, expected
        elif (isinstance(choice, int) and isinstance(value, (int, float)) and not isinstance(value, bool)
              and value == choice):
            return True, choice, expected
    return False, value, expected


def _coerce_number(value: Any, hint: type, meta: Mapping[str, Any]) -> tuple[bool, Any, str]:
    ge, gt, le, lt = (meta.get(bound) for bound in ("ge", "gt", "le", "lt"))
    expected = ("an integer" if hint is int else "a number") + _bounds(ge, gt, le, lt)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False, value, expected
    if hint is int:
        if isinstance(value, float):
            if not value.is_integer():
                return False, value, expected
            value = int(value)
    else:
        value = float(value)
        if value != value:
            return False, value, expected
    in_range = ((ge is None or value >= ge) and (gt is None or value > gt)
                and (le is None or value <= le) and (lt is None or value < lt))
    return in_range, value, expected


def _bounds(ge: float | None, gt: float | None, le: float | None, lt: float | None) -> str:
    """The bounds as a reader wants them: ' in [0, 1)', ' >= 0', or '' for none."""
    low = (f"[{ge}", ">=", ge) if ge is not None else (f"({gt}", ">", gt) if gt is not None else None
    high = (f"{le}]", "<=", le) if le is not None else (f"{lt})", "<", lt) if lt is not None else None
    if low and high:
        return f" in {low[0]}, {high[0]}"
    one = low or high
    return f" {one[1]} {one[2]}" if one else ""


def _coerce_tuple(value: Any, items: tuple, meta: Mapping[str, Any]) -> tuple[bool, Any, str]:
    """tuple[X, Y] (fixed length) or tuple[X, ...] (any length), from a JSON list."""
    variadic = len(items) == 2 and items[1] is Ellipsis
    each = _coerce(None, items[0], meta)[2]
    expected = f"a list of {'values' if variadic else f'{len(items)} values'}, each {each}"
    if not isinstance(value, (list, tuple)) or (not variadic and len(value) != len(items)):
        return False, value, expected
    coerced = []
    for index, item in enumerate(value):
        ok, result, _ = _coerce(item, items[0 if variadic else index], meta)
        if not ok:
            return False, value, expected
        coerced.append(result)
    return True, tuple(coerced), expected


# ---------------------------------------------------------------------------------------------------------
# Building a section from JSON


def build(cls: type, data: object, path: str, ignored: list[str]) -> Any:
    """Instance of section `cls` from the JSON object `data` at key path `path` (JSON null: all defaults)."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(path, "expected an object ({...})", value=data)
    hints = type_hints(cls)
    by_key: dict[str, dataclasses.Field] = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("in_json", True):
            for spelling in (f.name, *f.metadata.get("aliases", ())):
                by_key[spelling] = f
    kwargs: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in data.items():
        full = join(path, key)
        f = by_key.get(key)
        if f is None:
            _not_a_field(cls, key, value, full, by_key, ignored)
            continue
        if f.name in raw:
            if raw[f.name] != value:
                first = join(path, spelled[f.name])
                raise ConfigError(full, f"names the same setting as {first} = {raw[f.name]!r}; keep one of the "
                                        f"two", value=value)
            continue
        hint = hints[f.name]
        if isinstance(value, str) and value == AUTO and not _allows(hint, AUTO):
            raise UnresolvedAutoError(full, _auto_problem(f), value=value)
        raw[f.name], spelled[f.name] = value, key
        section = _section_type(hint)
        if section is not None and not (value is None and _allows(hint, None)):
            value = section.from_json(value, full, ignored)
        kwargs[f.name] = value
    for f in dataclasses.fields(cls):
        required = f.default is MISSING and f.default_factory is MISSING
        if required and f.metadata.get("in_json", True) and f.name not in kwargs:
            raise ConfigError(join(path, f.name), "required key is missing")
    try:
        return cls(**kwargs)
    except ConfigError as err:
        head, dot, rest = err.key.partition(".")
        raise err.renamed(join(path, spelled.get(head, head) + dot + rest)) from err.__cause__


def spelling(data: Mapping[str, Any], cls: type, name: str) -> str:
    """The JSON spelling of field `name` in `data`: an alias the user wrote, else `name` itself."""
    aliases = next((f.metadata.get("aliases", ()) for f in dataclasses.fields(cls) if f.name == name), ())
    return next((key for key in (name, *aliases) if key in data), name)


def _not_a_field(cls: type, key: str, value: object, full: str, by_key: Mapping[str, Any],
                 ignored: list[str]) -> None:
    rule = cls.UNSUPPORTED.get(key)
    if rule is not None:
        if not rule.is_off(value):
            raise UnsupportedKeyError(full, rule.problem(), value=value)
        return
    if key in cls.IGNORED:
        ignored.append(full)
        return
    known = sorted({*by_key, *cls.UNSUPPORTED, *cls.IGNORED})
    closest = difflib.get_close_matches(key, known, n=1, cutoff=0.0)
    hint = f"; the closest known key is {closest[0]!r}" if closest else "; this section takes no keys"
    raise UnknownKeyError(full, f"unknown key{hint}")


def _allows(hint: Any, value: object) -> bool:
    """Whether `hint` admits `value` as is: "auto" as a Literal choice, None in an optional."""
    if get_origin(hint) in (typing.Union, types.UnionType):
        return any(_allows(option, value) for option in get_args(hint))
    if value is None:
        return hint is type(None)
    return get_origin(hint) is Literal and value in get_args(hint)


def _section_type(hint: Any) -> type | None:
    """The one section class `hint` names (directly or as `X | None`), else None."""
    options = get_args(hint) if get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    sections = [o for o in options if isinstance(o, type) and issubclass(o, Section)]
    return sections[0] if len(sections) == 1 else None


def _auto_problem(f: dataclasses.Field) -> str:
    problem = 'zero-tiering cannot resolve "auto" for this key; set a value'
    if f.default is not MISSING:
        default = list(f.default) if isinstance(f.default, tuple) else f.default
        problem += f" (the default is {json.dumps(default)})"
    return problem
