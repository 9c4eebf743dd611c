"""The root unit parked between its uses (zero/params/root_uses.py, zero_tiering.park_root): while the blocks run,
forward and backward, the root's full buffer holds no bytes; the head and a module that reads its weight in its
backward find it gathered; the bits are plain PyTorch's. A root parameter read inside a block gathers it again and
ends parking. The device peak and the least budget fall by the root's bytes; by default the root is parked only
where the device budget is below what holding it takes (test_stage3_memory.py: the peaks held)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zero

from stage3_models import (VOCAB, batches, engine_train, full_state, one_thread, own_gpt, reference_train,
                           stage3_config, tiny_gpt2, tiny_llama)
from test_stage3_memory import PEAK_CONFIG, measure_device_peak, train_recording_peaks, unit_bytes
from test_tied_head import TiedToy


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


class Parks:
    """Counts the root's parks and unparks, and notes, as each block's forward and backward begin and as the head's
    forward begins, whether every root unit is parked."""

    def __init__(self, engine, blocks: list[nn.Module], head: nn.Module):
        uses = engine.placement._root_uses
        self.roots = uses.roots
        self.parks = self.unparks = 0
        park, unpark = uses.park, uses.unpark

        def counted_park(unit):
            self.parks += 1
            park(unit)

        def counted_unpark(unit):
            self.unparks += 1
            unpark(unit)

        uses.park, uses.unpark = counted_park, counted_unpark
        self.seen: list[tuple[str, bool]] = []
        for block in blocks:  # registered after the engine's hooks: they run after them
            block.register_forward_pre_hook(lambda m, args: self.note("block forward"))
            block.register_forward_hook(lambda m, args, out: self._on_grad(out))
        head.register_forward_pre_hook(lambda m, args: self.note("head forward"))

    def note(self, where: str) -> None:
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1 or where == "block backward":
            self.seen.append((where, all(u.parked for u in self.roots)))

    def _on_grad(self, out) -> None:
        out = out[0] if isinstance(out, tuple) else out
        if out.requires_grad and torch._C._current_graph_task_id() == -1:
            out.register_hook(lambda grad: self.note("block backward"))


def train_both(make, tmp_path, *, tier="nvme", accum=2, clip=1.0, steps=3):
    """Plain PyTorch's run of `make()` (its losses, the model after), and an engine for another `make()`."""
    data = batches(steps * accum)
    reference, model = make(), make()
    expected = reference_train(reference, data, accum=accum, clip=clip)
    engine, *_ = zero.initialize(model=model, config=stage3_config(tier, tier, nvme_path=tmp_path, accum=accum,
                                                                   clip=clip, zero_tiering={"park_root": True}))
    return engine, data, reference, expected


def blocks_and_head(model):
    if hasattr(model, "blocks"):
        return list(model.blocks), (model.lm_head if hasattr(model, "lm_head") else model.head)
    inner = model.transformer if hasattr(model, "transformer") else model.model
    return list(inner.h if hasattr(inner, "h") else inner.layers), model.lm_head


@pytest.mark.parametrize("name", ["tied toy", "lead linear", "main job gpt", "gpt2", "llama"])
def test_the_root_is_parked_while_the_blocks_run_and_trains_as_plain_pytorch(name, tmp_path):
    """Three steps of accumulation 2 with clipping, ZeRO-3 on nvme: every block's forward and backward begins with
    the root parked, the head's forward with it gathered; losses and weights the same bits as plain PyTorch's
    (a lead Linear: the root gathered again for its backward, which reads its weight)."""
    make = {"tied toy": TiedToy, "lead linear": lambda: TiedToy("one-hot"), "main job gpt": own_gpt,
            "gpt2": tiny_gpt2, "llama": tiny_llama}[name]
    engine, data, reference, expected = train_both(make, tmp_path)
    try:
        parks = Parks(engine, *blocks_and_head(engine.module))
        assert engine_train(engine, data) == expected
        state = full_state(engine)
        for key, value in reference.state_dict().items():
            assert torch.equal(state[key], value), key
        assert parks.parks > 0 and all(parked == (where != "head forward") for where, parked in parks.seen), parks.seen
        assert {where for where, _ in parks.seen} == {"block forward", "block backward", "head forward"}
        # a lead Linear's backward reads its weight: gathered for it (one more unpark a micro-batch)
        assert parks.unparks == len(data) * (2 if name == "lead linear" else 1)
        assert all(not u.parked and not u.gathered for u in parks.roots)
    finally:
        engine.close()


