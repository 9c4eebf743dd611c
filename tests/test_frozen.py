"""Frozen parameters (an adapter's base) under ZeRO-3: partitioned into units of their own, stored once in their home
tier, gathered and released clean, never written back.

PEFT's LoRA on a small Llama and on GPT-2 trains bit for bit as the same PEFT model in plain PyTorch with torch
AdamW (fp32, accumulation 2, clipping on), the base on nvme and on cpu, one rank and two; the base's stored bytes
are the same before and after training, and the swap manager wrote none of them after registering them.
Checkpoints with and without the frozen parameters: test_frozen_checkpoints.py.
"""
from __future__ import annotations

import os
import re
import time

import peft
import pytest
import torch
import torch.multiprocessing as mp
import xxhash

import zero as deepspeed
from tiering import BudgetExceededError
from zero.config import ConfigError
from zero.params import int8_weights
from zero.params.full_bytes import take_bytes
from zero.params.unit import UnitState

from stage3_models import (
    assert_state_equal, batches, engine_train, free_port, full_state, one_thread, reference_train,  # noqa: F401
    stage3_config, tiny_gpt2, tiny_llama, units_held)

ACCUM, CLIP = 2, 1.0
TARGETS = {"llama": (tiny_llama, ["q_proj", "v_proj"]), "gpt2": (tiny_gpt2, ["c_attn"]),
           "llama-head": (tiny_llama, ["q_proj", "v_proj", "lm_head"]), "gpt2-head": (tiny_gpt2, ["c_attn", "lm_head"])}


def lora(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    build, targets = TARGETS[name]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                             fan_in_fan_out=name.startswith("gpt2"))
    return peft.get_peft_model(build(seed, **overrides), config)


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def stored(engine) -> dict[str, bytes]:
    """Each frozen segment's bytes where it rests (read from the nvme file, or the host buffer), hashed."""
    out = {}
    for unit in engine.units:
        if not unit.frozen:
            continue
        seg = engine.swap.segments[unit.segment]
        if seg.home == "nvme":
            with open(engine.swap.store.path_of(seg.extent), "rb") as f:
                f.seek(seg.extent.offset)
                data = f.read(seg.nbytes)
        else:
            data = seg.host.storage.view(torch.uint8)[: seg.nbytes].numpy().tobytes()
        out[unit.name] = xxhash.xxh3_64_hexdigest(data)
    return out


def frozen_writes(engine) -> int:
    return sum(n for name, n in engine.swap.stats.segment_bytes["host->nvme"].items() if "#frozen" in name)


@pytest.mark.parametrize("home", ["nvme", "cpu"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_lora_trains_as_plain_pytorch_and_the_base_is_never_written(name, home, tmp_path):
    data = batches(3 * ACCUM)
    with one_thread():
        reference = lora(name)
        expected_losses = reference_train(reference, data, accum=ACCUM, clip=CLIP)
        model = lora(name)
        config = stage3_config(home, home, nvme_path=tmp_path, accum=ACCUM, clip=CLIP)
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=trainable(model))
        try:
            frozen = [u for u in engine.units if u.frozen]
            assert frozen and all(not u.sub_groups for u in frozen)  # a base in units, without optimizer state
            assert {s.name for u in frozen for s in u.flat.slots} == {
                n for n, p in model.named_parameters() if not p.requires_grad}
            before, written = stored(engine), frozen_writes(engine)
            losses = engine_train(engine, data)
            assert frozen_writes(engine) == written  # registered once; not a byte since
            assert stored(engine) == before
            assert units_held(engine) == []
            assert losses == expected_losses
            assert_state_equal(full_state(engine), {k: v.detach().clone() for k, v in reference.state_dict().items()})
        finally:
            engine.close()


@pytest.mark.parametrize("frozen_units", ["layer", "block"])
@pytest.mark.parametrize("name", ["llama-head", "gpt2-head"])
def test_lora_on_the_head_keeps_the_roots_base_until_the_backward_ends(name, frozen_units):
    """The head's adapter is in the root unit and gets its gradient first; the head's frozen base still passes
    gradients on to the blocks' adapters after it (GPT-2's is the tied embedding): freed then, a crash."""
    data = batches(2)
    with one_thread():
        reference = lora(name)
        expected_losses = reference_train(reference, data)
        model = lora(name)
        config = stage3_config("cpu", "cpu", zero_tiering={"frozen_units": frozen_units})
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=trainable(model))
        try:
            assert engine_train(engine, data) == expected_losses
            assert_state_equal(full_state(engine), {k: v.detach().clone() for k, v in reference.state_dict().items()})
            assert units_held(engine) == []
        finally:
            engine.close()


