"""Typed config errors. Each names the JSON key path at fault (`zero_optimization.offload_param.device`), so
a user can fix the file without reading our code; `key` and `value` are attributes too."""
from __future__ import annotations

NO_VALUE = object()
"""Marks an error about a key as a whole (an alias clash, a missing key) rather than about one value."""


class ConfigError(ValueError):
    """A config key is wrong: bad type, out of range, inconsistent with another key, or unresolvable."""

    def __init__(self, key: str, problem: str, *, value: object = NO_VALUE):
        self.key, self.problem, self.value = key, problem, value
        shown = "" if value is NO_VALUE else f" = {value!r}"
        super().__init__(f"{key}{shown}: {problem}")

    def renamed(self, key: str) -> ConfigError:
        """The same error under another key: the full path, spelled as the user wrote it (an alias)."""
        return type(self)(key, self.problem, value=self.value)


class UnknownKeyError(ConfigError):
    """A key that neither DeepSpeed's format (as far as we know it) nor our section has."""


class UnsupportedKeyError(ConfigError):
    """A DeepSpeed key (or value) that zero-tiering knows but does not implement: an error, never silence."""


class UnresolvedAutoError(ConfigError):
    """An `"auto"` value that the facts given to `load_config` cannot fill."""
