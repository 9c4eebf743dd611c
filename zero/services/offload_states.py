"""DeepSpeed's `engine.offload_states()` and `engine.reload_states()` (ZeRO-3), which RLHF frameworks call between
training phases to free the accelerator (a generation server on the same GPU) and to take it back.

The states are the swap manager's device-homed segments, rehomed to the host tier and back (tiering/rehoming.py):
`lp_params` the parameter shards, `hp_params` the fp32 masters (with a Kahan master's compensation; training in
fp32 the master is the parameter shard itself, which then moves for either), `optim_states` the Adam moments,
`lp_grads` the accumulated gradients; `contiguous_grad_buffer` frees the gradient reduction's scratch buffers
(the next backward makes them again). Segments homed on the host or nvme already (offload_optimizer cpu) stay.
What else stays on the device, as DeepSpeed keeps it: persistent units' full parameters (DeepSpeed's lp_params
moves the partitions, not persistent parameters' data); a parked root holds no bytes between steps, and the
backward's gradients live only within a backward.

While states are offloaded the engine's forward, backward and step raise a RuntimeError naming reload_states
(DeepSpeed fails on a device mismatch there: a missing reload is a bug in the script, not a cost to hide); a
checkpoint saves and loads through the swap manager as ever, after which the offloaded segments go back to the
host; reads through the swap manager (the model called directly, GatheredParameters, safe_get_full_*) still work,
their copies up evictable. `close()` frees them wherever they are. Stages 0-2 and offloaded parameters are refused
(DeepSpeed serves stages 1-2 too; it refuses offloaded parameters). The host budget must hold the states: a derived
one (host_budget null) holds only what is homed on the host and a working window.
"""
from __future__ import annotations

import warnings
from collections.abc import Container, Iterator

from tiering import BudgetExceededError

from ..integrations.unsupported import UnsupportedFeatureError
from ..optim.driver import STATE_PARTS
from ..runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum


class OffloadStates:
    """The engine's offload_states/reload_states; `_offloaded` (the engine's) maps each offloaded state to the
    segments it moved."""

    def offload_states(self, include: Container[OffloadStateTypeEnum] | None = None,
                       device: OffloadDeviceEnum = OffloadDeviceEnum.cpu, pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Move `include` (default: every state) from the device tier to the host tier; states offloaded already
        are skipped. All or nothing: where the host budget cannot hold them, BudgetExceededError names the bytes and
        the budget, and every state stays where it was. `pin_memory`: the host tier pins as its config says;
        `non_blocking`: the copies run on the copy stream either way, and this returns once they have landed."""
        self._check_offloadable("offload_states")
        device = OffloadDeviceEnum(device)
        if device == OffloadDeviceEnum.none:
            warnings.warn("offload_states(device=none): no device to offload the states to; nothing moved")
            return
        if device == OffloadDeviceEnum.nvme:
            raise ValueError("NVMe offload is not supported for offloading states.")
        states = list(OffloadStateTypeEnum) if include is None else [OffloadStateTypeEnum(s) for s in include]
        states = [s for s in dict.fromkeys(states) if s not in self._offloaded]
        if not states:
            return
        self._finish_step()  # a step still running (overlap_step) or a speculation reads and writes the state
        moved = {name for names in self._offloaded.values() for name in names}
        plan: dict[OffloadStateTypeEnum, list[str]] = {}
        for state in states:
            names = [n for n in dict.fromkeys(self._state_segments(state))
                     if n not in moved and self.swap.segments[n].home == "device"]
            moved.update(names)
            plan[state] = names
        names = [n for names in plan.values() for n in names]
        try:
            moving = self.swap.rehome(names, "host")
        except BudgetExceededError as exc:
            exc.add_note("offload_states: the host tier must hold the offloaded states; set zero_tiering.host_budget "
                         "(a derived one holds what is homed on the host and a working window only)")
            raise
        try:
            moving.wait()
        except BaseException:  # a copy failed: those that moved come back, and nothing counts as offloaded
            self.swap.rehome(names, "device").wait()
            raise
        if OffloadStateTypeEnum.contiguous_grad_buffer in plan:
            self.gradients.free_scratch()
        self._offloaded.update(plan)
        self.swap.device_tier.trim()

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring every offloaded state back to the device tier (nothing offloaded: nothing to do). Where the
        device budget cannot hold them, BudgetExceededError, and they stay offloaded. `non_blocking`: as in
        offload_states."""
        self._check_offloadable("reload_states")
        if not self._offloaded:
            return
        self.swap.rehome([n for names in self._offloaded.values() for n in names], "device").wait()
        self._offloaded.clear()

    def _check_offloadable(self, call: str) -> None:
        if self._closed:
            raise RuntimeError(f"engine.{call}(): the engine is closed")
        if self.stage != 3:
            raise UnsupportedFeatureError(f"engine.{call}() at ZeRO stage {self.stage}",
                                          "ZeRO stage 3 (zero_optimization.stage: 3), where it moves the states")
        param = self.config.zero_optimization.offload_param.device
        if param != "none":
            raise UnsupportedFeatureError(
                f"engine.{call}() with offload_param on {param}", "Moving states across devices is not supported "
                "for offloaded parameters (as in DeepSpeed): their states rest off the device already")

    def _state_segments(self, state: OffloadStateTypeEnum) -> Iterator[str]:
        """The segments holding `state`."""
        if state == OffloadStateTypeEnum.lp_params:
            yield from (unit.segment for unit in self.units if unit.segment is not None)
        for sg in self.driver.sub_groups:
            if state == OffloadStateTypeEnum.hp_params:
                yield sg.place("master")[0]
                if sg.codecs.compensated:
                    yield sg.segment("compensation")
            elif state == OffloadStateTypeEnum.optim_states:
                yield from (sg.segment(part) for part in STATE_PARTS if part != "master")
            elif state == OffloadStateTypeEnum.lp_grads:
                yield sg.segment("grad")

    def _check_loaded(self, call: str) -> None:
        """Raise if states are offloaded: `call` would compute on states that are not on the device."""
        if self._offloaded:
            offloaded = ", ".join(s.value for s in self._offloaded)
            raise RuntimeError(f"engine.{call} while states are offloaded ({offloaded}"
                               "): call engine.reload_states() first")

    def _offloaded_home(self) -> None:
        """Offloaded segments a checkpoint brought to the device go back to the host, their home now."""
        for names in self._offloaded.values():
            for name in names:
                self.swap.evict(name).wait()