def test_the_base_is_cut_layer_by_layer_and_a_step_fills_no_frozen_unit_again(tmp_path):
    """One frozen unit per layer holding only frozen weights (each LoRA layer's base Linear, each other Linear and
    norm), following that layer; the norms, under the persistence threshold, stay gathered, and the optimizer step
    (serial: clipping on), which never writes a frozen shard, fills none of them again. Still plain PyTorch's bits."""
    data = batches(2)
    with one_thread():
        reference = lora("llama")
        expected = reference_train(reference, data, clip=CLIP)
        model = lora("llama")
        config = stage3_config("nvme", "nvme", nvme_path=tmp_path, clip=CLIP, persistence=64)
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=trainable(model))
        try:
            frozen = [u for u in engine.units if u.frozen]
            held = {id(p): [] for p in model.parameters() if not p.requires_grad}
            for name, module in model.named_modules():
                for p in module._parameters.values():
                    if p is not None and id(p) in held:
                        held[id(p)].append(name)
            alone = {names[0] for names in held.values() if len(names) == 1}
            assert sorted(u.name.removesuffix("#frozen") for u in frozen if u.name != "#frozen") == sorted(alone)
            assert all(u.module is dict(model.named_modules())[u.name.removesuffix("#frozen")]
                       for u in frozen if u.name != "#frozen")
            norms = [u for u in frozen if u.persistent]
            assert norms and all("norm" in u.name for u in norms)
            fills = []
            start_fill = engine.placement._start_fill
            engine.placement._start_fill = lambda unit: fills.append(unit) or start_fill(unit)
            losses = []
            for ids in data:
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                before = len(fills)
                engine.step()
                assert not [u.name for u in fills[before:] if u.frozen]
                losses.append(loss.item())
            assert losses == expected
        finally:
            engine.close()


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_first_step_reads_each_layer_of_a_lora_base_ahead(name, tmp_path):
    """The first step has no order seen yet, and guesses. Its backward guesses from the order the forward's modules
    ended in, so every unit it gathers after its first was prefetched. Its forward guesses the next unit in the
    list, a block's frozen layers in the order the block defines them: GPT-2 calls them in that order (every layer
    from the first block on is prefetched); Llama defines its norms after the projections it calls them before
    (those guesses are wrong, and dropped). Still plain PyTorch's bits."""
    data = batches(1)
    with one_thread():
        expected = reference_train(lora(name), data)
        model = lora(name)
        engine, *_ = deepspeed.initialize(model=model, config=stage3_config("nvme", "cpu", nvme_path=tmp_path),
                                          model_parameters=trainable(model))
        placement, seen = engine.placement, []
        gather = placement.gather

        def recording(unit):
            seen.append((torch._C._current_graph_task_id() != -1, unit.name, unit.state))
            gather(unit)

        placement.gather = recording
        try:
            losses = engine_train(engine, data)
            backward = [(unit, state) for in_backward, unit, state in seen if in_backward]
            assert sum("#frozen" in unit for unit, _ in backward) > 4
            assert [unit for unit, state in backward[1:] if state is not UnitState.PREFETCHED] == []
            if name == "gpt2":
                layers = [(unit, state) for in_backward, unit, state in seen if not in_backward and ".h." in unit]
                assert [unit for unit, state in layers[1:] if state is not UnitState.PREFETCHED] == []
            assert losses == expected
        finally:
            placement.gather = gather
            engine.close()


class _FusedReadBlock(torch.nn.Module):
    """A block whose forward reads its frozen layers' weights itself (fused into one matrix), never calling them."""

    def __init__(self, width: int):
        super().__init__()
        self.q, self.k = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
        self.adapter = torch.nn.Linear(width, width, bias=False)
        self.q.requires_grad_(False)
        self.k.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = torch.cat([self.q.weight, self.k.weight])
        q, k = torch.nn.functional.linear(x, fused).chunk(2, dim=-1)
        return x + torch.tanh(q * k) + self.adapter(x)


