"""engine.train_batch: a step's micro-batches through each unit at once (the unit-major schedule) trains as the
forward/backward/step loop over the same micro-batches does.

Equal within rounding (1e-6 to 1e-5 of each tensor's largest element, below), not bitwise, and this is why: the
units' gradients are the same adds in the same order (each micro-batch slice's gradient reduced and accumulated in
fp32 as its micro-batch's), but what runs outside the units (embeddings, the head, the loss) runs once on the
whole step's batch, so its matrix products and the tied embedding's gradient sum in another order. Every step runs
unit-major. Exception: an attention layer's key bias has a gradient that is all rounding (softmax ignores a
constant added to every key's score), and Adam turns any change in that rounding into a step of up to lr: those
tensors (GPT-2's c_attn.bias, our GPT's attn.bias) are held to Adam's own bound instead, and in the main job's GPT
(narrow, tied, its key bias moved by lr a step) that noise reaches the other weights at up to 4e-6 of their
largest element after 3 steps: it is held to 1e-5; GPT-2 to 2e-6 (1.2e-6 seen on two ranks, where the reduction
sums in another order too); the Llama to 1e-6."""
from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
import torch.multiprocessing as mp

import zero
from zero.accumulation.unit_major import UnitMajorWarning
from zero.train.gpt import GPT

from stage3_models import (LR, OWN_CONFIG, VOCAB, TwiceGPT, batches, closure_model, engine_train, free_port, full_state,
                           is_hf, one_thread, stage3_config, tiny_gpt2, tiny_llama)

pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")

STEPS, ACCUM, CLIP = 3, 4, 1.0
RTOL = 1e-6
KEY_BIAS = ("attn.bias", "c_attn.bias")


def main_job_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(OWN_CONFIG)


MODELS = {"gpt": main_job_gpt, "llama": tiny_llama, "gpt2": tiny_gpt2}
TOLERANCE = {"gpt": 1e-5, "llama": RTOL, "gpt2": 2e-6}


def micro_batch(model, ids: torch.Tensor):
    """The model's input for one micro-batch: keyword arguments for transformers, (inputs, targets) for ours."""
    return dict(input_ids=ids, labels=ids) if is_hf(model) else (ids[:, :-1], ids[:, 1:])


