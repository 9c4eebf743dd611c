"""The `checkpoint` section: the DeepSpeed checkpoint options users' files (and the HF Trainer) write."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .schema import Section, Unsupported, setting


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig(Section):
    """DeepSpeed's `checkpoint`."""

    tag_validation: Literal["Ignore", "Warn", "Fail"] = setting("Warn", casefold=True)
    """What to do when ranks save under different tags: nothing, warn, or raise."""

    use_node_local_storage: bool = False
    """Each node saves to its own local storage (the HF Trainer sets it for save_on_each_node)."""

    UNSUPPORTED = {
        "load_universal": Unsupported("universal checkpoints", off=False),
    }