class _FusedReadModel(torch.nn.Module):
    def __init__(self, seed: int, width: int = 32, vocab: int = 96):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(_FusedReadBlock(width) for _ in range(2))
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_frozen_units_by_block_serve_a_block_that_reads_its_layers_weights_itself(tmp_path):
    """`zero_tiering.frozen_units: "block"`: a block whose own forward reads its frozen layers' weights (not through
    their forwards) trains as plain PyTorch, bit for bit; cut layer by layer ("layer", the default) those weights
    are released where the block reads them, as DeepSpeed's per-submodule fetch would leave them."""
    data = batches(2)
    with one_thread():
        expected = reference_train(_FusedReadModel(0), data)
        model = _FusedReadModel(0)
        config = stage3_config("nvme", "nvme", nvme_path=tmp_path, zero_tiering={"frozen_units": "block"})
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=trainable(model))
        try:
            assert [u.name for u in engine.units if u.frozen] == ["blocks.0#frozen", "blocks.1#frozen"]
            assert engine_train(engine, data) == expected
        finally:
            engine.close()
        model = _FusedReadModel(0)
        engine, *_ = deepspeed.initialize(model=model, config=stage3_config("nvme", "nvme", nvme_path=tmp_path),
                                          model_parameters=trainable(model))
        try:
            assert {u.name for u in engine.units if u.frozen} == {f"blocks.{i}.{layer}#frozen" for i in (0, 1)
                                                                  for layer in "qk"}
            with pytest.raises(RuntimeError):
                engine_train(engine, data)
        finally:
            engine.close()


@pytest.mark.parametrize("checkpointing", ["nonreentrant", "reentrant"])
def test_a_frozen_unit_is_released_as_its_modules_backward_ends(checkpointing, tmp_path):
    """Six layers, gradient checkpointing either way: at no time are two blocks' units gathered at once (the frozen
    unit of a block goes when its inputs' gradients are computed, not at the backward's end), and the run is still
    plain PyTorch's bit for bit."""
    data = batches(2)
    with one_thread():
        reference = lora("llama", num_hidden_layers=6)
        expected = reference_train(reference, data)
        base = tiny_llama(0, num_hidden_layers=6)
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                          lora_dropout=0.0))
        model.enable_input_require_grads()
        engine, *_ = deepspeed.initialize(model=model, config=stage3_config("nvme", "nvme", nvme_path=tmp_path),
                                          model_parameters=trainable(model))
        placement, most = engine.placement, [0]
        gather = placement.gather

        def counting(unit):
            gather(unit)
            blocks = {id(u.block) for u in placement.units if u.gathered}
            most[0] = max(most[0], len(blocks - {id(engine.module)}))

        placement.gather = counting
        try:
            assert engine_train(engine, data) == expected
            assert most[0] == 1
            assert units_held(engine) == []
        finally:
            engine.close()


def test_unit_major_accumulation_runs_frozen_units_too(tmp_path):
    data = batches(2 * ACCUM)
    with one_thread():
        reference = lora("llama")
        expected = reference_train(reference, data, accum=ACCUM, clip=CLIP)
        model = lora("llama")
        engine, *_ = deepspeed.initialize(model=model, config=stage3_config("nvme", "nvme", nvme_path=tmp_path,
                                                                            accum=ACCUM, clip=CLIP),
                                          model_parameters=trainable(model))
        try:
            losses = [engine.train_batch(iter({"input_ids": ids, "labels": ids} for ids in data[i:i + ACCUM])).item()
                      for i in range(0, len(data), ACCUM)]
            assert engine.schedule == "unit-major"
            # The step's loss is the mean of its micro-batches' (within rounding: one batch, not two).
            assert losses == pytest.approx([sum(expected[i:i + ACCUM]) / ACCUM for i in range(0, len(data), ACCUM)],
                                           rel=1e-6)
            assert_state_equal(full_state(engine), {k: v.detach().clone() for k, v in reference.state_dict().items()},
                               exact=False, rtol=1e-6, atol=1e-7)
        finally:
            engine.close()


def lora_on(base: torch.nn.Module, *, everywhere: bool = False) -> torch.nn.Module:
    """Adapters on the attention's linears; `everywhere`: on the embedding too (parameters in a ParameterDict), and
    the head trained as a copy (modules_to_save)."""
    extra = {"modules_to_save": ["lm_head"], "target_modules": ["q_proj", "v_proj", "embed_tokens"]} if everywhere \
        else {"target_modules": ["q_proj", "v_proj"]}
    return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **extra))