def test_an_embedding_adapter_reading_its_parameter_dict_in_its_backward_finds_the_root_gathered(tmp_path):
    """PEFT's LoRA on the embedding: its adapters live in ParameterDicts that the adapter's module reads (the second
    one in its backward, a matmul, before the blocks): that module counts as their holder, so the root parked while
    the blocks run is gathered again for its backward. The bits are plain PyTorch's."""
    from test_frozen import lora_on, trainable

    data = batches(4)
    reference = lora_on(tiny_llama(), everywhere=True)
    expected = reference_train(reference, data, accum=2, clip=1.0)
    model = lora_on(tiny_llama(), everywhere=True)
    engine, *_ = zero.initialize(model=model, config=stage3_config(
        "cpu", "cpu", accum=2, clip=1.0, zero_tiering={"park_root": True}), model_parameters=trainable(model))
    try:
        assert engine.placement._root_uses.enabled
        assert engine_train(engine, data) == expected
        state = full_state(engine)
        for key, value in reference.state_dict().items():
            assert torch.equal(state[key], value), key
    finally:
        engine.close()


class ReadsTheEmbedding(nn.Module):
    """A block scaling its output by a row of the embedding's weight (a root parameter) through a closure."""

    def __init__(self, dim: int, row_of):
        super().__init__()
        self.row_of = row_of
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(x)) * self.row_of()


class RootReadInBlocks(nn.Module):
    def __init__(self, dim: int = 32, layers: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(ReadsTheEmbedding(dim, lambda: self.embed.weight[0]) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, idx, targets):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.reshape(-1))


class BorrowingHead(nn.Module):
    """A head with a bias of its own that reads the embedding's weight through a closure."""

    def __init__(self, weight_of):
        super().__init__()
        self.weight_of = weight_of
        self.bias = nn.Parameter(torch.zeros(VOCAB))

    def forward(self, x):
        return x @ self.weight_of().t() + self.bias


class RootReadInTheHead(RootReadInBlocks):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
        self.head = BorrowingHead(lambda: self.embed.weight)


@pytest.mark.parametrize("make", [RootReadInBlocks, RootReadInTheHead], ids=["in a block", "in another's module"])
def test_a_root_parameter_read_outside_its_module_gathers_it_again_and_ends_parking(make, tmp_path):
    engine, data, reference, expected = train_both(make, tmp_path, tier="cpu")
    try:
        uses = engine.placement._root_uses
        assert uses.enabled
        assert engine_train(engine, data) == expected
        assert not uses.enabled and not uses.watching
        state = full_state(engine)
        for key, value in reference.state_dict().items():
            assert torch.equal(state[key], value), key
    finally:
        engine.close()


class OwnsAParameter(TiedToy):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, idx, targets):
        return super().forward(idx, targets) * self.scale


def test_a_model_holding_root_parameters_itself_is_never_parked(tmp_path):
    """The model's own forward may read its parameter anywhere: the root stays gathered (park_root true or not),
    and trains as before."""
    engine, data, reference, expected = train_both(OwnsAParameter, tmp_path, tier="cpu", steps=2)
    try:
        assert not engine.placement._root_uses.enabled
        assert engine_train(engine, data) == expected
    finally:
        engine.close()


TIED = VOCAB * 64 * 4
"""The tied embedding's head gradient in PEAK_CONFIG's GPT (it waits on the host: tied_head.py)."""


