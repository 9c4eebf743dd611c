"""Under `zero.launch`, transformers' `HfDeepSpeedConfig` is our `HfZeroConfig` (hf_config.py), so a ZeRO-3 script
written for DeepSpeed builds its model as DeepSpeed-Chat does, unchanged:

    dschf = HfDeepSpeedConfig(ds_config)   # from transformers.integrations.deepspeed (or transformers.integrations)
    model = AutoModelForCausalLM.from_pretrained(path)   # under zero.Init, weights loaded a module at a time

transformers' own class first checks that the deepspeed package is installed (`deepspeed>=0.9.3`'s metadata, which
the alias does not fake) and would end the script there. `install()` adds a finder that, as
transformers.integrations.deepspeed loads, sets its `HfDeepSpeedConfig` to HfZeroConfig (a module loaded already is
set at once). The Trainer's subclass of it (HfTrainerDeepSpeedConfig, for TrainingArguments(deepspeed=...)) was built
on transformers' class and still needs the package: ZeroTrainer takes the Trainer's place.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

from .hf_config import HfZeroConfig

TARGET = "transformers.integrations.deepspeed"
"""The module whose HfDeepSpeedConfig becomes ours."""


class HfConfigAlias(importlib.abc.MetaPathFinder):
    """Finds TARGET where the path finder does, with a loader that sets the name once the module has run."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _SetsOurs(spec.loader)
        return spec


class _SetsOurs(importlib.abc.Loader):
    """transformers' loader for TARGET (every other attribute, such as get_source, is that loader's)."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        module.HfDeepSpeedConfig = HfZeroConfig

    def __getattr__(self, name: str):
        return getattr(self.__dict__["loader"], name)


def install() -> None:
    """Make transformers' HfDeepSpeedConfig ours in this process (idempotent)."""
    if any(isinstance(finder, HfConfigAlias) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, HfConfigAlias())
    if TARGET in sys.modules:
        sys.modules[TARGET].HfDeepSpeedConfig = HfZeroConfig