@pytest.mark.parametrize("route", ["zero.Init", "pretrained"])
def test_lora_on_a_base_never_whole_in_memory_starts_as_its_base(route, tmp_path):
    """The base built under zero.Init, or on meta and read from a safetensors checkpoint (`weights=`), PEFT applied
    to it there: PEFT left the adapters on meta (the base's device), so they are initialized again as PEFT does (B
    zero): the first loss is the base's own, bit for bit, and the adapters train."""
    config = stage3_config("nvme", "nvme", nvme_path=tmp_path)
    ids = batches(1)[0]
    with one_thread():
        plain = tiny_llama(0)
        with torch.no_grad():
            base_loss = plain(input_ids=ids, labels=ids).loss.item()
        weights = None
        if route == "zero.Init":
            with deepspeed.zero.Init(config_dict_or_path=config):
                base = tiny_llama(0)
        else:
            plain.save_pretrained(tmp_path / "base")
            weights = tmp_path / "base"
            with torch.device("meta"):
                base = tiny_llama(0)
        model = lora_on(base, everywhere=True)
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=trainable(model),
                                          weights=weights)
        try:
            assert all(u.frozen for u in engine.units if "#frozen" in u.name) and any(u.frozen for u in engine.units)
            state = full_state(engine)
            assert all(not v.any() for k, v in state.items() if "lora_B" in k or "lora_embedding_A" in k)
            assert all(v.any() for k, v in state.items() if "lora_A" in k or "lora_embedding_B" in k)
            head = "base_model.model.lm_head."
            assert torch.equal(state[head + "modules_to_save.default.weight"], state[head + "original_module.weight"])
            losses = engine_train(engine, [ids] * 4)
            assert losses[0] == base_loss and losses[-1] < losses[0]
            assert all(v.any() for k, v in full_state(engine).items() if "lora_embedding_A" in k)  # it trains
        finally:
            engine.close()


def test_every_adapter_of_an_embedding_is_initialized_on_a_base_under_zero_init(tmp_path):
    """An embedding's LoRA parameters of every adapter live in one ParameterDict: each adapter is initialized as PEFT
    does (A zero, B drawn), not the last one alone with the others left as whatever the memory held."""
    config = stage3_config("cpu", "cpu")
    with one_thread():
        with deepspeed.zero.Init(config_dict_or_path=config):
            base = tiny_llama(0)
        lora_config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["embed_tokens"])
        model = peft.get_peft_model(base, lora_config)
        model.add_adapter("second", lora_config)
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=trainable(model))
        try:
            state = full_state(engine)
            for adapter in ("default", "second"):
                a, b = (state[f"base_model.model.model.embed_tokens.lora_embedding_{x}.{adapter}"] for x in "AB")
                assert not a.any() and b.isfinite().all() and 0.1 < b.std() < 10, adapter
        finally:
            engine.close()


def as_stored_int8(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with its frozen weights as the engine's int8 units decode them."""
    from zero.comm import DataParallel
    from zero.initialize import plan_units

    params = dict(model.named_parameters())
    for flat, _ in plan_units(model, [{"params": trainable(model)}], DataParallel(), frozen="layer"):
        if flat.frozen:
            int8_weights.round_trip(flat, params)
    return model


@pytest.mark.parametrize("home", ["nvme", "cpu"])
def test_int8_frozen_weights_are_a_quarter_of_fp32s_bytes_and_decode_as_stored(home, tmp_path):
    """zero_quantized_nontrainable_weights: a frozen unit's shard rests as block-wise int8 (a scale per 256 elements,
    a byte per element), is never written, and the model computes exactly what plain PyTorch computes with the same
    weights through int8 and back; the adapters train."""
    ids = batches(1)[0]
    with one_thread():
        model = lora("llama")
        config = stage3_config(home, home, nvme_path=tmp_path, zero_quantized_nontrainable_weights=True)
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=trainable(model))
        try:
            frozen = [u for u in engine.units if u.frozen]
            for unit in frozen:
                segment = engine.swap.segments[unit.segment]
                assert segment.dtype == torch.uint8
                assert segment.nbytes == int8_weights.stored_numel(unit.flat.shard_numel) < unit.flat.shard_numel * 2
            reference = as_stored_int8(lora("llama")).eval()
            engine.eval()
            with torch.no_grad():
                assert torch.equal(engine(input_ids=ids).logits, reference(input_ids=ids).logits)
            engine.train()
            written = frozen_writes(engine)
            losses = engine_train(engine, [ids] * 4)
            assert frozen_writes(engine) == written and losses[-1] < losses[0]
        finally:
            engine.close()


