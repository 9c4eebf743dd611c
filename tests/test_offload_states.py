"""DeepSpeed's engine.offload_states() / reload_states() at ZeRO-3 (zero/services/offload_states.py), on
SwapManager.rehome (tiering/rehoming.py).

Training is interrupted after 3 optimizer steps (accumulation 2), states offloaded to the host tier (the device tier
then holds none of their bytes) and reloaded, 3 more steps trained: every loss and the final parameters must be
bitwise those of an uninterrupted 6-step run. Then the edges: twice, forward while offloaded, a checkpoint while
offloaded, close while offloaded, bad arguments and a host budget too small.
"""
from __future__ import annotations

import functools

import pytest
import torch

import zero
from tiering import BudgetExceededError, SwapConfig, SwapManager
from tiering.errors import IllegalTransitionError
from zero.integrations.unsupported import UnsupportedFeatureError
from zero.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum as State

from stage3_models import assert_state_equal, batches, engine_train, full_state, one_thread, own_gpt, stage3_config

ACCUM = 2
STEPS = 3  # optimizer steps before the offload, and after it


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def config(bf16: bool = False, **extra) -> dict:
    return stage3_config(accum=ACCUM, bf16=bf16, **extra)


def data() -> list[torch.Tensor]:
    return batches(2 * STEPS * ACCUM)


@functools.lru_cache(maxsize=None)
def uninterrupted(bf16: bool) -> tuple[list[float], dict]:
    """Losses and final state of 6 steps in one go."""
    with one_thread():
        engine, *_ = zero.initialize(model=own_gpt(0), config=config(bf16))
        try:
            return engine_train(engine, data()), full_state(engine)
        finally:
            engine.close()


def first_half(bf16: bool = False, **extra):
    engine, *_ = zero.initialize(model=own_gpt(0), config=config(bf16, **extra))
    return engine, engine_train(engine, data()[:STEPS * ACCUM])


def second_half(engine, losses: list[float], bf16: bool = False) -> None:
    """Train the rest and compare with the uninterrupted run, bitwise."""
    losses = losses + engine_train(engine, data()[STEPS * ACCUM:])
    ref_losses, ref_state = uninterrupted(bf16)
    assert losses == ref_losses
    assert_state_equal(full_state(engine), ref_state)


def segments_of(engine, state: State) -> list[str]:
    return list(dict.fromkeys(engine._state_segments(state)))


def device_segment_bytes(engine) -> int:
    return engine.swap.device_tier.parts()["segments"]


@pytest.mark.parametrize("bf16, include", [(False, None), (True, None), (False, [State.optim_states])],
                         ids=["fp32-all", "bf16-all", "fp32-optim_states"])
def test_offload_reload_trains_bitwise(bf16, include):
    engine, losses = first_half(bf16)
    try:
        swap = engine.swap
        states = list(State) if include is None else include
        moved = [n for s in states for n in segments_of(engine, s)]
        assert moved
        charge = sum(swap.device_tier.charge(swap.segments[n].nbytes) for n in moved)
        before_device, before_host = device_segment_bytes(engine), swap.pool.in_use
        engine.offload_states(include=include)
        for name in moved:
            seg = swap.segments[name]
            assert (seg.home, seg.state.name, seg.device) == ("host", "HOST", None), name
            assert seg.host_current or seg.spent, name  # a gradient once stepped has no bytes to keep
        assert device_segment_bytes(engine) == before_device - charge
        assert swap.pool.in_use == before_host + sum(swap.segments[n].host_charge for n in moved)
        if include is None:
            assert swap.device_tier.in_use == 0  # persistence threshold 0: no unit stays gathered
        engine.reload_states()
        for name in moved:
            seg = swap.segments[name]
            assert (seg.home, seg.state.name, seg.host) == ("device", "DEVICE", None), name
        assert device_segment_bytes(engine) == before_device and swap.pool.in_use == before_host
        second_half(engine, losses, bf16)
    finally:
        engine.close()


def test_twice_harmless_and_forward_while_offloaded_raises():
    engine, losses = first_half()
    try:
        engine.reload_states()  # nothing offloaded: nothing to do
        engine.offload_states(include=[State.lp_params])
        held = engine.swap.pool.in_use
        engine.offload_states(include=[State.lp_params])  # already offloaded: skipped
        assert engine.swap.pool.in_use == held
        engine.offload_states()  # the rest
        assert engine.swap.device_tier.in_use == 0
        ids = data()[0]
        with pytest.raises(RuntimeError, match="reload_states"):
            engine(ids[:, :-1], ids[:, 1:])
        with pytest.raises(RuntimeError, match="reload_states"):
            engine.step()
        engine.reload_states()
        engine.reload_states()
        assert engine.swap.pool.in_use == 0
        second_half(engine, losses)
    finally:
        engine.close()