def train(model, config: dict, data: list[torch.Tensor], *, unit_major: bool, accum: int = ACCUM):
    """(per-step losses, final state, schedules) of `data` trained by train_batch or by the per-micro-batch loop."""
    engine, *_ = zero.initialize(model=model, config=config)
    try:
        if unit_major:
            losses, schedules = [], []
            for step in range(len(data) // accum):
                group = data[step * accum:(step + 1) * accum]
                losses.append(engine.train_batch([micro_batch(model, ids) for ids in group]).item())
                schedules.append(engine.schedule)
        else:
            per_micro = engine_train(engine, data)
            losses = [sum(per_micro[i:i + accum]) / accum for i in range(0, len(per_micro), accum)]
            schedules = None
        return losses, full_state(engine), schedules
    finally:
        engine.close()


def assert_close(actual: dict, expected: dict, *, rtol: float = RTOL, unit_major_steps: int = STEPS) -> None:
    """Each tensor within `rtol` of its largest element; key-bias tensors within Adam's bound (lr a step)."""
    assert actual.keys() == expected.keys()
    bad = []
    for name, value in expected.items():
        diff = (actual[name].double() - value.double()).abs().max().item()
        bound = 2 * LR * unit_major_steps if name.endswith(KEY_BIAS) else rtol * value.double().abs().max().item()
        if diff > bound:
            bad.append(f"{name}: {diff:.3g} > {bound:.3g}")
    assert not bad, bad


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("activations", [None, "nvme"])
def test_train_batch_matches_the_micro_batch_loop(name, activations, tmp_path):
    """ZeRO-3 on nvme, accumulation 4, clipping 1.0; activation checkpointing with the checkpoints offloaded to
    nvme, or none: losses and final weights within 1e-6 of the loop's, every step unit-major."""
    tiering = {} if activations is None else {"activation_offload": activations}
    config = stage3_config("nvme", "nvme", nvme_path=tmp_path, accum=ACCUM, clip=CLIP, zero_tiering=tiering)
    data = batches(STEPS * ACCUM)
    runs = []
    with one_thread():
        for unit_major in (False, True):
            model = MODELS[name](0)
            if activations is not None:
                model.gradient_checkpointing_enable()
            runs.append(train(model, config, data, unit_major=unit_major))
    (loop_losses, loop_state, _), (losses, state, schedules) = runs
    assert schedules == ["unit-major"] * STEPS
    assert losses == pytest.approx(loop_losses, rel=RTOL)
    assert_close(state, loop_state, rtol=TOLERANCE[name])


def test_each_unit_is_gathered_once_a_step_each_way(tmp_path):
    """Unit-major: every block's shard is copied into its full buffer twice a step (forward, backward), where the
    loop copies it twice per micro-batch."""
    config = stage3_config("nvme", "nvme", nvme_path=tmp_path, accum=ACCUM)
    data = batches(ACCUM)
    fills: dict[str, int] = {}
    with one_thread():
        model = tiny_llama(0)
        engine, *_ = zero.initialize(model=model, config=config)
        try:
            placement = engine.placement
            start_fill = placement._start_fill

            def counting(unit):
                fills[unit.name] = fills.get(unit.name, 0) + 1
                return start_fill(unit)

            placement._start_fill = counting
            engine.train_batch([micro_batch(model, ids) for ids in data])  # the first also probes the model
            fills.clear()
            engine.train_batch([micro_batch(model, ids) for ids in data])
            assert engine.schedule == "unit-major"
            unit_major = dict(fills)
            fills.clear()
            engine_train(engine, data)
        finally:
            engine.close()
    blocks = sorted(name for name in unit_major if name.startswith("model.layers."))
    assert len(blocks) == 2
    assert {name: unit_major[name] for name in blocks} == {name: 2 for name in blocks}
    assert {name: fills[name] for name in blocks} == {name: 2 * ACCUM for name in blocks}


def test_a_unit_called_twice_runs_micro_batch_by_micro_batch(tmp_path):
    """TwiceGPT calls block 0 twice a forward: train_batch says so once and runs the loop's schedule, bit for bit."""
    config = stage3_config("nvme", "nvme", nvme_path=tmp_path, accum=2, clip=CLIP)
    data = batches(3 * 2)
    with one_thread():
        torch.manual_seed(0)
        loop = train(TwiceGPT(), config, data, unit_major=False, accum=2)
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batched = train(TwiceGPT(), config, data, unit_major=True, accum=2)
    said = [str(w.message) for w in caught if issubclass(w.category, UnitMajorWarning)]
    assert said == ["train_batch runs micro-batch by micro-batch: unit 'blocks.0' is called 2 times in one forward "
                    "(its gradient is complete only after every call's backward)"]
    assert batched[2] == ["micro-batch"] * 3
    assert batched[0] == pytest.approx(loop[0], rel=1e-7)  # the mean of the same losses, in fp32
    assert all(torch.equal(batched[1][k], v) for k, v in loop[1].items())


def test_micro_batches_of_different_shapes_run_one_after_another(tmp_path):
    config = stage3_config("cpu", "cpu", accum=2)
    with one_thread():
        model = tiny_llama(0)
        engine, *_ = zero.initialize(model=model, config=config)
        try:
            data = batches(4)
            engine.train_batch([micro_batch(model, ids) for ids in data[:2]])
            assert engine.schedule == "unit-major"
            with pytest.warns(UnitMajorWarning, match=r"input 0 differs in shape between micro-batches "
                                                      r"\(\(2, 12\), \(2, 16\)\)"):
                engine.train_batch([micro_batch(model, data[2][:, :12]), micro_batch(model, data[3])])
            assert engine.schedule == "micro-batch" and engine.global_steps == 2
            engine.train_batch([micro_batch(model, ids) for ids in data[:2]])
            assert engine.schedule == "unit-major" and engine.global_steps == 3
        finally:
            engine.close()


def test_train_batch_refuses_a_started_step_and_too_few_micro_batches(tmp_path):
    config = stage3_config("cpu", "cpu", accum=2)
    with one_thread():
        model = tiny_llama(0)
        engine, *_ = zero.initialize(model=model, config=config)
        try:
            ids = batches(1)[0]
            with pytest.raises(ValueError, match=r"needs 2 micro-batches \(gradient_accumulation_steps\) and "
                                                 r"data_iter gave 1"):
                engine.train_batch([micro_batch(model, ids)])
            engine.backward(engine(**micro_batch(model, ids)).loss)
            engine.step()
            with pytest.raises(RuntimeError, match="1 of this step's 2 micro-batches already went through"):
                engine.train_batch([micro_batch(model, ids)] * 2)
        finally:
            engine.close()


# -- two ranks ---------------------------------------------------------------------------------------------------

WORLD = 2
TWO_RANK_CASES = [("llama", None), ("llama", "nvme"), ("gpt", None), ("gpt2", "nvme")]
"""(model, activation offload): each model once, activation offload on and off."""


def _worker(rank: int, port: int, root: str) -> None:
    os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    data = [ids[rank:rank + 1] for ids in batches(STEPS * ACCUM)]  # each rank its own row of every batch
    results = {}
    for name, activations in TWO_RANK_CASES:
        for unit_major in (False, True):
            model = MODELS[name](0)
            tiering = {}
            if activations is not None:
                model.gradient_checkpointing_enable()
                tiering = {"activation_offload": activations}
            path = os.path.join(root, f"rank{rank}")
            os.makedirs(path, exist_ok=True)
            config = stage3_config("nvme", "nvme", nvme_path=path, accum=ACCUM, clip=CLIP, micro=1,
                                   zero_tiering=tiering)
            results[name, activations, unit_major] = train(model, config, data, unit_major=unit_major)
    torch.save(results, os.path.join(root, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def test_two_ranks_train_batch_matches_their_loop(tmp_path):
    """Two ranks (gloo), each its own rows, ZeRO-3 on nvme, accumulation 4, clipping: a reduction per micro-batch
    slice on both ranks in the same order; both ranks agree bit for bit, and with their loop within the tolerances
    above. The main job's GPT, Llama and GPT-2; activation offload to nvme and none."""
    root = str(tmp_path)
    context = mp.start_processes(_worker, args=(free_port(), root), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + 240
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError("two-rank train_batch did not finish in 240 s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    ranks = [torch.load(os.path.join(root, f"rank{rank}.pt")) for rank in range(WORLD)]
    for name, activations in TWO_RANK_CASES:
        loop, batched = ranks[0][name, activations, False], ranks[0][name, activations, True]
        other = ranks[1][name, activations, True]
        assert batched[2] == ["unit-major"] * STEPS
        assert batched[1].keys() == other[1].keys()
        assert all(torch.equal(v, other[1][k]) for k, v in batched[1].items()), (name, activations)
        assert batched[0] == pytest.approx(loop[0], rel=RTOL)
        assert_close(batched[1], loop[1], rtol=TOLERANCE[name])


def test_a_unit_reading_a_root_parameter_runs_micro_batch_by_micro_batch(tmp_path):
    """ClosureModel's blocks read the root's `gate`: the probe finds it, and the steps run as the loop, bit for bit."""
    config = stage3_config("nvme", "nvme", nvme_path=tmp_path, accum=2, clip=CLIP)
    data = [(ids[:, :-1], ids[:, 1:]) for ids in batches(3 * 2)]
    runs = []
    with one_thread(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for unit_major in (False, True):
            engine, *_ = zero.initialize(model=closure_model(0), config=config)
            try:
                for step in range(3):
                    group = data[2 * step:2 * step + 2]
                    if unit_major:
                        engine.train_batch(group)
                        assert engine.schedule == "micro-batch"
                    else:
                        for inputs, targets in group:
                            engine.backward(engine(inputs, targets))
                            engine.step()
                runs.append(full_state(engine))
            finally:
                engine.close()
    said = [str(w.message) for w in caught if issubclass(w.category, UnitMajorWarning)]
    assert said == ["train_batch runs micro-batch by micro-batch: unit 'blocks.0' reads the root unit's parameter "
                    "'gate' in its forward (the root's gradient would be reduced before the step's is complete)"]
    assert all(torch.equal(runs[1][k], v) for k, v in runs[0].items())


def test_zero_tiering_accumulation_micro_batch_runs_the_loop_without_a_word(tmp_path):
    config = stage3_config("cpu", "cpu", accum=2, zero_tiering={"accumulation": "micro-batch"})
    with one_thread(), warnings.catch_warnings():
        warnings.simplefilter("error", UnitMajorWarning)
        model = tiny_llama(0)
        engine, *_ = zero.initialize(model=model, config=config)
        try:
            engine.train_batch([micro_batch(model, ids) for ids in batches(2)])
            assert engine.schedule == "micro-batch" and engine.global_steps == 1
        finally:
            engine.close()


def test_a_resumed_unit_major_run_is_the_uninterrupted_one_with_dropout(tmp_path):
    """GPT-2 with dropout, unit-major: saved after a step and resumed in a new engine (random streams restored; the
    new engine probes the model again without drawing from them), the next two steps are bit for bit the
    uninterrupted run's."""
    config = stage3_config("nvme", "nvme", nvme_path=tmp_path / "nvme", accum=2, clip=CLIP)
    (tmp_path / "nvme").mkdir()
    groups = [[micro_batch(tiny_gpt2(0), ids) for ids in batches(6)[2 * s:2 * s + 2]] for s in range(3)]

    def engine_of():
        model = tiny_gpt2(0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
        model.train()
        return zero.initialize(model=model, config=config)[0]

    with one_thread():
        torch.manual_seed(7)
        engine = engine_of()
        try:
            whole = [engine.train_batch(group).item() for group in groups]
            assert engine.schedule == "unit-major"
            expected = full_state(engine)
        finally:
            engine.close()
        torch.manual_seed(7)
        engine = engine_of()
        try:
            first = engine.train_batch(groups[0]).item()
            engine.save_checkpoint(tmp_path / "ckpt")
        finally:
            engine.close()
        torch.manual_seed(99)  # a fresh process's streams: the checkpoint's must replace them
        engine = engine_of()
        try:
            engine.load_checkpoint(tmp_path / "ckpt", load_rng_states=True)
            rest = [engine.train_batch(group).item() for group in groups[1:]]
            resumed = full_state(engine)
        finally:
            engine.close()
    assert [first, *rest] == whole
    assert all(torch.equal(resumed[k], v) for k, v in expected.items())


class PositionBiasBlock(torch.nn.Module):
    """Returns, beside its output, a tensor without the batch's rows first (as T5's blocks return a position bias)."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.fc = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(x)), torch.tanh(self.fc.bias).unsqueeze(0)


class PositionBiasModel(torch.nn.Module):
    def __init__(self, dim: int = 32, layers: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.blocks = torch.nn.ModuleList(PositionBiasBlock(dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, idx, targets):
        x = self.embed(idx)
        for block in self.blocks:
            x, bias = block(x)
        return torch.nn.functional.cross_entropy(self.head(x + bias).view(-1, VOCAB), targets.reshape(-1))


def test_a_unit_returning_a_tensor_without_the_batchs_rows_runs_micro_batch_by_micro_batch(tmp_path):
    config = stage3_config("cpu", "cpu", accum=2)
    with one_thread(), pytest.warns(UnitMajorWarning, match=r"unit 'blocks.0' returns a tensor of shape \(1, 32\) "
                                                            r"without the micro-batch's 2 rows first"):
        torch.manual_seed(0)
        engine, *_ = zero.initialize(model=PositionBiasModel(), config=config)
        try:
            engine.train_batch([(ids[:, :-1], ids[:, 1:]) for ids in batches(2)])
            assert engine.schedule == "micro-batch" and engine.global_steps == 1
        finally:
            engine.close()


def tiny_bloom():
    from transformers import BloomConfig, BloomForCausalLM
    torch.manual_seed(0)
    return BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=2))


def test_a_stacked_forward_that_fails_runs_the_step_micro_batch_by_micro_batch(tmp_path):
    """BLOOM hands every block an alibi of batch x heads rows, which the slices cannot cut: the probe (one
    micro-batch) passes, the stacked forward fails; the step then runs as the loop, bit for bit, nothing held."""
    config = stage3_config("cpu", "cpu", accum=2)
    data = batches(3 * 2)
    with one_thread():
        loop = train(tiny_bloom(), config, data, unit_major=False, accum=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batched = train(tiny_bloom(), config, data, unit_major=True, accum=2)
    said = [str(w.message) for w in caught if issubclass(w.category, UnitMajorWarning)]
    assert len(said) == 1 and said[0].startswith("train_batch runs micro-batch by micro-batch: the step's stacked "
                                                 "forward failed (RuntimeError: ")
    assert batched[2] == ["micro-batch"] * 3
    assert batched[0] == pytest.approx(loop[0], rel=1e-7)
    assert all(torch.equal(batched[1][k], v) for k, v in loop[1].items())


class NormedBlock(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear, self.norm = torch.nn.Linear(dim, dim), torch.nn.BatchNorm1d(dim)

    def forward(self, x):
        return x + self.norm(self.linear(x).transpose(1, 2)).transpose(1, 2)


def test_what_slicing_would_change_is_refused(tmp_path):
    """A batch norm's statistics (updated again by the recomputation), a load-balancing loss on router logits (made
    without gradients in the slices): both are the loop's, said once."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = stage3_config("cpu", "cpu", accum=2)
    normed = PositionBiasModel()
    normed.blocks = torch.nn.ModuleList(NormedBlock(32) for _ in range(2))
    normed.forward = lambda idx, targets: torch.nn.functional.cross_entropy(
        normed.head(normed.blocks[1](normed.blocks[0](normed.embed(idx)))).view(-1, VOCAB), targets.reshape(-1))
    torch.manual_seed(0)
    mixtral = MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True))
    cases = [(normed, r"module 'blocks.0.norm' is a BatchNorm1d", lambda ids: (ids[:, :-1], ids[:, 1:])),
             (mixtral, r"returns its router logits", lambda ids: dict(input_ids=ids, labels=ids))]
    for model, reason, batch in cases:
        with one_thread(), pytest.warns(UnitMajorWarning, match=reason):
            engine, *_ = zero.initialize(model=model, config=config)
            try:
                engine.train_batch([batch(ids) for ids in batches(2)])
                assert engine.schedule == "micro-batch" and engine.global_steps == 1
            finally:
                engine.close()