def test_an_int8_unit_without_room_for_its_staging_holds_nothing(tmp_path):
    """A gather (or a prefetch, which then gives up) of an int8 frozen unit whose full buffer fits the device
    budget's free room but not beside its staging: BudgetExceededError, and the full buffer's room and bytes given
    back, so the device tier holds what it held before."""
    model = lora("llama")
    config = stage3_config("cpu", "cpu", zero_quantized_nontrainable_weights=True)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=trainable(model))
    try:
        unit = next(u for u in engine.units if u.frozen)
        tier = engine.swap.device_tier
        # the full buffer fits, its staging does not
        budget, tier.budget = tier.budget, tier.in_use + tier.charge(unit.nbytes) + 1
        held = tier.in_use
        with pytest.raises(BudgetExceededError, match="int8"):
            take_bytes(engine.swap, unit)
        assert tier.in_use == held and unit.lent is None and unit.staging is None
        assert unit.full.untyped_storage().nbytes() == 0
    finally:
        tier.budget = budget
        engine.close()


def test_int8_round_trip_is_within_half_a_step_of_each_blocks_scale():
    values = torch.cat([torch.randn(1000) * 0.02, torch.zeros(300), torch.tensor([5.0, -5.0])])
    stored = int8_weights.encode(values, torch.empty(int8_weights.stored_numel(values.numel()), dtype=torch.uint8))
    back = int8_weights.decode(stored, values.numel(), torch.empty(values.numel()))
    for start in range(0, values.numel(), int8_weights.BLOCK):
        block, got = values[start:start + 256], back[start:start + 256]
        step = block.abs().max() / int8_weights.LEVELS
        assert (got - block).abs().max() <= step / 2 * (1 + 1e-6)
    assert torch.equal(back[1000:1300], torch.zeros(300))


# -- two ranks --------------------------------------------------------------------------------------------------

WORLD = 2


