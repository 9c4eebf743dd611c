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

    UNSUPPORTED = {
        "use_node_local_storage": Unsupported("each node saving to its own local storage", off=False,
                                              fix="save to storage every rank shares"),
        "load_universal": Unsupported("universal checkpoints", off=False),
    }
    IGNORED = {"parallel_write": "DeepSpeed's parallel writes of pipeline stages' checkpoints; no pipeline here"}
