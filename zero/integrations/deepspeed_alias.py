"""`deepspeed` as another name for `zero`, for scripts and libraries written for DeepSpeed that are run unchanged:
`python -m zero.launch script.py` installs it in each rank, and `HfZeroConfig` for transformers' ZeRO-3 loading.

Once installed (first on sys.meta_path), `import deepspeed`, `from deepspeed.comm import get_rank` and
`import deepspeed.runtime.zero.partition_parameters` give `zero`'s objects: each `deepspeed.X` module is a view of
`zero.X` (its names, and what it gains later, read through), so every class and function is the one `zero` has.
A name `zero` lacks is the ImportError `zero` gives. Where it stops: code that asks for the deepspeed *package's*
metadata (`importlib.metadata.version("deepspeed")`, transformers' `is_deepspeed_available()`, accelerate's
DeepSpeed plugin) finds none (the launcher then adds PACKAGE_ASKED, saying what to use: `asks_for_the_package`), and a
`deepspeed` imported before the alias is installed stays what it was.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types

PREFIX = "deepspeed"

SERVED_VERSION = "0.19.8"
"""The DeepSpeed release whose API, config keys and results `zero` matches (tests/deepspeed_examples record against
it): what `deepspeed.__version__` says under the alias, where scripts check it (`>= 0.10.3` in ZeRO-Inference's
run_model.py). `zero.__version__` stays zero-tiering's own."""

PACKAGE_ASKED = (
    "`deepspeed` in this process is zero-tiering's alias (python -m zero.launch installs it): its modules, not the "
    "deepspeed package whose installation this code checks for. Accelerate's DeepSpeed plugin: keep the Accelerator "
    "for the processes and the data and hand the model and optimizer to zero.initialize instead of "
    "accelerator.prepare (README.md, \"From Accelerate\"); the Trainer's deepspeed= argument: "
    "zero.integrations.ZeroTrainer (README.md, \"Hugging Face Trainer\")"
)
"""What the launcher says after an error that `asks_for_the_package`."""


class PackageAskedError(ImportError):
    """Code run under the alias asked for the deepspeed package itself, which no alias provides."""


def asks_for_the_package(err: ImportError) -> bool:
    """Whether `err` says that the deepspeed package is missing (a dependency check: its metadata not found, or a
    library's own message), not that a module or name the alias maps is (such errors carry the module's name)."""
    mentions = PREFIX in str(err).lower()
    if isinstance(err, importlib.metadata.PackageNotFoundError):
        return mentions
    return mentions and err.name is None


class DeepSpeedAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname != PREFIX and not fullname.startswith(PREFIX + "."):
            return None
        ours = ours_for(fullname)
        try:
            spec = importlib.util.find_spec(ours)
        except ModuleNotFoundError:
            return None
        if spec is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=spec.submodule_search_locations is not None)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _View(spec.name, importlib.import_module(ours_for(spec.name)))

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__spec__.submodule_search_locations is not None:
            module.__path__ = []  # a package: its submodules are found by this finder too


class _View(types.ModuleType):
    """`deepspeed.X`: reads every name from `zero.X`."""

    def __init__(self, name: str, target: types.ModuleType):
        super().__init__(name, target.__doc__)
        self._zero_module = target
        if hasattr(target, "__all__"):
            self.__all__ = target.__all__
        if name == PREFIX:
            self.__version__ = SERVED_VERSION
            self.__version_major__, self.__version_minor__, self.__version_patch__ = map(int, SERVED_VERSION.split("."))

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_zero_module"], name)

    def __dir__(self) -> list[str]:
        return dir(self.__dict__["_zero_module"])


def ours_for(name: str) -> str:
    return "zero" + name[len(PREFIX):]


def install() -> None:
    """Make `deepspeed` name `zero` in this process (idempotent). A `deepspeed` already imported (the real package)
    is an error: its objects are in use, and two engines cannot share a script."""
    if any(isinstance(finder, DeepSpeedAlias) for finder in sys.meta_path):
        return
    loaded = sys.modules.get(PREFIX)
    if loaded is not None:
        raise ImportError(f"the deepspeed package is already imported ({getattr(loaded, '__file__', loaded)}): "
                          "zero cannot stand in for it in this process; run the script under `python -m zero.launch` "
                          "without importing deepspeed first")
    sys.meta_path.insert(0, DeepSpeedAlias())
