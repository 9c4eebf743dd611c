"""Activation offload (zero_tiering.activation_offload, DeepSpeed's activation_checkpointing.cpu_checkpointing): what
autograd saves outside recomputed regions rests in host memory or on nvme between the forward and the backward,
and training is bit for bit plain PyTorch's with the same checkpointing and no offload (fp32, torch
AdamW(fused=True)): transformers GPT-2 and Llama with gradient_checkpointing_enable(), our GPT with
torch.utils.checkpoint (reentrant and not), a block called twice, no checkpointing at all; ZeRO-3 on nvme;
accumulation of 2. The copies off and onto the device run on the copy worker, slowed down: a read of an
activation that does not wait for its copy sees the wrong bytes and fails the parity."""
from __future__ import annotations

import contextlib

import pytest
import torch

import zero
from tiering import SwapConfig, SwapManager
from tiering.errors import BudgetExceededError
from zero.services.activations import ActivationOffload
from zero.config import ConfigError, load_config
from zero.train.gpt import GPTConfig

from stage3_models import (
    VOCAB, TwiceGPT, batches, engine_train, full_state, one_thread, own_gpt, reference_train, stage3_config,
    tiny_gpt2, tiny_llama,
)
from test_stage3_copies import DelayedCopies
from test_stage3_parity import assert_bitwise

pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")

STEPS = 3
SMALL = GPTConfig(n_layer=4, n_head=2, n_embd=64, vocab_size=VOCAB, seq_len=16)
"""Each block's input is 2 x 15 x 64 fp32 = 7,680 bytes: above MIN_BYTES, so every checkpoint is offloaded."""


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def build(model: str, seed: int = 0):
    """`model`: 'gpt2' / 'llama' (transformers, gradient_checkpointing_enable()), 'own-reentrant' /
    'own-nonreentrant' (torch.utils.checkpoint), 'own' (no checkpointing), 'twice' (block 0 called twice, each
    call checkpointed)."""
    if model in ("gpt2", "llama"):
        net = {"gpt2": tiny_gpt2, "llama": tiny_llama}[model](seed)
        net.gradient_checkpointing_enable()
        net.train()
        return net
    if model == "twice":
        torch.manual_seed(seed)
        return TwiceGPT(SMALL, "nonreentrant")
    checkpointing = model.removeprefix("own").removeprefix("-") or None
    return own_gpt(seed, checkpointing, SMALL)


def train(model: str, config: dict, steps: int = STEPS):
    engine, *_ = zero.initialize(model=build(model), config=config)
    try:
        losses = engine_train(engine, batches(steps * config["gradient_accumulation_steps"]))
        left = [name for name in engine.swap.segments if name.startswith("activation")]
        return losses, full_state(engine), engine, left
    finally:
        engine.close()


def reference(model: str, accum: int, steps: int = STEPS):
    net = build(model)
    losses = reference_train(net, batches(steps * accum), accum=accum)
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}


