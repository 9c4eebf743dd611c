"""Which stage-3 units persist: gathered once, never released (DeepSpeed's ds_persist). One decision, read by the
placement that holds the units and by the budget that counts them, so the two cannot disagree."""
from __future__ import annotations

from typing import Iterable

from ..config.zero_optimization import ZeroOptimizationConfig
from .flat_unit import FlatUnit


def persistent_units(zo: ZeroOptimizationConfig, flats: Iterable[FlatUnit]) -> list[bool]:
    """Per unit, in plan order (the root unit, then the blocks in module order): whether it persists. DeepSpeed's
    mark_persistent_parameters, by unit (a unit is gathered whole): one of at most param_persistence_threshold
    elements persists unless it would take the elements persisted so far past model_persistence_threshold; one that
    would is skipped and the walk goes on, so a smaller one after it may still fit."""
    persisted, persists = 0, []
    for flat in flats:
        fits = flat.numel <= zo.param_persistence_threshold and persisted + flat.numel <= zo.model_persistence_threshold
        persisted += flat.numel if fits else 0
        persists.append(fits)
    return persists