def test_checkpoint_while_offloaded(tmp_path):
    engine, losses = first_half()
    try:
        engine.offload_states()
        engine.save_checkpoint(tmp_path)
        assert engine.swap.device_tier.in_use == 0  # what the save brought up went back to the host
        engine.load_checkpoint(tmp_path)  # a load into offloaded state too
        assert engine.swap.device_tier.in_use == 0
        engine.reload_states()
        second_half(engine, losses)
    finally:
        engine.close()
    fresh, *_ = zero.initialize(model=own_gpt(1), config=config())
    try:
        fresh.load_checkpoint(tmp_path)
        second_half(fresh, losses)
    finally:
        fresh.close()


def test_close_while_offloaded():
    engine, _ = first_half()
    engine.offload_states()
    engine.close()
    assert not engine.swap.segments and engine.swap.pool.in_use == 0
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.reload_states()


def test_optimizer_on_host_moves_the_parameters_only():
    engine, losses = first_half(offload_optimizer={"device": "cpu"})
    try:
        homes = {n: s.home for n, s in engine.swap.segments.items()}
        engine.offload_states()
        params = set(segments_of(engine, State.lp_params))
        assert {n: s.home for n, s in engine.swap.segments.items()} == {
            n: "host" if n in params else home for n, home in homes.items()}
        engine.reload_states()
        assert {n: s.home for n, s in engine.swap.segments.items()} == homes
    finally:
        engine.close()


def test_bad_arguments():
    engine, losses = first_half()
    try:
        with pytest.raises(ValueError, match="NVMe"):
            engine.offload_states(device=OffloadDeviceEnum.nvme)
        with pytest.warns(UserWarning, match="nothing moved"):
            engine.offload_states(device="none")
        assert engine.swap.pool.in_use == 0
        second_half(engine, losses)
    finally:
        engine.close()


@pytest.mark.parametrize("cfg, reason", [
    (stage3_config(param="cpu"), "offloaded parameters"),
    ({**stage3_config(), "zero_optimization": {"stage": 2}}, "stage 2"),
])
def test_refused(cfg, reason):
    engine, *_ = zero.initialize(model=own_gpt(0), config=cfg)
    try:
        with pytest.raises(UnsupportedFeatureError, match=reason):
            engine.offload_states()
        with pytest.raises(UnsupportedFeatureError, match=reason):
            engine.reload_states()
    finally:
        engine.close()


def test_host_budget_too_small_changes_nothing():
    engine, losses = first_half(zero_tiering={"host_budget": 256 << 10})
    try:
        homes = {n: (s.home, s.state) for n, s in engine.swap.segments.items()}
        in_use = engine.swap.device_tier.in_use
        with pytest.raises(BudgetExceededError, match="host budget 256.0 KiB") as info:
            engine.offload_states()
        assert info.value.requested > info.value.budget and "rehomed to host" in str(info.value)
        assert "zero_tiering.host_budget" in info.value.__notes__[0]
        assert {n: (s.home, s.state) for n, s in engine.swap.segments.items()} == homes
        assert engine.swap.device_tier.in_use == in_use
        engine.reload_states()  # nothing was offloaded
        second_half(engine, losses)
    finally:
        engine.close()


# -- the tiering primitive ------------------------------------------------------------------------------------------

def test_rehome_round_trip_and_refusals():
    with SwapManager(SwapConfig(host_budget=64 << 10, device_budget=64 << 10)) as swap:
        values = {f"s{i}": torch.arange(1024, dtype=torch.float32) * (i + 1) for i in range(3)}
        for name, value in values.items():
            swap.register(name, dtype=torch.float32, shape=(1024,), home="device", data=value).wait()
        with swap.held("s0", "device"):
            with pytest.raises(IllegalTransitionError, match="unpinned"):
                swap.rehome(values, "host")
        assert all(s.home == "device" for s in swap.segments.values())
        swap.rehome(values, "host").wait()
        assert swap.device_tier.in_use == 0 and swap.pool.in_use == 3 * 4096
        for name, value in values.items():
            with swap.held(name, "host") as got:
                assert torch.equal(got, value)
        with swap.held("s1", "device", dirty=True) as got:  # a host-homed segment brought up and written
            got.add_(1)
        values["s1"] = values["s1"] + 1
        swap.rehome(values, "device").wait()
        assert swap.pool.in_use == 0 and all(s.host is None for s in swap.segments.values())
        for name, value in values.items():
            with swap.held(name, "device") as got:
                assert torch.equal(got, value)
        swap.register("filler", dtype=torch.uint8, shape=(60 << 10,), home="host").wait()  # 4 KiB left
        with pytest.raises(BudgetExceededError, match="3 segments rehomed to host"):
            swap.rehome(values, "host")
        assert all(swap.segments[n].home == "device" and swap.segments[n].state.name == "DEVICE" for n in values)