# id: (model, offload_param and offload_optimizer, activation_offload, accumulation)
CASES = {
    "gpt2-cpu-act_cpu": ("gpt2", "cpu", "cpu", 1),
    "llama-nvme-act_nvme-accum2": ("llama", "nvme", "nvme", 2),
    "own_reentrant-nvme-act_cpu": ("own-reentrant", "nvme", "cpu", 1),
    "own_nonreentrant-cpu-act_nvme-accum2": ("own-nonreentrant", "nvme", "nvme", 2),
    "twice-cpu-act_cpu": ("twice", "cpu", "cpu", 1),
    "own_no_checkpointing-cpu-act_cpu": ("own", "cpu", "cpu", 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bitwise_equal_to_torch_without_offload(case, tmp_path):
    model, tier, activations, accum = CASES[case]
    config = stage3_config(tier, tier, nvme_path=tmp_path, accum=accum,
                           zero_tiering={"activation_offload": activations})
    losses, state, engine, left = train(model, config)
    assert_bitwise(losses, state, *reference(model, accum))
    assert engine.activations.saved > 0 and engine.activations.home == {"cpu": "host", "nvme": "nvme"}[activations]
    moved = engine.swap.stats.bytes_moved
    assert moved["device->host"] >= engine.activations.saved_bytes  # every one left the device
    assert moved["host->device"] >= engine.activations.saved_bytes  # and came back for its backward
    if activations == "nvme":
        assert moved["host->nvme"] > 0
    assert left == [], "an activation's segment outlived its backward"


def test_activations_on_nvme_go_there_when_the_host_is_short(tmp_path):
    """A host budget with no room set aside for activations: each one's host copy is written to nvme to make
    room, read back for the backward, and the bits are still torch's."""
    config = stage3_config("nvme", "nvme", nvme_path=tmp_path, zero_tiering={
        "activation_offload": "nvme", "activation_host_bytes": 0})
    losses, state, engine, _ = train("own-nonreentrant", config)
    assert_bitwise(losses, state, *reference("own-nonreentrant", 1))
    assert engine.swap.stats.bytes_moved["nvme->host"] > 0


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_delayed_copies_still_give_the_same_bits(home, monkeypatch, tmp_path):
    """Every copy to or from the device waits 3 ms on the copy worker: an activation copied off the device is
    still being copied when the forward goes on, and one read back is still in flight when the backward asks
    for it. Training matches torch bit for bit, and no copy saw its source change in flight."""
    delayed = DelayedCopies(monkeypatch, 0.003)
    tier = "nvme" if home == "nvme" else "cpu"
    config = stage3_config(tier, tier, nvme_path=tmp_path, zero_tiering={"activation_offload": home})
    losses, state, engine, _ = train("own-nonreentrant", config)
    assert_bitwise(losses, state, *reference("own-nonreentrant", 1))
    assert delayed.copies > 0 and delayed.reused == []


def test_device_counts_activations_and_the_offload_lowers_its_peak(tmp_path):
    """"device" keeps the activations where autograd made them and counts them against the device budget; "cpu"
    holds them there only until their copy has landed. The device tier's peak is lower with the offload, and a
    device budget that the kept activations overflow is a BudgetExceededError. Prefetch off: a unit is
    prefetched only where the device has room, so beside kept activations it would not be, and the peaks would
    differ by that unit as well as by the activations."""
    peaks = {}
    for home in ("device", "cpu"):
        config = stage3_config("cpu", "cpu", zero_tiering={"activation_offload": home, "prefetch": False})
        _, _, engine, _ = train("own", config, steps=1)
        peaks[home] = engine.swap.stats.peak_bytes["device"]
        saved = engine.activations.saved_bytes
    assert peaks["cpu"] < peaks["device"], peaks
    assert peaks["device"] - peaks["cpu"] > saved / 4, (peaks, saved)  # most of them were off the device
    budget = peaks["cpu"] + 4096 * 8
    config = stage3_config("cpu", "cpu", zero_tiering={"activation_offload": "device", "device_budget": budget,
                                                       "prefetch": False})
    with pytest.raises(BudgetExceededError, match="device budget"):
        train("own", config, steps=1)
    config = stage3_config("cpu", "cpu", zero_tiering={"activation_offload": "cpu", "device_budget": budget,
                                                       "prefetch": False})
    train("own", config, steps=1)  # the same budget holds with the offload


class InPlace(torch.nn.Module):
    """Writes an activation in place after sigmoid saved it (its output)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x, keep: list | None = None):
        y = torch.sigmoid(self.lin(x))
        out = (y * 2).sum()
        y.add_(1.0)
        if keep is not None:
            keep.append(y)
        return out


def test_a_saved_activation_written_in_place_is_autograds_error(monkeypatch):
    """Autograd cannot see through the hooks, so the offload checks the version a saved tensor had: a write while
    its copy off the device is in flight (it would tear the copy), or one seen through the tensor still alive at
    the backward, raises at the backward as plain PyTorch does."""
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        InPlace()(torch.randn(64, 32)).backward()
    config = stage3_config("cpu", "cpu", zero_tiering={"activation_offload": "cpu"})
    engine, *_ = zero.initialize(model=InPlace(), config=config)
    try:
        keep = []
        with pytest.raises(RuntimeError, match="'activation0/1' .* was written after the forward saved it"):
            engine.backward(engine(torch.randn(64, 32), keep))
        DelayedCopies(monkeypatch, 0.05)  # the write lands while the copy is in flight
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            engine.backward(engine(torch.randn(64, 32)))
    finally:
        engine.close()


def test_a_graph_kept_for_a_second_backward_keeps_its_activations():
    """retain_graph: the activations survive the first backward and serve the second; the gradients are the
    plain model's, and the segments go when the graph does."""
    ids = batches(1)[0]
    grads = []
    with SwapManager(SwapConfig(host_budget=1 << 24)) as swap:
        offload = ActivationOffload(swap, "host")
        for hooked in (False, True):
            net = build("own-nonreentrant")
            with offload.saving(0) if hooked else contextlib.nullcontext():
                loss = net(ids[:, :-1], ids[:, 1:])
            loss.backward(retain_graph=True)
            if hooked:
                assert offload.saved > 0 and len(swap.segments) == offload.saved
            loss.backward()
            grads.append([p.grad for p in net.parameters()])
            del loss
        offload.collect()
        assert swap.segments == {}
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_config_reads_deepspeeds_section():
    base = {"train_micro_batch_size_per_gpu": 1}
    config = load_config({**base, "activation_checkpointing": {
        "partition_activations": False, "cpu_checkpointing": True, "contiguous_memory_optimization": False,
        "number_checkpoints": 4, "synchronize_checkpoint_boundary": True, "profile": True}})
    assert config.activation_offload == "cpu"
    assert config.activation_checkpointing.synchronize_checkpoint_boundary
    assert "activation_checkpointing.profile" in config.ignored
    assert load_config(base).activation_offload == "none"
    assert load_config({**base, "zero_tiering": {"activation_offload": "nvme"}}).activation_offload == "nvme"


def test_activations_on_nvme_need_the_store():
    config = stage3_config("cpu", "cpu", zero_tiering={"activation_offload": "nvme"})
    with pytest.raises(ConfigError, match="zero_tiering.activation_offload.*nvme_path"):
        zero.initialize(model=build("own"), config=config)


def test_synchronized_boundary_gives_the_same_bits(tmp_path):
    config = stage3_config("cpu", "cpu")
    config["activation_checkpointing"] = {"cpu_checkpointing": True, "synchronize_checkpoint_boundary": True}
    losses, state, engine, _ = train("own-reentrant", config)
    assert engine.activations.synchronize
    assert_bitwise(losses, state, *reference("own-reentrant", 1))


def test_deepspeeds_checkpointing_api_checkpoints_and_offloads(tmp_path):
    """`deepspeed.checkpointing.checkpoint(function, *args)` (Megatron's call) is a checkpointed region whose input
    the engine offloads like torch.utils.checkpoint's; `configure` takes a config file and refuses what only the
    config may set."""
    import zero as deepspeed
    from zero.integrations.unsupported import UnsupportedFeatureError

    class Megatron(type(build("own"))):
        def run_block(self, block, x):
            return deepspeed.checkpointing.checkpoint(block, x) if torch.is_grad_enabled() else block(x)

    torch.manual_seed(0)
    net = Megatron(SMALL)
    deepspeed.checkpointing.configure(None, deepspeed_config="ds_config.json")
    assert deepspeed.checkpointing.is_configured()
    config = stage3_config("cpu", "cpu", zero_tiering={"activation_offload": "cpu"})
    engine, *_ = zero.initialize(model=net, config=config)
    try:
        losses = engine_train(engine, batches(STEPS))
        assert engine.activations.saved >= SMALL.n_layer * STEPS
        assert_bitwise(losses, full_state(engine), *reference("own-nonreentrant", 1))
    finally:
        engine.close()
    with pytest.raises(UnsupportedFeatureError, match="checkpoint_in_cpu=True.*activation_checkpointing"):
        deepspeed.checkpointing.configure(None, checkpoint_in_cpu=True)
    with pytest.raises(UnsupportedFeatureError, match="model parallel"):
        deepspeed.checkpointing.configure(object())
    with pytest.raises(UnsupportedFeatureError, match="model_parallel_cuda_manual_seed"):
        deepspeed.checkpointing.model_parallel_cuda_manual_seed(0)
