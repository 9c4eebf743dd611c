"""The optimizer step inside the backward (zero_tiering.speculative_step): every sub-group steps as soon as its
gradient is final, betting on no clip and no overflow; validated at the boundary, committed or rolled back and
re-stepped. Whatever the bet's fate, the bits are those of the serial step: torch.optim.AdamW(fused=True) with
clip_grad_norm_ in fp32, the mixed-precision reference in fp16.

The own GPT's total gradient norms over these batches run 3.6, 2.5, 2.7, 2.6, 1.7, 1.5, ... (unclipped), so
max_norm 100 never clips, 0.5 clips every step and 2.6 some steps only.

Children run this file as a script (`python tests/test_speculative_step.py kill ...`) for the kill -9 test.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zero  # noqa: E402
from zero.config import ConfigError  # noqa: E402

from conftest import REPO_ROOT, child_env  # noqa: E402
from stage3_models import (  # noqa: E402
    OWN_CONFIG, PartlyUnusedGPT, TwiceGPT, assert_state_equal, batches, engine_train, full_state, loss_of, one_thread,
    own_gpt, reference_train, stage3_config,
)

CLIPS = {"never": 100.0, "always": 0.5, "some": 2.6}
SUB_GROUP = 4096
"""Elements per sub-group where nothing clips: several per unit, so a unit's shard is written by several early
steps. Where clipping may act, one sub-group per unit: the clipping norm is taken per parameter piece within a
sub-group, and a parameter cut in two by a sub-group boundary makes it round otherwise than torch's (so far,
with or without speculation)."""


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def config(tier: str, tmp_path, *, clip: float, accum: int = 1, **tiering) -> dict:
    # Host-homed state keeps its copies in host memory: room for them all (the derived budget has a few).
    budget = {"host_budget": "64MiB"} if tier == "cpu" else {}
    sub_group = SUB_GROUP if clip >= CLIPS["never"] else 10**9
    return stage3_config(tier, tier, nvme_path=tmp_path, accum=accum, clip=clip, sub_group_size=sub_group,
                         zero_tiering={**budget, **tiering})


def train_both(make, data, cfg, *, accum: int, clip: float, between=None, set_to_none: bool = True):
    """The engine's run and the torch reference's on the same batches: (engine losses, engine state, engine's
    speculation stats, reference losses, reference state)."""
    model = make()
    for p in model.parameters():
        p.grad = None
    engine, *_ = zero.initialize(model=model, config=cfg)
    try:
        assert engine.speculation is not None, "speculative_step is on by default here"
        losses = []
        for ids in data:
            loss = loss_of(engine, ids, False)
            engine.backward(loss)
            if between is not None:
                between(engine)
            engine.step()
            losses.append(loss.item())
        state, stats = full_state(engine), engine.speculation.stats
    finally:
        engine.close()
    reference = make()
    reference_losses = reference_train(reference, data, accum=accum, clip=clip, set_to_none=set_to_none)
    return losses, state, stats, reference_losses, {k: v.detach().clone() for k, v in reference.state_dict().items()}


@pytest.mark.parametrize("clipping,tier,accum", [
    ("never", "nvme", 1), ("always", "nvme", 1), ("some", "nvme", 1), ("some", "nvme", 3), ("some", "cpu", 1),
    ("never", "cpu", 3),
])
def test_bitwise_equal_to_torch_whatever_the_bet(clipping, tier, accum, tmp_path):
    clip, steps = CLIPS[clipping], 6
    data = batches(steps * accum)
    make = lambda: own_gpt(0)  # noqa: E731  (tied wte / lm_head)
    losses, state, stats, ref_losses, ref_state = train_both(make, data, config(tier, tmp_path, clip=clip, accum=accum),
                                                             accum=accum, clip=clip)
    assert losses == ref_losses
    assert_state_equal(state, ref_state)
    # A committed round has stepped every sub-group early; of a lost one, whatever the worker had stepped by the
    # validation (a matter of timing) is rolled back and stepped again.
    assert stats.rolled_back == stats.re_stepped
    assert (stats.rollback_bytes > 0) == (stats.rolled_back > 0), "bytes restored where a step was undone"
    if clipping == "never":
        assert stats.rolled_back == 0
        assert stats.stepped_early > 0 and stats.stepped_early % steps == 0, "every step bets and wins"
    elif clipping == "always":
        # The first step bets and loses; a step that clipped makes the next one not bet.
        assert stats.rolled_back == stats.stepped_early
    else:
        assert stats.stepped_early > stats.rolled_back, "some bets hold"


@pytest.mark.parametrize("model", ["twice", "partly-unused"])
def test_a_block_called_twice_and_units_without_gradients(model, tmp_path):
    """A block run twice per forward (its gradient final only after both backward passes) and a model with a
    unit that gets no gradient at all (it steps with zeros at the boundary, never early; torch steps it as
    zeros where gradients are zeroed rather than set to None)."""
    twice = model == "twice"
    clip, steps = CLIPS["some" if twice else "never"], 6
    data = batches(steps)
    make = (lambda: _seeded(TwiceGPT)) if twice else (lambda: _seeded(PartlyUnusedGPT))
    losses, state, stats, ref_losses, ref_state = train_both(make, data, config("nvme", tmp_path, clip=clip),
                                                             accum=1, clip=clip, set_to_none=twice)
    assert losses == ref_losses
    assert_state_equal(state, ref_state)
    assert stats.stepped_early > 0


def _seeded(cls):
    torch.manual_seed(0)
    return cls()


def test_the_state_stepped_first_last_round_is_read_before_the_backward_reaches_it(tmp_path):
    """A round starts reading the state of the sub-groups the last round stepped first (the worker reads ahead only
    once it runs: until the backward's first unit is final the disk would wait), and stays exact."""
    clip, data = CLIPS["never"], batches(3)
    asked, submits = [], []

    def watch(engine) -> None:  # after the first backward: the next round is the one watched
        if engine.swap.prefetch.__name__ == "read_ahead":
            return
        prefetch, submit, speculation = engine.swap.prefetch, engine.speculation.submit, engine.speculation

        def read_ahead(names, tier="device"):
            if speculation._order:  # the first round has settled: these are the next round's
                watch.first = getattr(watch, "first", speculation._order[0])
                asked.append(list(names))
            return prefetch(names, tier)

        engine.swap.prefetch = read_ahead
        engine.speculation.submit = lambda sub_groups, after=(): (submits.append(len(asked)),
                                                                    submit(sub_groups, after))[1]

    losses, state, stats, ref_losses, ref_state = train_both(
        lambda: own_gpt(0), data, config("nvme", tmp_path, clip=clip), accum=1, clip=clip, between=watch)
    assert submits[0] >= 1, "nothing was read ahead before the first unit's gradient was final"
    assert watch.first.place("exp_avg")[0] in asked[0] and watch.first.place("exp_avg_sq")[0] in asked[0]
    assert losses == ref_losses and stats.rolled_back == 0
    assert_state_equal(state, ref_state)


def test_the_worker_reads_ahead_beside_a_master_larger_than_the_allowance(tmp_path):
    """While a sub-group steps early, the next ones' state is read: one sub-group ahead at a round's start, one
    more each time a sub-group waited for its state (each takes host room the next forward's gathers use). A
    master that is its unit's parameter shard (training in fp32), in host memory while its sub-groups step, takes
    none of the prefetch allowance: a tied embedding's shard larger than the allowance used to leave every one of
    its sub-groups waiting for its moments, read one at a time."""
    clip, data = CLIPS["never"], batches(3)
    wide = dataclasses.replace(OWN_CONFIG, vocab_size=2048)  # the root's shard: 4x the prefetch allowance
    rounds = []

    def watch(engine) -> None:
        if engine.swap.prefetch.__name__ == "read_ahead":
            return
        prefetch, begin = engine.swap.prefetch, engine.speculation.begin
        engine.speculation.begin = lambda *args: rounds.append([]) or begin(*args)
        watch.allowance, watch.shard = engine.swap.config.prefetch_bytes, engine.swap.segments["root/param"].nbytes

        def read_ahead(names, tier="device"):
            if rounds and threading.current_thread() is not threading.main_thread():  # the worker's, stepping
                rounds[-1].append(list(names))
            return prefetch(names, tier)

        engine.swap.prefetch = read_ahead

    cfg = config("nvme", tmp_path, clip=clip, host_budget="8MiB")
    cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 1000  # the allowance: 2 sub-groups' state and 4 KB
    losses, state, stats, ref_losses, ref_state = train_both(lambda: own_gpt(0, config=wide), data, cfg, accum=1,
                                                             clip=clip, between=watch)
    assert watch.shard > watch.allowance
    asked = [names for calls in rounds for names in calls]
    assert any(name.startswith("root/") and name.endswith("/exp_avg") for names in asked for name in names)
    firsts = [calls[0] for calls in rounds if calls]
    assert firsts and all(len({name.rsplit("/", 1)[0] for name in names}) <= 1 for names in firsts)
    assert losses == ref_losses and stats.rolled_back == 0
    assert_state_equal(state, ref_state)


def test_reading_the_state_between_backward_and_step_rolls_the_bet_back(tmp_path):
    """A state_dict between backward and step (a gather of every unit) must see the state before the step: the
    round is abandoned (rolled back), the boundary steps every sub-group serially, and training stays exact."""
    clip, steps = CLIPS["never"], 3
    data = batches(steps)
    seen = []
    losses, state, stats, ref_losses, ref_state = train_both(
        lambda: own_gpt(0), data, config("nvme", tmp_path, clip=clip), accum=1, clip=clip,
        between=lambda engine: seen.append(full_state(engine)))
    assert losses == ref_losses
    assert_state_equal(state, ref_state)
    assert stats.rolled_back == stats.stepped_early == stats.re_stepped  # every round abandoned, none committed
    reference = own_gpt(0)
    before = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    assert_state_equal(seen[0], before)  # the first read saw the initial weights, not a speculative step


def test_a_worker_that_finds_no_room_to_step_restores_nothing_changed(monkeypatch, tmp_path):
    """The worker keeps a unit's state, then finds no room to step it: the round steps nothing early, its kept
    state is restored unchanged (no bytes counted as restored, nothing rolled back), the boundary steps serially."""
    from tiering import BudgetExceededError
    from zero.optim.driver import AdamDriver

    step_sub_group = AdamDriver.step_sub_group

    def no_room_on_the_worker(self, *args, **kwargs):
        if threading.current_thread().name.startswith("zero-speculate"):
            raise BudgetExceededError("host", 1, 1, 1, "a sub-group's state")
        return step_sub_group(self, *args, **kwargs)

    monkeypatch.setattr(AdamDriver, "step_sub_group", no_room_on_the_worker)
    clip, steps = CLIPS["never"], 3
    losses, state, stats, ref_losses, ref_state = train_both(
        lambda: own_gpt(0), batches(steps), config("nvme", tmp_path, clip=clip), accum=1, clip=clip)
    assert losses == ref_losses
    assert_state_equal(state, ref_state)
    assert stats.stepped_early == stats.rolled_back == stats.rollback_bytes == 0


def test_off_restores_the_serial_step_and_on_is_refused_where_it_cannot_serve(tmp_path):
    model = own_gpt(0)
    engine, *_ = zero.initialize(model=model, config=config("nvme", tmp_path, clip=1.0, speculative_step=False))
    assert engine.speculation is None
    engine.close()
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_tiering": {"speculative_step": True}}
    with pytest.raises(ConfigError, match=r"zero_tiering\.speculative_step.*stage 3.*stage 2"):
        zero.initialize(model=own_gpt(0), config=cfg)
    cfg["zero_tiering"] = {}
    engine, *_ = zero.initialize(model=own_gpt(0), config=cfg)
    assert engine.speculation is None, "below stage 3 the default is the serial step"
    engine.close()


def test_fp16_overflow_while_betting_skips_the_step_and_halves_the_scale(tmp_path):
    """An inf in the boundary micro-batch of step 2: the bet (no clipping configured) is lost to the overflow,
    the kept state restored, the step skipped and the scale halved, as the serial step does; every other step
    matches the by-hand fp16 mixed-precision reference exactly."""
    from models import MODELS, assert_params_equal, make_config, mixed_reference_train, named_params
    from models import engine_train as train_factor

    accum, steps, overflow_step = 1, 5, 2
    data = batches(steps * accum)
    cfg = make_config(3, "nvme", accum=accum, clip=0.0, nvme_path=tmp_path, fp16={
        "enabled": True, "loss_scale": 0, "initial_scale_power": 12, "hysteresis": 1, "min_loss_scale": 1},
        zero_optimization={"sub_group_size": SUB_GROUP, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}},
        zero_tiering={"host_budget": "64MiB"})
    model = MODELS["gpt2"](0)
    engine, *_ = zero.initialize(model=model, config=cfg)
    scales, losses = [], []
    for step in range(steps):
        scales.append(engine.cur_scale)
        factor = {0: float("inf")} if step == overflow_step else None
        losses += train_factor(engine, data[step * accum:(step + 1) * accum], loss_factor=factor)
    stats = engine.speculation.stats
    assert engine.skipped_steps == 1
    assert scales == [2.0 ** 12] * (overflow_step + 1) + [2.0 ** 11] * (steps - overflow_step - 1)
    # Whatever of the overflowed round the worker had stepped is rolled back (how much is a matter of timing),
    # and none of it is stepped again: the step is skipped.
    assert stats.re_stepped == 0 and stats.stepped_early > stats.rolled_back
    reference = MODELS["gpt2"](0)
    reference_losses = mixed_reference_train(reference, torch.float16, data, accum=accum, clip=0.0,
                                             loss_scales=scales, skip=[overflow_step])
    kept = [i for i in range(len(data)) if i // accum != overflow_step]
    assert [losses[i] for i in kept] == [reference_losses[i] for i in kept]
    assert_params_equal(named_params(model), named_params(reference), exact=True)
    engine.close()


def test_delayed_copies_give_the_same_bits(monkeypatch, tmp_path):
    """Every copy to or from the device waits 5 ms on the copy worker (tests/test_stage3_copies.py's
    DelayedCopies): gathers in the next forward, and the backward's, race the early steps writing the shards
    they read. Training stays bitwise torch's, and no copy saw its source change in flight."""
    from test_stage3_copies import DelayedCopies

    delayed = DelayedCopies(monkeypatch, 0.005)
    clip, steps = CLIPS["some"], 5
    data = batches(steps)
    losses, state, stats, ref_losses, ref_state = train_both(
        lambda: own_gpt(0), data, config("nvme", tmp_path, clip=clip, host_budget="4MiB"), accum=1, clip=clip)
    assert losses == ref_losses
    assert_state_equal(state, ref_state)
    assert delayed.copies > 0 and delayed.reused == []
    assert stats.stepped_early > stats.rolled_back == stats.re_stepped


# -- kill -9 in the middle of a bet --------------------------------------------------------------------------------

THIS = os.path.abspath(__file__)
SAVED, MORE = 2, 2


def kill_config(nvme: str) -> dict:
    from checkpoint_models import ds_config

    cfg = ds_config(3, "fp32", "nvme", nvme)
    cfg["gradient_clipping"] = 0.0  # every step bets, and wins
    return cfg


def kill_engine(nvme: str):
    from checkpoint_models import tiny_lm

    engine, *_ = zero.initialize(model=tiny_lm(), config=kill_config(nvme))
    return engine


def test_kill_9_during_a_bet_leaves_the_last_checkpoint_and_the_resume_is_bitwise(tmp_path):
    from checkpoint_models import assert_same, snapshot, train

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    engine = kill_engine(str(nvme))
    straight = train(engine, SAVED + MORE)[SAVED * 2:]
    straight_state = snapshot(engine)
    engine.close()

    ckpt = tmp_path / "ckpt"
    child_nvme = tmp_path / "child-nvme"
    child_nvme.mkdir()
    proc = subprocess.run([sys.executable, THIS, "kill", str(child_nvme), str(ckpt)], capture_output=True, text=True,
                          timeout=240, env=child_env(), cwd=REPO_ROOT)
    assert proc.returncode == -signal.SIGKILL, f"rc {proc.returncode}:\n{proc.stderr[-3000:]}"
    report = json.loads((tmp_path / "ckpt.report").read_text())
    assert report["stepped_early_before_kill"] >= 2

    engine = kill_engine(str(nvme))
    engine.load_checkpoint(str(ckpt))
    assert engine.global_steps == SAVED
    resumed = train(engine, MORE)
    assert len(resumed) == len(straight)
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight))
    assert_same(straight_state, snapshot(engine))
    engine.close()


def child_kill(nvme: str, ckpt: str) -> None:
    """Train SAVED steps, save, then kill -9 this process in the next step's backward, once two sub-groups have
    stepped early (their state written to fresh extents, none validated)."""
    from checkpoint_models import train

    engine = kill_engine(nvme)
    train(engine, SAVED)
    engine.save_checkpoint(ckpt)
    driver, step_sub_group = engine.driver, engine.driver.step_sub_group
    early = []

    def stepping(sg, *args, keep_grad=False, **kwargs):
        step_sub_group(sg, *args, keep_grad=keep_grad, **kwargs)
        if keep_grad:
            early.append(sg.name)
            if len(early) == 2:
                with open(ckpt + ".report", "w") as f:
                    json.dump({"stepped_early_before_kill": len(early)}, f)
                os.kill(os.getpid(), signal.SIGKILL)

    driver.step_sub_group = stepping
    train(engine, 1)
    raise AssertionError("the step finished without two early sub-group steps")


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"kill": child_kill}[sys.argv[1]](*sys.argv[2:])
