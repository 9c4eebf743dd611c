"""SpeculativeStep: the optimizer step inside the backward, exact.

Clipping needs the global gradient norm before any sub-group may step, so a serial step starts its reads and
writes only after the backward. A round of speculation bets that this step will not clip, not overflow and
not see its hyperparameters changed, all known before the backward except the norm: each sub-group steps on
a background thread as soon as its gradient is final (its unit's last reduction at the accumulation
boundary), its previous state kept (SwapManager.keep: on nvme the old extents stay and the new state goes
to fresh ones), its gradient kept too. At the boundary the round is validated: the bet held, and the kept
state is dropped (commit); it failed, and the kept state is restored (roll back), so the serial step runs on
exactly the bytes it would have had. Either way the bits are those of the serial step.

No reader sees an uncommitted shard: the next forward comes after the validation; anything that reads the
state or gathers a unit stepped early before it (a checkpoint, a state_dict, an evaluation between backward and
step) abandons the round first (rolled back, the gradients still pending).
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from tiering import BudgetExceededError, SwapManager

from .driver import AdamDriver, SubGroup

HYPER_KEYS = ("lr", "betas", "eps", "weight_decay", "decoupled")


def hyperparameters(groups: list[dict]) -> list[tuple]:
    """What a step takes from the param groups, as a value to compare."""
    return [tuple(group[key] for key in HYPER_KEYS) for group in groups]


@dataclass
class SpeculationStats:
    """Counts since the engine was built (a step's report takes differences)."""

    stepped_early: int = 0
    """Sub-groups stepped during the backward."""
    rolled_back: int = 0
    """Of those, sub-groups whose step was undone at validation (clipped, overflowed, or abandoned)."""
    re_stepped: int = 0
    """Rolled-back sub-groups stepped again at the boundary (with the clipped gradient)."""
    rollback_bytes: int = 0
    """Bytes of kept state a roll back restores after an early step changed it: read again by the re-step."""


@dataclass(eq=False)
class _Round:
    """One boundary's speculation."""

    hyper: list[tuple]
    groups: list[dict]
    step: int
    grad_scale: float
    submitted: list[SubGroup] = field(default_factory=list)
    stepped: list[SubGroup] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    futures: list[Future] = field(default_factory=list)
    stop: bool = False
    """Set at validation when the bet failed: the worker steps no more sub-groups."""
    depth: int = 1
    """Sub-groups whose state the worker reads ahead of the one stepping (AdamDriver.deeper)."""
    incomplete: bool = False
    """A gradient's add failed (the backward raised its error): the round is rolled back."""
    no_room: bool = False
    """A step found no room in the work tier beside the backward's buffers: the round is rolled back and every
    sub-group steps at the boundary, when the backward has given its room back."""


class SpeculativeStep:
    def __init__(self, driver: AdamDriver, swap: SwapManager,
                 output: Callable[[SubGroup], AbstractContextManager[torch.Tensor]],
                 shard_of: Callable[[SubGroup], str | None]):
        """`output(sg)`: where sg's updated weights go (the engine's parameter shard, written); `shard_of(sg)`:
        the segment `output` writes, kept with the state (None where the master is the shard itself)."""
        self.driver, self.swap, self.output, self.shard_of = driver, swap, output, shard_of
        self.stats = SpeculationStats()
        self._round: _Round | None = None
        self._order: list[SubGroup] = []
        """The order the last round's sub-groups became final: where the worker reads ahead."""
        self._unsettled = 0
        """Sub-groups rolled back by `abandon`, to be stepped at the next boundary (counted as re-stepped there)."""
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="zero-speculate")

    @property
    def running(self) -> bool:
        return self._round is not None

    def begin(self, groups: list[dict], step: int, grad_scale: float) -> None:
        """Open a round for the boundary's backward: sub-groups submitted step with these hyperparameters."""
        self.abandon()
        self._round = _Round(hyperparameters(groups), [dict(group) for group in groups], step, grad_scale)
        if self._order:  # the state the last round stepped first, read while the backward reaches it: the worker
            # reads ahead only once it runs, and until then the disk would wait on the backward's first units
            self.swap.prefetch(self.driver._ahead(self._order, self._round.depth), self.driver.work_tier)

    def submit(self, sub_groups: list[SubGroup], after: list[Future] = ()) -> None:
        """These sub-groups' gradients (one unit's) are final once the adds `after` are done (on the gradients'
        adder; none: added already): step them on the worker then, together (a unit's parameter shard is written
        by all of its sub-groups in one pass: all of them early, or none)."""
        rnd = self._round
        if rnd is None or not sub_groups:
            return
        rnd.submitted.extend(sub_groups)
        rnd.futures.append(self._pool.submit(self._run, rnd, list(sub_groups), after))

    def touch(self, sub_groups: list[SubGroup]) -> None:
        """A gradient is about to be added to these sub-groups: one stepped early would miss it, so the
        round is abandoned (a unit reduced twice in one backward)."""
        rnd = self._round
        if rnd is not None and any(sg in rnd.submitted for sg in sub_groups):
            self.abandon()

    def pending(self, unit: int) -> bool:
        """Whether unit `unit` has sub-groups stepped (or to be stepped) early and not yet validated."""
        rnd = self._round
        return rnd is not None and any(sg.unit == unit for sg in rnd.submitted)

    def before_gather(self, unit: int) -> None:
        """A gather of unit `unit` must read validated values: a round stepping it is abandoned."""
        if self.pending(unit):
            self.abandon()

    def settle(self, groups: list[dict], step: int, grad_scale: float, *, clipped: bool,
               overflow: bool) -> list[SubGroup]:
        """Validate the round at the boundary: the bet held where nothing clipped or overflowed and the
        hyperparameters, step and scale are those the round stepped with; commit it, or roll it back. Returns
        the sub-groups the boundary still steps (unless it skips the step on `overflow`): those not stepped
        early, or every one after a roll back. Without a round: all of them."""
        rnd, self._round = self._round, None
        rolled, self._unsettled = self._unsettled, 0
        valid = (rnd is not None and not clipped and not overflow and rnd.hyper == hyperparameters(groups)
                 and rnd.step == step and rnd.grad_scale == grad_scale)
        if rnd is not None:
            valid = self._finish(rnd, valid)
            rolled += 0 if valid else len(rnd.stepped)
        if not overflow:
            self.stats.re_stepped += rolled
        if not valid:
            return list(self.driver.sub_groups)
        early = set(rnd.stepped)
        return [sg for sg in self.driver.sub_groups if sg not in early]

    def abandon(self) -> None:
        """Roll the round back, if one is open: the gradients stay pending for a serial step."""
        rnd, self._round = self._round, None
        if rnd is not None:
            self._finish(rnd, False)
            self._unsettled += len(rnd.stepped)

    def close(self) -> None:
        try:
            self.abandon()
        finally:
            self._pool.shutdown()

    # -- the worker ------------------------------------------------------------------------------------------

    def _run(self, rnd: _Round, sub_groups: list[SubGroup], after: list[Future]) -> None:
        if any(added.cancelled() or added.exception() is not None for added in after):  # (waits for each add)
            rnd.stop = rnd.incomplete = True  # the backward raises the add's error; the round cannot commit
            return
        try:
            self._step_unit(rnd, sub_groups)
        except BudgetExceededError:
            rnd.stop = rnd.no_room = True

    def _step_unit(self, rnd: _Round, sub_groups: list[SubGroup]) -> None:
        if rnd.stop or not self._keep(rnd, sub_groups):
            return  # no room for their kept state: they step at the boundary
        for sg in sub_groups:
            if rnd.stop:
                return
            ahead = rnd.submitted[rnd.submitted.index(sg) + 1:]
            known = set(rnd.submitted)
            ahead += [s for s in self._order if s not in known]
            self.swap.prefetch(self.driver._ahead(ahead, rnd.depth, sg), self.driver.work_tier)
            with self.swap.untraced():  # its fetches interleave with the backward's: kept off the trace
                self.driver.step_sub_group(sg, rnd.groups[sg.group], rnd.step, rnd.grad_scale, None, self.output,
                                           keep_grad=True)
            rnd.stepped.append(sg)
            rnd.depth = self.driver.deeper(rnd.depth)

    def _keep(self, rnd: _Round, sub_groups: list[SubGroup]) -> bool:
        """Keep every segment stepping `sub_groups` writes that this round has not kept yet; False (none kept)
        where one finds no room."""
        names = [name for sg in sub_groups for name in self._writes(sg)]
        kept = []

        def undo() -> None:
            for done in kept:
                self.swap.commit(done)  # nothing was written since: dropping the copy is undoing the keep

        for name in dict.fromkeys(names):
            if name in rnd.kept:
                continue
            try:
                ok = self.swap.keep(name)
            except BaseException:
                undo()
                raise
            if not ok:
                undo()
                return False
            kept.append(name)
        rnd.kept.extend(kept)
        return True

    def _writes(self, sg: SubGroup) -> list[str]:
        """The segments a step of `sg` writes: its stored state, and the parameter shard it writes to."""
        shard = self.shard_of(sg)
        return [sg.place(part)[0] for part in sg.stored_parts] + ([] if shard is None else [shard])

    def _finish(self, rnd: _Round, valid: bool) -> bool:
        """Stop the worker (when the bet failed), wait for it, then commit or roll back (also where the worker
        found no room); whether it committed. The worker's error, if any, is raised after the kept state was
        restored."""
        rnd.stop = not valid
        error = None
        for future in rnd.futures:
            try:
                future.result()
            except BaseException as exc:
                error = error or exc
        valid = valid and error is None and not rnd.no_room and not rnd.incomplete
        self._order = list(rnd.submitted)
        self.stats.stepped_early += len(rnd.stepped)
        if valid:
            for name in rnd.kept:
                self.swap.commit(name)
            for sg in rnd.stepped:
                self.swap.discard(sg.place("grad")[0])
                self.driver.spent(sg)
        else:
            self.stats.rolled_back += len(rnd.stepped)
            written = {name for sg in rnd.stepped for name in self._writes(sg)}  # the rest kept, still unchanged
            for name in rnd.kept:
                self.stats.rollback_bytes += self.swap.segments[name].nbytes if name in written else 0
                self.swap.restore(name)
        if error is not None:
            raise error
        return valid