def _worker(rank: int, port: int, root: str, name: str, int8: bool) -> None:
    os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    data = [ids[rank:rank + 1] for ids in batches(3 * ACCUM)]  # each rank its own row of every batch
    path = os.path.join(root, f"rank{rank}")
    os.makedirs(path, exist_ok=True)
    model = lora(name)
    config = stage3_config("nvme", "nvme", nvme_path=path, accum=ACCUM, clip=CLIP, micro=1,
                           zero_quantized_nontrainable_weights=int8)
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=trainable(model))
    before, written = stored(engine), frozen_writes(engine)
    losses = engine_train(engine, data)
    result = {"losses": losses, "state": full_state(engine), "unchanged": stored(engine) == before,
              "writes": frozen_writes(engine) - written}
    engine.close()
    torch.save(result, os.path.join(root, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def two_rank_reference(name: str, int8: bool) -> tuple[list[list[float]], dict]:
    """What two data-parallel ranks compute, in plain PyTorch: per micro-batch each rank's row through its own
    replica, the gradients averaged ((a + b) / 2, as the reduction sums two ranks and divides) and accumulated in
    fp32, then clipping and torch AdamW on one copy whose weights both replicas take. `int8`: the frozen weights as
    the engine stores them."""
    replicas = [as_stored_int8(lora(name)) if int8 else lora(name) for _ in range(WORLD)]
    params = [trainable(r) for r in replicas]
    optimizer = torch.optim.AdamW(params[0], lr=3e-3, weight_decay=0.01, fused=True)
    data = batches(3 * ACCUM)
    losses: list[list[float]] = [[] for _ in range(WORLD)]
    accumulated = None
    for index, ids in enumerate(data):
        for rank, replica in enumerate(replicas):
            loss = replica(input_ids=ids[rank:rank + 1], labels=ids[rank:rank + 1]).loss
            (loss / ACCUM).backward()
            losses[rank].append(loss.item())
        mean = [(a.grad + b.grad) / WORLD for a, b in zip(*params)]
        accumulated = mean if accumulated is None else [x + y for x, y in zip(accumulated, mean)]
        for group in params:
            for p in group:
                p.grad = None
        if (index + 1) % ACCUM == 0:
            for p, g in zip(params[0], accumulated):
                p.grad = g
            torch.nn.utils.clip_grad_norm_(params[0], CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            accumulated = None
            with torch.no_grad():
                for p, q in zip(params[0], params[1]):
                    q.copy_(p)
    return losses, {k: v.detach().clone() for k, v in replicas[0].state_dict().items()}


@pytest.mark.parametrize("name, int8", [("llama", False), ("gpt2", False), ("llama", True)])
def test_two_ranks_train_lora_as_plain_data_parallel_pytorch(name, int8, tmp_path):
    """Each rank's losses and the trained model bitwise those of plain data-parallel PyTorch; with int8 frozen weights
    (each rank encoding and decoding its shard, then all-gathering), those of the same weights through int8."""
    root = str(tmp_path)
    context = mp.start_processes(_worker, args=(free_port(), root, name, int8), nprocs=WORLD, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + 240
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError("two-rank LoRA did not finish in 240 s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    ranks = [torch.load(os.path.join(root, f"rank{rank}.pt")) for rank in range(WORLD)]
    with one_thread():
        losses, state = two_rank_reference(name, int8)
    for rank, result in enumerate(ranks):
        assert result["unchanged"] and result["writes"] == 0
        assert result["losses"] == losses[rank]
        assert_state_equal(result["state"], state)


# -- bad input ------------------------------------------------------------------------------------------------

class _InPlace(torch.nn.Linear):
    def forward(self, x):
        with torch.no_grad():
            self.weight.mul_(0.5)
        return super().forward(x)


def test_a_forward_writing_a_frozen_parameter_is_an_error_naming_it(tmp_path):
    model = torch.nn.Sequential()
    model.blocks = torch.nn.ModuleList([_InPlace(8, 8), _InPlace(8, 8)])
    model.blocks[0].weight.requires_grad_(False)
    model.forward = lambda x: model.blocks[1](model.blocks[0](x)).sum()
    engine, *_ = deepspeed.initialize(model=model, config=stage3_config("cpu", "cpu"),
                                      model_parameters=trainable(model))
    try:
        with pytest.raises(RuntimeError, match=r"frozen parameter 'blocks\.0\.weight' was modified in place"):
            engine(torch.ones(2, 8))
        assert units_held(engine) == []
    finally:
        engine.close()


def test_a_host_budget_below_the_largest_frozen_shard_is_refused_before_training(tmp_path):
    """With the parameters on nvme a gather holds a whole shard in host memory: a budget below the largest (here the
    frozen embedding's unit) is a ConfigError at initialize naming it, not an error at the first forward."""
    model = lora("llama")
    embedding = 4 * model.get_input_embeddings().weight.numel()
    config = stage3_config("nvme", "cpu", nvme_path=tmp_path, zero_tiering={"host_budget": embedding // 2})
    with pytest.raises(ConfigError, match=r"zero_tiering.host_budget.*largest parameter shard.*embed_tokens#frozen"):
        deepspeed.initialize(model=model, config=config, model_parameters=trainable(model))


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("change", ["freeze", "unfreeze"])
def test_changing_requires_grad_after_initialize_is_named(stage, change):
    """The units were made from the trainable set: a parameter frozen since was still stepped (its moments and
    weight decay moved it), one unfrozen never was; either is an error at the next backward, naming it."""
    from zero.integrations.unsupported import UnsupportedFeatureError

    model = lora("llama")
    config = stage3_config("cpu", "cpu") if stage == 3 else {**stage3_config(), "zero_optimization": {"stage": 2}}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=trainable(model))
    try:
        ids = batches(1)[0]
        engine_train(engine, [ids])
        name, param = next((n, p) for n, p in model.named_parameters() if p.requires_grad == (change == "freeze"))
        param.requires_grad_(change == "unfreeze")
        with pytest.raises(UnsupportedFeatureError, match=rf"changing requires_grad of '{re.escape(name)}' after"):
            engine_train(engine, [ids])
    finally:
        engine.close()
