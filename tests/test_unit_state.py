"""A unit's life (zero/params/unit.py): one state, changed only along the transition table's edges, and the
states a stage-3 engine leaves its units in through a step, a gather and an overlapped optimizer step."""
from __future__ import annotations

import itertools

import pytest
import torch

import zero
from tiering import IllegalTransitionError
from zero.params.flat_unit import FlatUnit
from zero.params.unit import TRANSITIONS, Unit, UnitState

from stage3_models import batches, engine_train, own_gpt, stage3_config


def bare_unit(state: UnitState) -> Unit:
    param = torch.nn.Parameter(torch.zeros(3))
    return Unit(0, FlatUnit("blocks.0", [("blocks.0.w", param)], 1, 0), torch.nn.Module(), torch.zeros(1024), [],
                state=state)


@pytest.mark.parametrize("action, state", list(itertools.product(TRANSITIONS, UnitState)))
def test_every_action_from_every_state_follows_the_table(action, state):
    sources, target = TRANSITIONS[action]
    unit = bare_unit(state)
    if state in sources:
        unit.to(action)
        assert unit.state is target
    else:
        with pytest.raises(IllegalTransitionError) as info:
            unit.to(action)
        assert unit.state is state, "a refused transition changed the state"
        assert info.value.action == action and info.value.actual == state.name and "blocks.0" in str(info.value)


def test_stage3_units_through_a_step_a_gather_and_an_overlapped_step(tmp_path):
    config = stage3_config("cpu", "cpu", persistence=0, zero_tiering={"overlap_step": True})
    engine = zero.initialize(model=own_gpt(), config=config)[0]
    try:
        assert all(unit.state is UnitState.RELEASED for unit in engine.units)
        engine_train(engine, batches(1))
        assert all(unit.state is UnitState.RELEASED for unit in engine.units), "a step left a unit gathered"
        with engine.gathered_parameters():
            assert all(unit.state is UnitState.GATHERED and unit.refs == 1 for unit in engine.units)
        assert all(unit.state is UnitState.RELEASED and unit.refs == 0 for unit in engine.units)
    finally:
        engine.close()
    persistent = stage3_config("cpu", "cpu", persistence=10**9, zero_tiering={"overlap_step": True})
    engine = zero.initialize(model=own_gpt(), config=persistent)[0]
    try:
        engine_train(engine, batches(1))  # the step runs on its thread: gathered units must refill
        assert all(unit.state is UnitState.STALE for unit in engine.units)
        engine_train(engine, batches(1))  # each gather refilled its unit; the next step made it stale again
        assert all(unit.state is UnitState.STALE for unit in engine.units)
        engine.overlap.wait_all()
        with engine.gathered_parameters():
            assert all(unit.state is UnitState.GATHERED for unit in engine.units)
    finally:
        engine.close()
