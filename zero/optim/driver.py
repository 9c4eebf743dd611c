"""AdamDriver: steps sub-groups whose fp32 master weights, Adam moments and gradients live in the swap
manager's tiers (device, host or nvme).

Each step fetches every sub-group's four segments in the same order, so from the second step on the
manager's trace reads the next sub-group's state ahead while the current one is updated, and releasing the
updated state dirty lets it be written back while later ones compute. The arithmetic is `adam_step`.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator

import torch

from tiering import SwapManager, Tier

from .adam_math import AdamThreads, adam_step, param_tails, torch_fused_step
from .compact_step import compact_step, sr_key
from .state_format import FP32, Kahan, StateFormat, SubGroupCodecs

STATE_PARTS = ("master", "exp_avg", "exp_avg_sq")
"""The parts of a sub-group's optimizer state (with its gradient, "grad", what a step reads). A bf16-kahan master
is stored in two segments, its weights and a "compensation" (`SubGroup.stored_parts`); its value is one part."""


@dataclass(eq=False)
class SubGroup:
    """A slice of fp32 optimizer state updated at once; its segments are named `<name>/<part>`."""

    name: str
    numel: int
    group: int
    """Index of its param group (the hyperparameters it is stepped with)."""
    unit: int
    """Index of the unit whose optimizer state it is a slice of."""
    offset: int
    """Where the slice starts within this rank's range of the unit's flat buffer (see FlatUnit.rank_range)."""
    codecs: SubGroupCodecs
    """How its master and moments are stored."""
    index: int = 0
    """Its first element's index in the unit's flat buffer (the same on any number of ranks)."""
    tails: tuple[tuple[int, int], ...] | None = None
    """Where its parameters' last numel % 8 elements lie in it (see `adam_step`): torch's fused kernel, stepping
    each parameter as its own tensor, rounds those its own way, wherever the sub-groups are cut. None: one tensor."""
    grad_fresh: bool = True
    """No gradient accumulated since the last step: the next accumulation overwrites instead of adding."""
    norms: list[tuple[int, torch.Tensor]] | None = None
    """Norms of the accumulated gradient's pieces, taken when its last part was added (see `accumulate`)."""
    trained: int = 0
    """Its unit's ordinal among the trained units (as checkpoints number them): the stochastic-rounding key, the
    same at every stage, where `unit` counts frozen units at stage 3 only."""
    master_in: tuple[str, int] | None = None
    """(segment, offset): the fp32 master is this slice of another segment rather than a segment of its own.
    Training in fp32, the engine's parameter shard holds the very values a master would: one copy, not two,
    in memory and on nvme."""

    def segment(self, part: str) -> str:
        return f"{self.name}/{part}"

    @property
    def stored_parts(self) -> tuple[str, ...]:
        """The parts of its optimizer state as segments store them: STATE_PARTS, and a Kahan master's
        compensation."""
        return STATE_PARTS + (("compensation",) if self.codecs.compensated else ())

    def place(self, part: str) -> tuple[str, int]:
        """(segment, offset) where `part` of this sub-group lives."""
        if part == "master" and self.master_in is not None:
            return self.master_in
        return self.segment(part), 0

    def whole(self, part: str) -> bool:
        """Whether `part` has a segment to itself (a master in the parameter shard is a slice of it): a writer
        of every element then fetches it to overwrite, reading none of the stored bytes."""
        return not (part == "master" and self.master_in is not None)


