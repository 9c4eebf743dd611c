"""ZeRO-3's copies to the device run on the device tier's copy stream (on CPU its copy worker), asynchronously as
on a GPU: a unit's shard stays pinned until the copy into its full buffer has landed, the module computes only
once it has, no buffer is reused while a copy still reads or writes it, and the next unit's copy starts while
the current one computes. The copy worker is slowed down here so that a buffer released too early is reused
before the copy reads it: the bytes the units receive must still be the right ones, bit for bit."""
from __future__ import annotations

import threading
import time

import pytest
import torch

import zero
from tiering.copy_stream import WorkerCopyStream
from zero.params.unit import UnitState
from zero.train.gpt import GPTConfig

from models import no_decay_groups
from stage3_models import (
    VOCAB, CheckpointedGPT, batches, device_held, engine_train, full_state, one_thread, own_gpt, reference_train,
    stage3_config, units_held,
)

SMALL = GPTConfig(n_layer=4, n_head=2, n_embd=32, vocab_size=VOCAB, seq_len=16)
"""Four blocks of 12,704 parameters (padded to 13,312: 53,248 bytes in fp32) and a root of 3,648 (padded to
4,096: 16,384 bytes)."""


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


class DelayedCopies:
    """The copy worker slowed down: each copy sleeps `delay` seconds before it runs, then checks that its source
    still holds the bytes it held when the copy was submitted (no one reused, refilled or wrote the buffer
    while the copy was in flight)."""

    def __init__(self, monkeypatch, delay: float):
        self.copies = 0
        self.reused: list[str] = []
        self._sent: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        submit = WorkerCopyStream.submit

        def submitted(stream, dst, src, after=None):
            with self._lock:
                self._sent.setdefault(id(dst), []).append(src.clone())
            return submit(stream, dst, src, after)

        def run(dst, src):
            time.sleep(delay)
            with self._lock:
                sent = self._sent[id(dst)].pop(0)
            if not torch.equal(src, sent):
                self.reused.append(f"{src.numel()} x {src.dtype}: "
                                   f"{(src != sent).sum().item()} elements changed while the copy was in flight")
            dst.copy_(src)
            self.copies += 1

        monkeypatch.setattr(WorkerCopyStream, "submit", submitted)
        monkeypatch.setattr(WorkerCopyStream, "run", staticmethod(run))


