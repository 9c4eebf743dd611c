"""The swap manager under random sequences of calls, checked against a plain PyTorch model.

The model keeps, per segment, its home, its pins and the bytes it must hold. After every step the machine
checks that no tier is over its budget (now or at its peak), that the manager's buffers add up to exactly the
bytes its tiers report in use (nothing leaked), and that every copy the manager calls current holds the
model's bytes. A segment released with `discard` holds no bytes the model knows until a fetch with
`overwrite` writes it again: meanwhile it has no copy above its home and a plain fetch is refused. Illegal
calls must raise IllegalTransitionError (unknown names KeyError), and
BudgetExceededError is accepted only when the bytes that cannot leave the tier (pinned there, resting at home
there, or with nowhere to go: `stuck_bytes`) leave no room for the request. Moves started by one rule are
still in flight during the next ones; the `settle` rule and the teardown let them land.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tiering import (
    AioConfig,
    BudgetExceededError,
    IllegalTransitionError,
    NvmeStoreConfig,
    Residency,
    SwapConfig,
    SwapManager,
    align_up,
)
from tiering.residency import TIER_ORDER

PAGE = 4096
NAMES = [f"seg{i}" for i in range(6)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float64, torch.int64]
MOVE_TIMEOUT = 20.0
"""Seconds any move may take here (a few KiB on a local disk); longer means a hang."""


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def charge(nbytes: int) -> int:
    """Bytes a copy takes from a budget on CPU: host buffers (and the CPU device tier's) are whole 4 KiB pages."""
    return align_up(max(nbytes, 1))


class SwapMachine(RuleBasedStateMachine):
    nvme_engine: str | None = None  # set by the subclasses below

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="zt-swap-stateful-")
        self.mgr: SwapManager | None = None
        self.expected: dict[str, torch.Tensor] = {}  # name -> the bytes the segment must hold
        self.home: dict[str, str] = {}
        self.pins: dict[str, int] = {}
        self.pinned_tier: dict[str, str | None] = {}
        self.spent: set[str] = set()  # discarded: no bytes to check until overwritten

    # -- setup ---------------------------------------------------------------------------------------------

    @initialize(
        host_pages=st.integers(3, 7),
        device_pages=st.integers(2, 5),
        prefetch_pages=st.integers(0, 4),
        live_pages=st.none() | st.integers(1, 5),
        reuse=st.none() | st.integers(0, 3 * PAGE),
    )
    def setup(self, host_pages, device_pages, prefetch_pages, live_pages, reuse):
        nvme = None
        if self.nvme_engine is not None:
            nvme = NvmeStoreConfig(nvme_path=self.dir, grow_step=4 * PAGE, aio=AioConfig(engine=self.nvme_engine))
        self.config = SwapConfig(
            host_budget=host_pages * PAGE, device_budget=device_pages * PAGE, nvme=nvme,
            prefetch_bytes=prefetch_pages * PAGE, max_live_bytes=None if live_pages is None else live_pages * PAGE,
            reuse_distance=reuse, checksums=True,
        )
        self.mgr = SwapManager(self.config)

    def teardown(self) -> None:
        try:
            if self.mgr is not None:
                self.settle_moves()
                self.every_byte_is_where_the_manager_says()
                self.mgr.close()
                if self.mgr.store is not None:
                    assert not os.path.exists(self.mgr.store.path), "close() left the swap file behind"
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- what the model says -------------------------------------------------------------------------------

    def homes(self) -> list[str]:
        return ["device", "host", "nvme"] if self.nvme_engine is not None else ["device", "host"]

    def nbytes(self, name: str) -> int:
        return self.expected[name].numel()

    def stuck_bytes(self, tier: str, bringing: str | None = None) -> int:
        """Bytes in `tier` that no eviction may free, read from the manager's buffers (a reused pool buffer
        may be larger than the segment): copies pinned there; segments resting at home there; on host, the
        copy of `bringing` (a segment on its way up to the device, staged in host while room is made on the
        device); on the device, unpinned copies whose bytes exist nowhere below and find no room on host."""
        host = 0
        for seg in self.mgr.segments.values():
            if seg.host is not None and (seg.pins and seg.pinned_tier == "host" or seg.home == "host" == seg.state.tier):
                host += seg.host.capacity
        if bringing is not None:
            seg = self.mgr.segments[bringing]
            if seg.state != Residency.DEVICE and not (seg.home == "host" == seg.state.tier):
                host += seg.host.capacity if seg.host is not None else charge(seg.nbytes)
        if tier == "host":
            return host
        device = 0
        for seg in self.mgr.segments.values():
            if seg.device is None:
                continue
            clean = seg.host_current or (seg.nvme_current and seg.home == "nvme")
            no_room_below = seg.host is None and host + charge(seg.nbytes) > self.config.host_budget
            if seg.pins or seg.home == "device" or (not clean and no_room_below):
                device += seg.device.capacity
        return device

    def assert_budget_error_is_real(self, err: BudgetExceededError, name: str, bringing: bool = False) -> None:
        """`name`: the segment the call was about; the error must name it (not some victim that could not
        move). `bringing`: it was on its way up to the device."""
        assert err.what == name, err
        budget = self.config.device_budget if err.tier == "device" else self.config.host_budget
        assert err.budget == budget, err
        stuck = self.stuck_bytes(err.tier, name if bringing else None)
        # The arithmetic: what cannot leave + what was asked for must exceed the budget.
        assert stuck + charge(err.requested) > budget, (
            f"{err} raised, yet only {stuck} B of the {err.tier} budget {budget} B cannot leave "
            f"and {charge(err.requested)} B were requested"
        )

    def settle_moves(self) -> None:
        """Wait (outside the lock) for every move in flight; each must succeed."""
        while True:
            with self.mgr._lock:
                moves = [s.move for s in self.mgr.segments.values() if s.move is not None]
            if not moves:
                return
            for move in moves:
                move.wait(MOVE_TIMEOUT)

    def nvme_bytes(self, seg) -> torch.Tensor:
        fd = os.open(self.mgr.store.path, os.O_RDONLY)
        try:
            data = os.pread(fd, seg.nbytes, seg.extent.offset)
        finally:
            os.close(fd)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)

    # -- rules ---------------------------------------------------------------------------------------------

    @rule(data=st.data(), dtype=st.sampled_from(DTYPES), rows=st.integers(1, 2),
          cols=st.integers(1, 700), home_index=st.integers(0, 2), seed=st.integers(0, 2**31),
          zeros=st.booleans(), wait=st.booleans())
    def register(self, data, dtype, rows, cols, home_index, seed, zeros, wait):
        free = [n for n in NAMES if n not in self.expected]
        if free and data.draw(st.integers(0, 9), label="free") < 9:
            name = data.draw(st.sampled_from(free), label="name")
        else:
            name = data.draw(st.sampled_from(NAMES), label="name")
        homes = self.homes()
        home = homes[home_index % len(homes)]
        if name in self.expected:
            with pytest.raises(ValueError, match="already registered"):
                self.mgr.register(name, dtype=dtype, shape=(rows, cols), home=home)
            return
        nbytes = rows * cols * dtype.itemsize
        if zeros:
            values, raw = None, torch.zeros(nbytes, dtype=torch.uint8)
        else:
            raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
            values = raw.clone().view(dtype).view(rows, cols)
        try:
            handle = self.mgr.register(name, dtype=dtype, shape=(rows, cols), home=home, data=values)
        except BudgetExceededError as err:
            self.assert_budget_error_is_real(err, name)
            assert name not in self.mgr.segments
            return
        if wait:
            handle.wait(MOVE_TIMEOUT)
        self.expected[name] = raw
        self.home[name] = home
        self.pins[name] = 0
        self.pinned_tier[name] = None

    def pick(self, data) -> str:
        """A registered segment's name, or now and then any name (unknown names must raise KeyError)."""
        if data.draw(st.integers(0, 9), label="registered") < 9:
            return data.draw(st.sampled_from(sorted(self.expected)), label="name")
        return data.draw(st.sampled_from(NAMES), label="name")

    def unknown(self, name: str, call) -> bool:
        """For a name never registered (or unregistered): the call must raise KeyError naming it."""
        if name in self.expected:
            return False
        with pytest.raises(KeyError, match=name):
            call()
        return True

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), tier=st.sampled_from(["device", "host"]), blocking=st.booleans())
    def fetch(self, data, tier, blocking):
        self.fetch_one(self.pick(data), tier, blocking)

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), tier=st.sampled_from(["device", "host"]), seed=st.integers(0, 2**31))
    def fetch_write_release(self, data, tier, seed):
        """The common pattern: use a segment, change it, give it back."""
        name = self.pick(data)
        if self.fetch_one(name, tier, blocking=True):
            self.write_and_release(name, seed)

    def fetch_one(self, name: str, tier: str, blocking: bool) -> bool:
        """Fetch and check the bytes; False if the fetch had to fail (and did, the right way)."""
        if self.unknown(name, lambda: self.mgr.fetch(name, tier)):
            return False
        if TIER_ORDER[tier] < TIER_ORDER[self.home[name]]:
            with pytest.raises(IllegalTransitionError, match="expected state a tier at or above its home"):
                self.mgr.fetch(name, tier)
            return False
        if self.pins[name] and self.pinned_tier[name] != tier:
            with pytest.raises(IllegalTransitionError, match=f"actual pinned in {self.pinned_tier[name]}"):
                self.mgr.fetch(name, tier)
            return False
        if name in self.spent:
            with pytest.raises(IllegalTransitionError, match="actual discarded"):
                self.mgr.fetch(name, tier)
            return False
        try:
            if blocking:
                view = self.mgr.acquire(name, tier)
            else:
                self.mgr.fetch(name, tier).wait(MOVE_TIMEOUT)
                view = self.mgr.view(name)
        except BudgetExceededError as err:
            self.assert_budget_error_is_real(err, name, bringing=tier == "device")
            assert self.mgr.segments[name].pins == self.pins[name], "a failed fetch left a pin behind"
            return False
        self.pins[name] += 1
        self.pinned_tier[name] = tier
        assert view.device.type == ("cpu" if tier == "host" else self.mgr.device_tier.device.type)
        assert view.dtype == self.mgr.segments[name].dtype
        assert torch.equal(as_bytes(view).cpu(), self.expected[name]), f"{name}: fetched bytes differ"
        return True

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), tier=st.sampled_from(["device", "host"]), seed=st.integers(0, 2**31))
    def overwrite_and_release(self, data, tier, seed):
        """Fetch to overwrite (nothing is read: a discarded segment comes back this way), write, release."""
        name = self.pick(data)
        if self.unknown(name, lambda: self.mgr.fetch(name, tier, overwrite=True)):
            return
        if TIER_ORDER[tier] < TIER_ORDER[self.home[name]]:
            with pytest.raises(IllegalTransitionError, match="expected state a tier at or above its home"):
                self.mgr.fetch(name, tier, overwrite=True)
            return
        if self.pins[name]:
            with pytest.raises(IllegalTransitionError, match="pinned"):
                self.mgr.fetch(name, tier, overwrite=True)
            return
        try:
            self.mgr.acquire(name, tier, overwrite=True)
        except BudgetExceededError as err:
            self.assert_budget_error_is_real(err, name, bringing=tier == "device")
            assert self.mgr.segments[name].pins == 0, "a failed fetch left a pin behind"
            self.spent.add(name)  # the fetch declared its bytes dead, whether or not it found room
            return
        self.pins[name] += 1
        self.pinned_tier[name] = tier
        self.write_and_release(name, seed)

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def release_discard(self, data):
        name = data.draw(st.sampled_from(sorted(n for n, p in self.pins.items() if p)), label="name")
        self.mgr.release(name, discard=True)
        self.pins[name] -= 1
        if self.pins[name]:
            return
        self.pinned_tier[name] = None
        self.spent.add(name)
        seg = self.mgr.segments[name]
        if seg.state in (Residency.TO_HOST, Residency.DEVICE) and self.home[name] == "host":
            # A device copy whose home has no host buffer yet: moved down like any eviction, or, when host room
            # is only being made (a write under way), left for a later eviction: release never waits.
            return
        assert seg.state.tier == self.home[name], f"{name} discarded but {seg.state}"
        assert (seg.device is None or self.home[name] == "device") and (seg.host is None or self.home[name] != "nvme")

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data(), seed=st.integers(0, 2**31))
    def write_and_release_dirty(self, data, seed):
        self.write_and_release(data.draw(st.sampled_from(sorted(n for n, p in self.pins.items() if p)), label="name"), seed)

    def write_and_release(self, name: str, seed: int) -> None:
        view = self.mgr.view(name)
        new = torch.randint(0, 256, (self.nbytes(name),), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(seed))
        as_bytes(view).copy_(new.to(view.device))
        self.expected[name] = new
        self.spent.discard(name)
        self.mgr.release(name, dirty=True)
        self.pins[name] -= 1
        if not self.pins[name]:
            self.pinned_tier[name] = None

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def release_clean(self, data):
        pinned = sorted(n for n, p in self.pins.items() if p)
        name = data.draw(st.sampled_from(pinned), label="name") if pinned and data.draw(st.booleans()) else self.pick(data)
        if self.unknown(name, lambda: self.mgr.release(name)):
            return
        if not self.pins[name]:
            with pytest.raises(IllegalTransitionError, match="expected state pinned"):
                self.mgr.release(name)
            with pytest.raises(IllegalTransitionError, match="expected state pinned and settled"):
                self.mgr.view(name)
            return
        self.mgr.release(name)
        self.pins[name] -= 1
        if not self.pins[name]:
            self.pinned_tier[name] = None

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), count=st.integers(1, 4), tier=st.sampled_from(["device", "host"]), wait=st.booleans())
    def prefetch(self, data, count, tier, wait):
        names = [self.pick(data) for _ in range(count)]
        missing = [n for n in names if n not in self.expected]
        if missing:
            with pytest.raises(KeyError, match=missing[0]):
                self.mgr.prefetch(names, tier)
            return
        illegal = [n for n in names if TIER_ORDER[tier] < TIER_ORDER[self.home[n]]
                   or (self.pins[n] and self.pinned_tier[n] != tier)]
        if illegal:
            with pytest.raises(IllegalTransitionError, match=repr(illegal[0])):
                self.mgr.prefetch(names, tier)
            return
        handle = self.mgr.prefetch(names, tier)
        if wait:
            handle.wait(MOVE_TIMEOUT)

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def evict(self, data):
        name = self.pick(data)
        if self.unknown(name, lambda: self.mgr.evict(name)):
            return
        if self.pins[name]:
            with pytest.raises(IllegalTransitionError, match="expected state unpinned"):
                self.mgr.evict(name)
            return
        try:
            self.mgr.evict(name).wait(MOVE_TIMEOUT)
        except BudgetExceededError as err:
            self.assert_budget_error_is_real(err, name)
            return
        seg = self.mgr.segments[name]
        # Home, unless the prefetch that a finished write-back resumes is already bringing it back.
        assert seg.state.tier == self.home[name] or seg.state.moving or seg.prefetched, f"{name} not home: {seg.state}"

    @precondition(lambda self: len(self.expected) >= 3)  # keep a population to move around
    @rule(data=st.data())
    def unregister(self, data):
        name = self.pick(data)
        if self.unknown(name, lambda: self.mgr.unregister(name)):
            return
        if self.pins[name]:
            with pytest.raises(IllegalTransitionError, match="expected state unpinned"):
                self.mgr.unregister(name)
            return
        self.mgr.unregister(name)
        for table in (self.expected, self.home, self.pins, self.pinned_tier):
            del table[name]
        self.spent.discard(name)
        assert name not in self.mgr.segments

    @rule()
    def end_step(self):
        self.mgr.end_step()

    @rule()
    def settle(self):
        """Let every move in flight land (other rules run while moves are still under way)."""
        self.settle_moves()

    # -- checked after every step ---------------------------------------------------------------------------

    @invariant()
    def budgets_hold(self):
        if self.mgr is None:
            return
        device, pool, peaks = self.mgr.device_tier, self.mgr.pool, self.mgr.stats.peak_bytes
        host_budget, device_budget = self.config.host_budget, self.config.device_budget
        assert 0 <= device.in_use <= device_budget and device.peak <= device_budget
        assert 0 <= pool.in_use <= pool.held <= host_budget and pool.peak_in_use <= host_budget
        assert peaks["device"] <= device_budget and peaks["host"] <= host_budget

    @invariant()
    def every_byte_is_where_the_manager_says(self):
        if self.mgr is None:
            return
        with self.mgr._lock:
            segments = self.mgr.segments
            assert set(segments) == set(self.expected)
            host_total = device_total = 0
            for name, seg in segments.items():
                assert seg.pins == self.pins[name]
                if seg.host is not None:
                    host_total += seg.host.capacity
                if seg.device is not None:
                    device_total += seg.device.capacity
                assert (seg.move is not None) == seg.state.moving, (name, seg.state, seg.move)
                if seg.state.moving:
                    continue  # its bytes are checked once it lands
                if seg.pins:
                    assert seg.pinned_tier == self.pinned_tier[name] == seg.state.tier
                assert seg.spent == (name in self.spent)
                if seg.spent:
                    continue  # no bytes to hold
                want = self.expected[name]
                if seg.state == Residency.DEVICE:
                    assert seg.device is not None
                    assert torch.equal(seg.storage("device").cpu(), want), f"{name}: device copy differs"
                if seg.state == Residency.HOST:
                    assert seg.device is None and seg.host is not None and seg.host_current
                if seg.state == Residency.NVME:
                    assert seg.device is None and seg.host is None and seg.nvme_current
                if seg.host_current:
                    assert torch.equal(seg.storage("host"), want), f"{name}: host copy differs"
                if seg.nvme_current:
                    assert torch.equal(self.nvme_bytes(seg), want), f"{name}: nvme copy differs"
                assert TIER_ORDER[seg.state.tier] >= TIER_ORDER[seg.home]
            assert host_total == self.mgr.pool.in_use, "host buffers leaked or double counted"
            assert device_total == self.mgr.device_tier.in_use, "device buffers leaked or double counted"


SETTINGS = settings(max_examples=40, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
                    # Shrinking a failure here can take hypothesis' full five minutes per class on a shared
                    # machine; the labelled draws make an unshrunk sequence readable. Add Phase.shrink to debug.
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])


class NoNvme(SwapMachine):
    nvme_engine = None


class NvmeThreads(SwapMachine):
    nvme_engine = "threads"


class NvmeLibaio(SwapMachine):
    nvme_engine = "libaio"


TestSwapNoNvme = NoNvme.TestCase
TestSwapNoNvme.settings = SETTINGS
TestSwapNvmeThreads = NvmeThreads.TestCase
TestSwapNvmeThreads.settings = SETTINGS
TestSwapNvmeLibaio = NvmeLibaio.TestCase
TestSwapNvmeLibaio.settings = SETTINGS