class AdamDriver:
    def __init__(self, swap: SwapManager, *, state_home: Tier, grad_home: Tier, work_tier: Tier,
                 grad_dtype: torch.dtype = torch.float32, state_format: StateFormat = StateFormat()):
        """`grad_dtype`: what the accumulated gradient is kept in. 16 bits where each step's gradient is
        stored once, exactly as the reduction left it (no accumulation): the same values as fp32 in half the
        bytes written and read back; the step casts them to fp32 once. `state_format`: how master and moments
        are stored."""
        self.swap = swap
        self.state_format = state_format
        self.state_home, self.grad_home, self.work_tier = state_home, grad_home, work_tier
        self.grad_dtype = grad_dtype
        self._grad_fp32: torch.Tensor | None = None  # where a 16-bit gradient is cast for the step (reused)
        self.sub_groups: list[SubGroup] = []
        self._trained: dict[int, int] = {}  # unit index: its ordinal among the units added (SubGroup.trained)
        self.threads = AdamThreads()  # the step on as many threads as torch uses (see adam_step)
        self.timing = (0.0, 0.0)
        """The last `step_sub_group`'s seconds waiting for its state, and stepping it once there."""

    def add_unit(self, unit: int, name: str, master: torch.Tensor, group: int, chunk: int,
                 master_in: str | None = None, start: int = 0, extents=None) -> list[SubGroup]:
        """Register `master` (this rank's fp32 range of unit `unit`, flat, starting at element `start` of the
        unit's flat buffer, whose parameters lie at `extents`: FlatUnit.extents; None: each sub-group is one
        tensor) as sub-groups `<name>/<k>` of at most `chunk` elements (0: one), stepped with param group `group`;
        moments and gradient start at zero. Units are added in order, trained ones only (SubGroup.trained).
        With `master_in`, the segment that already holds the master in the master's format (see
        SubGroup.master_in)."""
        chunk = chunk or master.numel()
        trained = self._trained.setdefault(unit, len(self._trained))
        sub_groups = []
        for k, offset in enumerate(range(0, master.numel(), chunk)):
            numel = min(chunk, master.numel() - offset)
            sg = SubGroup(f"{name}/{k}", numel, group, unit, offset,
                          self.state_format.codecs(numel, start + offset, extents), index=start + offset,
                          tails=None if extents is None else param_tails(extents, start + offset, numel),
                          master_in=None if master_in is None else (master_in, offset), trained=trained)
            sub_groups.append(self._add(sg, master.narrow(0, offset, numel)))
        return sub_groups

    def _add(self, sg: SubGroup, master: torch.Tensor) -> SubGroup:
        shape = (sg.numel,)
        handles = []
        for part in sg.stored_parts:
            if part == "master" and sg.master_in is not None:
                continue
            codec = sg.codecs.of(part)
            data = None  # moments, gradient and a Kahan master's compensation start at zero
            if part == "master":  # a Kahan master starts at the bf16 parameter, as every placement computes with
                data = torch.empty(codec.storage_numel(sg.numel), dtype=codec.dtype)
                codec.encode(master.reshape(-1), data, sg.numel)
            handles.append(self.swap.register(sg.segment(part), dtype=codec.dtype,
                                              shape=(codec.storage_numel(sg.numel),), home=self.state_home, data=data))
        handles.append(self.swap.register(sg.segment("grad"), dtype=self.grad_dtype, shape=shape, home=self.grad_home))
        for handle in handles:
            handle.wait()
        self.sub_groups.append(sg)
        return sg

    def accumulate(self, sg: SubGroup, grad: torch.Tensor, pieces: list[tuple[int, int, int]] | None = None, *,
                   fetch_soon: bool = False) -> None:
        """Add `grad` (this sub-group's slice of the reduced fp32 gradient) to its accumulated gradient. With
        `pieces` (the last part of this step's gradient: see `grad_norms`), their norms are taken now, while the
        gradient is in memory, rather than read back from its tier for them. `fetch_soon`: a step off the trace
        reads it next (a speculative step), so it is not written behind."""
        fresh = sg.grad_fresh
        with self.held(sg, "grad", dirty=True, overwrite=fresh) as acc:  # fresh: nothing to read
            if fresh:
                acc.copy_(grad)
                sg.grad_fresh = False
                total = grad  # the values `acc` now holds, in fp32
            elif acc.dtype == torch.float32:
                acc.add_(grad)
                total = acc
            else:  # a second backward without a step, gradient kept in 16 bits: added in fp32, then rounded
                acc.copy_(acc.float().add_(grad))
                total = acc.float()  # the norms are those of what the step will read
            sg.norms = None if pieces is None else [
                (key, torch.linalg.vector_norm(total.narrow(0, start, length))) for start, length, key in pieces]
            if fetch_soon:
                self.swap.expect_fetch(sg.place("grad")[0])

    def grad_norms(self, pieces: Callable[[SubGroup], list[tuple[int, int, int]]]) -> list[tuple[int, torch.Tensor]]:
        """fp32 2-norms of the accumulated gradient's pieces: `pieces(sg)` gives (start, length, key) in the
        sub-group, and each norm comes back with its key. The engine passes one piece per parameter keyed
        by the parameter's place in the model, so the norms are those torch's clipping computes. Norms taken
        by `accumulate` are used as they are: the gradient is then not read again."""
        norms = []
        for sg in self.sub_groups:
            if sg.grad_fresh:
                continue
            if sg.norms is not None:
                norms.extend(sg.norms)
                continue
            with self.held(sg, "grad") as acc:
                norms.extend((key, torch.linalg.vector_norm(acc.narrow(0, start, length).float()))
                             for start, length, key in pieces(sg))
        return norms

    @contextlib.contextmanager
    def held(self, sg: SubGroup, part: str, *, dirty: bool = False, discard: bool = False,
             overwrite: bool = False) -> Iterator[torch.Tensor]:
        """`part` of `sg` in the work tier, its values in fp32 for a state part (the gradient as it is kept),
        released afterwards as asked (see SwapManager.fetch and release), even if the block fails. A part stored
        compact is decoded into a copy, encoded back after the block when `dirty` (a Kahan master from and to
        its weights and compensation). `overwrite`: the block writes every element, so a segment the part has
        to itself is not read (`SubGroup.whole`)."""
        codec = sg.codecs.of(part) if part in STATE_PARTS else FP32
        release = dict(dirty=dirty, discard=discard, overwrite=overwrite)
        with contextlib.ExitStack() as stack:
            stored = stack.enter_context(self._stored(sg, part, **release))
            if codec is FP32:
                yield stored
                return
            kahan = part == "master" and sg.codecs.compensated
            compensation = stack.enter_context(self._stored(sg, "compensation", **release)) if kahan else None
            values = torch.empty(sg.numel, dtype=torch.float32, device=stored.device)
            if kahan:
                Kahan.decode(stored, compensation, values)
            else:
                codec.decode(stored, sg.numel, values)
            yield values
            if dirty and kahan:
                Kahan.encode(values, stored, compensation)
            elif dirty:
                codec.encode(values, stored, sg.numel)

    @contextlib.contextmanager
    def _stored(self, sg: SubGroup, part: str, **release) -> Iterator[torch.Tensor]:
        """`part` of `sg` as its segment stores it."""
        name, offset = sg.place(part)
        codec = sg.codecs.of(part) if part in sg.stored_parts else FP32
        release["overwrite"] = release.get("overwrite", False) and sg.whole(part)
        with self.swap.held(name, self.work_tier, **release) as tensor:
            yield tensor.narrow(0, offset, codec.storage_numel(sg.numel))

    def zero_grad(self) -> None:
        for sg in self.sub_groups:
            self.spent(sg)

    def step(self, groups: list[dict], step: int, grad_scale: float, clip: torch.Tensor | None,
             output: Callable[[SubGroup], ContextManager[torch.Tensor]], *, read_ahead: bool = False,
             on_done: Callable[[SubGroup], None] | None = None, sub_groups: list[SubGroup] | None = None) -> None:
        """One Adam step of every sub-group (or of `sub_groups`, in order), with `groups[sg.group]`'s
        hyperparameters (see `step_sub_group`). `read_ahead`: before stepping each sub-group, ask for the next
        ones' state (where the swap manager's trace does not cover these fetches), as deep as `deeper` says;
        `on_done(sg)` is called as each sub-group's weights are written."""
        order = self.sub_groups if sub_groups is None else sub_groups
        depth = 1
        for i, sg in enumerate(order):
            if read_ahead:
                self.swap.prefetch(self._ahead(order[i + 1:], depth, sg), self.work_tier)
            self.step_sub_group(sg, groups[sg.group], step, grad_scale, clip, output)
            depth = self.deeper(depth)
            if on_done is not None:
                on_done(sg)

    def deeper(self, depth: int) -> int:
        """How many sub-groups to read ahead next, `depth` so far: one more where the last one waited for its
        state longer than half its step. As few as keep the step from waiting: each takes host room from what
        the backward and the next forward gather, to be read again (bench/RESULTS.md, 2026-11-27)."""
        waited, stepped = self.timing
        return depth + (waited > stepped / 2)

    def step_sub_group(self, sg: SubGroup, hyper: dict, step: int, grad_scale: float, clip: torch.Tensor | None,
                       output: Callable[[SubGroup], ContextManager[torch.Tensor]], *, keep_grad: bool = False) -> None:
        """One Adam step of `sg` with the hyperparameters `hyper`; `output(sg)` is a context manager giving
        where the updated weights go in the compute dtype (a bf16/fp16 tensor is written in the same pass, an
        fp32 one by a copy); it is not called for a sub-group whose master is the parameter shard itself
        (`master_in`). A sub-group that got no gradient since the last step steps with zeros, as torch's AdamW
        does for a parameter whose grad is zero. `clip` (an fp32 scalar below 1, or None) multiplies the
        gradient first, as torch.nn.utils.clip_grad_norm_ does, so clipping rounds alike; `grad_scale` (1 / loss
        scale) is folded into the Adam pass. The gradient is spent after the step and dropped unwritten, unless
        `keep_grad` (a speculative step: a roll back re-steps with it), which leaves its bytes and the sub-group's
        gradient bookkeeping as they were."""
        start = time.perf_counter()
        with contextlib.ExitStack() as stack:
            # A spent grad is dropped unwritten, the next accumulation overwrites it; a fresh one (no gradient
            # since the last step) is zeros, nothing to read.
            spend = not keep_grad
            master, grad, exp_avg, exp_avg_sq, *compensation = (
                stack.enter_context(self._stored(sg, part, dirty=part != "grad", discard=part == "grad" and spend,
                                                 overwrite=part == "grad" and sg.grad_fresh))
                for part in ("master", "grad", "exp_avg", "exp_avg_sq") + sg.stored_parts[len(STATE_PARTS):])
            ready = time.perf_counter()
            # The compact kernel reads a bf16 gradient as fp32 itself, where nothing is stored back into it (no loss
            # scale) and no clip multiplies it first (in fp32, as torch's clip_grad_norm_ does).
            read_as_fp32 = (not sg.codecs.exact and grad.dtype == torch.bfloat16 and grad_scale == 1.0
                            and (clip is None or sg.grad_fresh))
            if not read_as_fp32 and (grad.dtype != torch.float32 or (keep_grad and grad_scale != 1.0)):
                grad = self._in_fp32(grad)  # a scale != 1 is stored back into the grad by the kernel
            if sg.grad_fresh:
                grad.zero_()
            elif clip is not None:
                grad.mul_(clip.to(grad.device))
            beta1, beta2 = hyper["betas"]
            options = dict(lr=hyper["lr"], beta1=beta1, beta2=beta2, eps=hyper["eps"],
                           weight_decay=hyper["weight_decay"])
            tensors = (master, grad, exp_avg, exp_avg_sq)
            # A master that is the parameter shard itself is updated in place: there is nothing to write out.
            with contextlib.nullcontext() if sg.master_in is not None else output(sg) as out:
                low_precision = out is not None and out.dtype in (torch.bfloat16, torch.float16)
                low = out if low_precision and not out.is_cuda else None
                if not sg.codecs.exact:
                    compact_step(*tensors, codecs=sg.codecs, numel=sg.numel, out=low, key=sr_key(step, sg.trained),
                                 compensation=compensation[0] if compensation else None, tails=sg.tails,
                                 index=sg.index, threads=self.threads, hyper=dict(
                                     step=step, decoupled=hyper["decoupled"], grad_scale=grad_scale, **options))
                elif master.is_cuda:  # optimizer state kept on the GPU (offload_optimizer none)
                    torch_fused_step(*tensors, step=step, decoupled=hyper["decoupled"], grad_scale=grad_scale,
                                     **options)
                else:
                    adam_step(*tensors, step=step, decoupled=hyper["decoupled"], grad_scale=grad_scale,
                              out=low, threads=self.threads, tails=sg.tails, **options)
                if out is not None and low is None:
                    out.copy_(master)
            self.timing = (ready - start, time.perf_counter() - ready)
            if keep_grad:  # most likely never read again (the step commits): not written behind
                self.swap.expect_overwrite(sg.place("grad")[0])
            if sg.master_in is not None:
                name, offset = sg.master_in
                if offset + sg.numel < self.swap.segments[name].shape.numel():
                    # The unit's next sub-group writes the rest of the shard next: it is written behind once
                    # whole, not once per sub-group (a far next use would start a write of all of it each time).
                    self.swap.expect_fetch(name)
        if spend:
            self.spent(sg)

    def spent(self, sg: SubGroup) -> None:
        """`sg`'s gradient was applied: the next accumulation starts afresh."""
        sg.grad_fresh = True
        sg.norms = None

    def _ahead(self, order: list[SubGroup], depth: int | None = None, stepping: SubGroup | None = None) -> list[str]:
        """The segments stepping the first `depth` sub-groups of `order` (None: all) reads, in order, as many as
        the swap manager's prefetch allowance holds (those that find no room yet start as room frees). At most
        half the work tier's budget: the rest is the room of the sub-group stepping and its output, or a fetch
        would take back what was read ahead, to be read again. What `stepping` holds is not ahead and takes none
        of the allowance: a master that is its unit's parameter shard, shared by the unit's sub-groups (a tied
        embedding's 200 MB left no room for the moments after it)."""
        config = self.swap.config
        budget = config.host_budget if self.work_tier == "host" else config.device_budget
        limit = config.prefetch_bytes if budget is None else min(config.prefetch_bytes, budget // 2)
        held = set() if stepping is None else {stepping.place(part)[0] for part in stepping.stored_parts}
        names, nbytes = [], 0
        for sg in order[:depth]:
            for part in sg.stored_parts + (() if sg.grad_fresh else ("grad",)):
                name = sg.place(part)[0]
                if name in names or name in held:
                    continue
                nbytes += self.swap.segments[name].nbytes
                if nbytes > limit:
                    return names
                names.append(name)
        return names

    def _in_fp32(self, grad: torch.Tensor) -> torch.Tensor:
        """`grad` cast to fp32 into a buffer reused by every sub-group (one step runs at a time)."""
        scratch = self._grad_fp32
        if scratch is None or scratch.numel() < grad.numel() or scratch.device != grad.device:
            largest = max(sg.numel for sg in self.sub_groups)
            scratch = self._grad_fp32 = torch.empty(largest, dtype=torch.float32, device=grad.device)
        return scratch[: grad.numel()].copy_(grad)

    def close(self) -> None:
        self.threads.close()