def reference(make, data):
    model = make()
    return reference_train(model, data), {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("offload_param", ["cpu", "nvme"])
def test_delayed_copies_fill_every_unit_with_its_own_bytes(offload_param, monkeypatch, tmp_path):
    """Optimizer state on nvme, parameters on nvme under a host budget of three parameter shards (3 x 53,248
    bytes, and a little; parameters on host: all of them, homed there), and each optimizer step on its thread
    while the next forward runs (overlap_step): the step's reads and writes take host buffers while the
    forward's copies are in flight, so a shard released before its copy has read it is dropped and its buffer
    refilled by a read. Every copy
    to or from the device waits 5 ms on the worker. Training matches torch bit for bit, every gather's copy
    went through the worker, and no copy saw its source change in flight."""
    make = lambda: own_gpt(0, None, SMALL)  # noqa: E731
    data = batches(4)
    ref_losses, ref_state = reference(make, data)
    delayed = DelayedCopies(monkeypatch, delay=0.005)
    config = stage3_config(offload_param, "nvme", nvme_path=tmp_path, sub_group_size=4096,
                           zero_tiering={"host_budget": 160_000 if offload_param == "nvme" else None,
                                         "overlap_step": True})
    engine, *_ = zero.initialize(model=make(), config=config)
    try:
        losses = engine_train(engine, data)
        state = full_state(engine)
        assert not delayed.reused, delayed.reused
        gathers = 2 * len(engine.units) * len(data)  # each unit in forward and in backward
        assert delayed.copies >= gathers, (delayed.copies, gathers)
        assert losses == ref_losses
        assert all(torch.equal(state[k], v) for k, v in ref_state.items())
        assert not units_held(engine)
    finally:
        engine.close()


def test_gather_waits_for_its_copy(monkeypatch):
    """A unit's gather returns to the module only once the copy into its full buffer has landed: with the copy
    worker held up, the gather does not return."""
    opened = threading.Event()

    def run(dst, src):
        opened.wait()
        dst.copy_(src)

    engine, *_ = zero.initialize(model=own_gpt(0, None, SMALL), config=stage3_config("cpu", "cpu"))
    try:
        monkeypatch.setattr(WorkerCopyStream, "run", staticmethod(run))
        unit = engine.units[1]
        gatherer = threading.Thread(target=engine.placement.gather, args=(unit,))
        gatherer.start()
        gatherer.join(0.2)
        assert gatherer.is_alive(), "the gather returned while its copy was held up"
        opened.set()
        gatherer.join(20)
        with engine.placement.shard(unit) as shard:
            assert unit.state is UnitState.GATHERED and torch.equal(unit.full, shard)
        engine.placement.release(unit)
    finally:
        opened.set()
        engine.close()


def test_the_next_unit_is_prefetched_while_one_computes():
    """From the second micro-batch on, every block a hook gathers, forward and backward, was prefetched (its
    fill started while the unit before it computed); the root, first in each pass, was not. In the first, with no
    order seen yet, so were the forward's blocks after the first (the blocks' own order) and every block of the
    backward (the reverse of the order the forward's modules ended in: the root's forward ends last, the last block's
    before it). Training matches torch."""
    make = lambda: own_gpt(0, None, SMALL)  # noqa: E731
    data = batches(3)
    ref_losses, ref_state = reference(make, data)
    engine, *_ = zero.initialize(model=make(), config=stage3_config("cpu", "cpu"))
    placement = engine.placement
    seen: list[tuple[str, UnitState]] = []
    gather = placement.gather

    def recording(unit):
        seen.append((unit.name or "root", unit.state))
        gather(unit)

    placement.gather = recording
    try:
        losses = engine_train(engine, data[:1])
        assert [state for _, state in seen] == (  # root + 4 blocks, forward and backward
            [UnitState.RELEASED] + [UnitState.PREFETCHED] * 4 + [UnitState.RELEASED] + [UnitState.PREFETCHED] * 4)
        seen.clear()
        losses += engine_train(engine, data[1:])
        blocks = [f"blocks.{i}" for i in range(4)]
        once = ["root", *blocks, "root", *reversed(blocks)]
        assert [name for name, _ in seen] == once * 2
        prefetched = [name for name, state in seen if state is UnitState.PREFETCHED]
        assert prefetched == [name for name in once if name != "root"] * 2, seen
        placement.gather = gather
        assert losses == ref_losses
        assert all(torch.equal(full_state(engine)[k], v) for k, v in ref_state.items())
    finally:
        placement.gather = gather
        engine.close()


def test_the_first_step_reads_ahead_across_parts_of_one_block():
    """Units cut from one module by param group (a block's decay and no-decay parameters) are gathered one after
    the other in both passes; the first step's guess follows that: in both passes every part but the root's first
    is prefetched."""
    model = own_gpt(0, None, SMALL)
    engine, *_ = zero.initialize(model=model, model_parameters=no_decay_groups(model, 0.1),
                                 config=stage3_config("cpu", "cpu"))
    placement = engine.placement
    seen: list[tuple[str, UnitState]] = []
    gather = placement.gather

    def recording(unit):
        seen.append((unit.name, unit.state))
        gather(unit)

    placement.gather = recording
    try:
        engine_train(engine, batches(1))
        parts = [f"{block}#g{g}" for block in ["", *(f"blocks.{i}" for i in range(4))] for g in (0, 1)]
        backward = parts[:2] + [f"blocks.{i}#g{g}" for i in reversed(range(4)) for g in (0, 1)]
        assert [name for name, _ in seen] == parts + backward
        released = {name for name, state in seen if state is UnitState.RELEASED}
        prefetched = [name for name, state in seen if state is UnitState.PREFETCHED]
        assert released == {"#g0"}  # the first of each pass
        assert len(prefetched) == len(seen) - 2, seen
    finally:
        placement.gather = gather
        engine.close()


class SkippingGPT(CheckpointedGPT):
    """Block 2 runs only on even calls: the order the hooks learned one step is wrong the next, so the unit
    prefetched for it is not the one gathered. Parameters start with zero gradients and the reference keeps
    them (zero_grad(set_to_none=False)), so torch's AdamW steps block 2 in the steps it sits out, as the
    engine does (see PartlyUnusedGPT)."""

    calls = 0

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        for p in self.parameters():
            p.grad = torch.zeros_like(p)

    def forward(self, idx, targets=None):
        self.calls += 1
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for i, block in enumerate(self.blocks):
            if i != 2 or self.calls % 2 == 0:
                x = block(x)
        return torch.nn.functional.cross_entropy(self.lm_head(self.ln_f(x)).view(-1, VOCAB), targets.reshape(-1))


def test_a_mispredicted_prefetch_is_dropped():
    """When the order changes, the unit prefetched for a gather that does not come is dropped: training matches
    torch, and after every step no unit is gathered or prefetched and the device tier is empty."""
    def make():
        torch.manual_seed(0)
        return SkippingGPT(SMALL)

    data = batches(5)
    ref = make()
    ref_losses = reference_train(ref, data, set_to_none=False)
    ref_state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    engine, *_ = zero.initialize(model=make(), config=stage3_config("cpu", "cpu"))
    try:
        losses = []
        for ids in data:
            losses += engine_train(engine, [ids])
            assert device_held(engine) == 0
            assert all(unit.state is UnitState.RELEASED for unit in engine.units), units_held(engine)
        assert losses == ref_losses
        assert all(torch.equal(full_state(engine)[k], v) for k, v in ref_state.items())
    finally:
        engine.close()


def test_full_buffers_reuse_the_device_tiers_pages():
    """Without CUDA a gathered unit's full buffer takes a pool buffer's pages: after the first micro-batch no
    gather allocates memory (pages already touched are reused), and autograd's saved views still see the
    bytes in backward (training matches torch)."""
    make = lambda: own_gpt(0, None, SMALL)  # noqa: E731
    data = batches(4)
    ref_losses, _ = reference(make, data)
    engine, *_ = zero.initialize(model=make(), config=stage3_config("cpu", "cpu"))
    try:
        pool = engine.swap.device_tier.pool
        losses = engine_train(engine, data[:2])
        allocations = pool.allocations
        losses += engine_train(engine, data[2:])
        assert pool.allocations == allocations
        assert losses == ref_losses
    finally:
        engine.close()