def test_parked_the_device_peak_is_a_block_and_the_gradients(tmp_path):
    """test_stage3_memory's peaks less the root's weights: in a block's backward the block, its gradients and the
    root's but the tied head's part, and the next block prefetched: 32,768 + 3 x 200,704 - 24,576 = 610,304 bytes."""
    engine, *_ = zero.initialize(model=own_gpt(0, None, PEAK_CONFIG), config=stage3_config(
        "nvme", "cpu", nvme_path=tmp_path, accum=2, zero_tiering={"park_root": True}))
    try:
        root, block, _ = unit_bytes(engine)
        baseline, peaks = measure_device_peak(engine, 6)
        assert baseline == 0
        assert peaks == [root + 3 * block - TIED] * 6, (peaks, root, block)
    finally:
        engine.close()


def test_a_budget_below_holding_the_root_parks_it_and_the_parked_minimum_is_enough(tmp_path):
    """The root held, a block's backward needs 442,368 bytes above the scratch (2 x 200,704): at that budget the
    root is held (park_root null); a page under it, parked. The least budget parked is 409,600 above the scratch: a
    run there completes its steps, the peak at the budget, and trains as plain PyTorch; a page under it is refused,
    naming the parked minimum's parts."""
    scratch, held, parked = 401_408, 442_368, 409_600
    data = batches(4)
    expected = reference_train(own_gpt(0, None, PEAK_CONFIG), data)
    for budget, parks in ((scratch + held, False), (scratch + held - 4096, True), (scratch + parked, True)):
        engine, *_ = zero.initialize(model=own_gpt(0, None, PEAK_CONFIG), config=stage3_config(
            "cpu", "cpu", zero_tiering={"device_budget": budget}))
        try:
            assert engine.placement._root_uses.enabled == parks, budget
            assert sum(engine.device_minimum.values()) == scratch + (parked if parks else held)
            losses, peaks = train_recording_peaks(engine, data)
            assert losses == expected and max(peaks) <= budget, peaks
            if budget == scratch + parked:
                assert max(peaks) == budget
        finally:
            engine.close()
    with pytest.raises(zero.config.ConfigError, match=r"gathered units 196.0 KiB, unit gradients 204.0 KiB"):
        zero.initialize(model=own_gpt(0, None, PEAK_CONFIG), config=stage3_config(
            "cpu", "cpu", zero_tiering={"device_budget": scratch + parked - 4096}))


@pytest.mark.parametrize("name", ["main job gpt", "llama"])
def test_unit_major_steps_with_the_root_parked_are_the_held_roots_bits(name, tmp_path):
    """engine.train_batch (the unit-major schedule), accumulation 4, clipping, ZeRO-3 on nvme: the root parked while
    the blocks run their slices gives the losses and weights of the root held, bit for bit."""
    from test_unit_major import micro_batch

    make = {"main job gpt": own_gpt, "llama": tiny_llama}[name]
    data = batches(8)
    runs = []
    for park in (False, True):
        model = make()
        (tmp_path / str(park)).mkdir()
        engine, *_ = zero.initialize(model=model, config=stage3_config(
            "nvme", "nvme", nvme_path=tmp_path / str(park), accum=4, clip=1.0, zero_tiering={"park_root": park}))
        try:
            uses = engine.placement._root_uses
            parks = Parks(engine, *blocks_and_head(engine.module)) if park else None
            losses = [engine.train_batch([micro_batch(model, ids) for ids in data[i:i + 4]]).item()
                      for i in (0, 4)]
            assert engine.schedule == "unit-major"
            runs.append((losses, full_state(engine)))
            if park:
                assert uses.enabled and parks.parks > 0
        finally:
            engine.close()
    (held_losses, held), (losses, parked) = runs
    assert losses == held_losses
    for key, value in held.items():
        assert torch.equal(parked[key], value), key
