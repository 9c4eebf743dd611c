"""zero.Init partitions modules as they are built, GatheredParameters gives them whole (before initialize and
after), DeepSpeed's ds_* attributes say what a reader of them expects, and zero.utils reads and sets a
parameter's training state whole; a model whose fp32 training state is twice the host budget is built under
zero.Init and trains within the budget plus 1 GiB.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import zero as deepspeed
from zero.config import ConfigError
from zero.integrations.unsupported import UnsupportedFeatureError

NOT_AVAILABLE, AVAILABLE = deepspeed.zero.ZeroParamStatus.NOT_AVAILABLE, deepspeed.zero.ZeroParamStatus.AVAILABLE


class Blocks(nn.Module):
    def __init__(self, dim: int = 16, layers: int = 3):
        super().__init__()
        self.embed = nn.Embedding(32, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, ids, labels):
        x = self.embed(ids)
        for layer in self.layers:
            x = torch.tanh(layer(x)) * self.scale
        return nn.functional.cross_entropy((x @ self.embed.weight.t()).flatten(0, 1), labels.flatten())


def config(tmp_path, device: str = "nvme", **zero_tiering) -> dict:
    offload = {"device": device, **({"nvme_path": str(tmp_path)} if device == "nvme" else {})}
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "offload_param": dict(offload), "offload_optimizer": dict(offload),
                                  "stage3_param_persistence_threshold": 0},  # every unit released after use
            "zero_tiering": zero_tiering}


def built(seed: int = 0, init=None) -> Blocks:
    torch.manual_seed(seed)
    if init is None:
        return Blocks()
    with init:
        return Blocks()


def three_steps(engine) -> list[float]:
    """Three steps on random ids (the same for every engine: seeded here); their losses."""
    torch.manual_seed(5)
    run = []
    for _ in range(3):
        ids = torch.randint(0, 32, (2, 8))
        loss = engine(ids, torch.roll(ids, 1, 1))
        engine.backward(loss)
        engine.step()
        run.append(loss.item())
    return run


def test_modules_built_inside_are_partitioned_with_deepspeeds_attributes(tmp_path):
    plain = built()
    model = built(init=deepspeed.zero.Init(config_dict_or_path=config(tmp_path)))
    assert os.listdir(tmp_path)  # the slices wait on nvme
    ids = set()
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        assert p.is_meta and p.ds_shape == q.shape and p.ds_numel == q.numel(), name
        assert p.ds_status is NOT_AVAILABLE
        ids.add(p.ds_id)
    assert len(ids) == len(list(plain.parameters()))
    everything = list(model.parameters())
    with deepspeed.zero.GatheredParameters(everything):
        for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
            assert p.ds_status is AVAILABLE and torch.equal(p, q), name
    assert all(p.is_meta for p in everything)


def test_gathered_parameters_keeps_the_modifier_ranks_changes_and_only_those(tmp_path):
    model = built(init=deepspeed.zero.Init(config_dict_or_path=config(tmp_path)))
    weight = model.layers[1].weight
    with deepspeed.zero.GatheredParameters(weight):  # no modifier: changes are dropped
        before = weight.detach().clone()
        weight.data.add_(1.0)
    with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
        assert torch.equal(weight, before)
        weight.data.mul_(2.0)
    with pytest.raises(ZeroDivisionError), deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
        weight.data.zero_()
        1 / 0  # a block that raises changes nothing
    with deepspeed.zero.GatheredParameters([weight], enabled=False):
        assert weight.is_meta
    with deepspeed.zero.GatheredParameters([weight]):
        assert torch.equal(weight, before * 2.0)


def test_a_nested_init_leaves_the_partitioning_to_the_outer_one(tmp_path):
    """transformers opens a zero.Init of its own inside a user's (from_config under a ZeRO-3 config)."""
    plain = built()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config(tmp_path)):
        with deepspeed.zero.Init(config_dict_or_path=config(tmp_path, "cpu")):
            model = Blocks()
        extra = nn.Linear(4, 4)
    assert all(p.is_meta for p in (*model.parameters(), *extra.parameters()))
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
            assert torch.equal(p, q), name


def test_an_init_inside_a_disabled_one_partitions(tmp_path):
    with deepspeed.zero.Init(enabled=False):
        with deepspeed.zero.Init(config_dict_or_path=config(tmp_path)):
            model = Blocks()
    assert all(p.is_meta for p in model.parameters())


def test_a_modifying_block_nested_in_a_reading_one_keeps_its_change(tmp_path):
    model = built(init=deepspeed.zero.Init(config_dict_or_path=config(tmp_path)))
    weight = model.layers[1].weight
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
            weight.data.fill_(7.0)
        assert not weight.is_meta  # the outer block's, still
    assert weight.is_meta
    with deepspeed.zero.GatheredParameters([weight]):
        assert torch.equal(weight, torch.full((16, 16), 7.0))


def test_initialize_takes_the_slices_and_trains_as_the_plain_model(tmp_path):
    """The model built under zero.Init, given to initialize, trains bitwise as the same model built plainly
    (fp32, one rank); the staging file is gone once initialize has taken every slice."""
    losses = []
    for init in (None, deepspeed.zero.Init(config_dict_or_path=config(tmp_path))):
        model = built(init=init)
        engine, *_ = deepspeed.initialize(model=model, config=config(tmp_path))
        staged = sorted(os.listdir(tmp_path))
        run = three_steps(engine)
        assert all(p.ds_status is NOT_AVAILABLE for p in model.parameters())
        engine.close()
        losses.append((run, staged))
    assert losses[0][0] == losses[1][0]
    assert len(losses[1][1]) == 1  # the engine's own store, the staging file removed


class LoRA(nn.Module):
    """DeepSpeed-Chat's LinearLayer_LoRA, abridged: a Linear's weight and bias (frozen) beside two new matrices,
    built after the model and moved `.to(weight.device)` as dschat's convert_linear_layer_to_lora does."""

    def __init__(self, linear: nn.Linear, rank: int = 4):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        rows, columns = getattr(linear.weight, "ds_shape", linear.weight.shape)
        self.right = nn.Parameter(torch.empty(columns, rank))
        self.left = nn.Parameter(torch.zeros(rank, rows))
        nn.init.kaiming_uniform_(self.right, a=5 ** 0.5)
        self.weight.requires_grad = False

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias) + x @ self.right @ self.left


def with_lora(model: Blocks) -> Blocks:
    torch.manual_seed(3)
    for i, linear in enumerate(model.layers):
        model.layers[i] = LoRA(linear).to(linear.weight.device).to(linear.weight.dtype)
    return model


def test_a_module_built_beside_a_partitioned_parameter_on_its_device_keeps_its_values(tmp_path):
    """A partitioned parameter's `device` is the local device, as DeepSpeed's: a module built after zero.Init and
    moved `.to(weight.device)` (dschat's LoRA layers) keeps its values, and trains as the plain model does (on meta
    they were dropped: the adapters started at zero and never trained)."""
    plain = with_lora(built())
    model = with_lora(built(init=deepspeed.zero.Init(config_dict_or_path=config(tmp_path))))
    for layer, expected in zip(model.layers, plain.layers):
        assert layer.weight.is_meta and layer.weight.device == torch.device("cpu")
        assert torch.equal(layer.right, expected.right) and layer.right.abs().sum() > 0
    runs = []
    for net in (plain, model):
        trained = [p for p in net.parameters() if p.requires_grad]
        engine, *_ = deepspeed.initialize(model=net, model_parameters=trained, config=config(tmp_path))
        runs.append(three_steps(engine))
        engine.close()
    assert runs[0] == runs[1] and runs[0][0] != runs[0][-1]


def test_after_initialize_the_modifier_rank_rewrites_the_masters_and_utils_read_them(tmp_path):
    model = built(init=deepspeed.zero.Init(config_dict_or_path=config(tmp_path, "cpu")))
    engine, *_ = deepspeed.initialize(model=model, config=config(tmp_path, "cpu"))
    weight, other = model.layers[2].weight, model.layers[2].bias
    other_before = deepspeed.utils.safe_get_full_fp32_param(other)
    with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
        assert weight.ds_status is AVAILABLE
        weight.data.fill_(0.25)
    assert torch.equal(deepspeed.utils.safe_get_full_fp32_param(weight), torch.full((16, 16), 0.25))
    assert torch.equal(deepspeed.utils.safe_get_full_fp32_param(other), other_before)
    assert deepspeed.utils.safe_get_full_grad(weight) is None  # no backward since the last step
    deepspeed.utils.safe_set_full_optimizer_state(other, torch.full((16,), 3.0), "exp_avg")
    assert torch.equal(deepspeed.utils.safe_get_full_optimizer_state(other, "exp_avg"), torch.full((16,), 3.0))
    deepspeed.utils.safe_set_full_fp32_param(other, torch.arange(16.0))
    with deepspeed.zero.GatheredParameters([other]):
        assert torch.equal(other, torch.arange(16.0))
    ids = torch.randint(0, 32, (2, 8))
    engine.backward(engine(ids, ids))
    grad = deepspeed.utils.safe_get_full_grad(weight)
    assert grad.shape == (16, 16) and grad.abs().sum() > 0
    with pytest.raises(ValueError, match="exp_avg"):
        deepspeed.utils.safe_get_full_optimizer_state(weight, "momentum")
    engine.step()
    engine.close()
    assert deepspeed.utils.safe_get_full_fp32_param(weight) is None  # a closed engine answers nothing


def test_what_init_cannot_serve_is_named(tmp_path):
    no_path = config(tmp_path, "cpu")
    with pytest.raises(ConfigError, match="nvme_path"):
        deepspeed.zero.Init(config_dict_or_path=no_path, remote_device="nvme")
    with pytest.raises(UnsupportedFeatureError, match="mpu"):
        deepspeed.zero.Init(mpu=object())
    with pytest.raises(UnsupportedFeatureError, match="zero_quantized_weights"):
        deepspeed.zero.Init(zero_quantized_weights=True)
    with deepspeed.zero.Init(enabled=False):
        model = Blocks()
    assert not any(p.is_meta for p in model.parameters())


MEMORY_SCRIPT = textwrap.dedent('''
    import json, sys, torch
    from torch import nn
    import zero as deepspeed

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(1024, 4096), nn.Linear(4096, 1024)) for _ in range(8))
        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
            return x.square().mean()

    config = json.loads(sys.argv[1])
    torch.set_num_threads(2)
    imports = rss("VmHWM")
    open("/proc/self/clear_refs", "w").write("5")  # the peak from here on
    before = rss("VmRSS")
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = Net()
    building = rss("VmHWM") - before
    engine, *_ = deepspeed.initialize(model=model, config=config)
    for _ in range(2):
        loss = engine(torch.randn(1, 4, 1024))
        engine.backward(loss)
        engine.step()
    engine.close()
    numel = sum(p.ds_numel for p in model.parameters())
    print(json.dumps(dict(peak=max(imports, rss("VmHWM")), building=building, numel=numel)))
''')


@pytest.mark.slow
def test_a_model_twice_the_host_budget_is_built_under_init_and_trains_within_it(tmp_path):
    """fp32 state 16 bytes a parameter (master in the parameter shard, two moments, the gradient): 67M
    parameters are 1.0 GiB of state against a 512 MiB host budget. Built under zero.Init with the slices on
    nvme, building raises the process's peak by less than half the model's 256 MiB of weights; the whole run
    stays within the budget plus 1 GiB."""
    budget = 512 << 20
    cfg = config(tmp_path, host_budget=budget)
    done = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, json.dumps(cfg)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    weights = 4 * result["numel"]
    assert 16 * result["numel"] >= 2 * budget
    assert result["building"] < weights / 2
    assert result["peak"] <= budget + (1 << 30)


def test_save_16bit_model_writes_the_gathered_weights_where_the_config_asks(tmp_path):
    """Stage 3 writes only with stage3_gather_16bit_weights_on_model_save (as DeepSpeed: a warning and False
    otherwise); the file holds every parameter (tied ones under each name) and buffer, whole, as the engine's
    state_dict gives them. One rank needs no sync: no_sync() runs its block."""
    cfg = config(tmp_path, "cpu")
    engine, *_ = deepspeed.initialize(model=built(), config=cfg)
    with pytest.warns(UserWarning, match="stage3_gather_16bit_weights_on_model_save"):
        assert engine.save_16bit_model(tmp_path / "out") is False
    assert not (tmp_path / "out").exists()
    engine.close()
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, *_ = deepspeed.initialize(model=built(), config=cfg)
    ids = torch.randint(0, 32, (2, 8))
    with engine.no_sync():
        engine.backward(engine(ids, ids))
    engine.step()
    assert engine.save_16bit_model(tmp_path / "out", "weights.bin") is True
    saved = torch.load(tmp_path / "out" / "weights.bin")
    expected = engine.module_state_dict()
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[k], expected[k]) for k in expected)
    engine.close()


class NormedBlocks(nn.Module):
    """Blocks reading a submodule's weight through a weight norm of their own, registered as an external parameter
    the way transformers' wav2vec2 positional convolution registers its weight_v and weight_g under ZeRO-3."""

    def __init__(self, dim: int = 16, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(32, dim)
        self.blocks = nn.ModuleList(NormedBlock(dim) for _ in range(layers))

    def forward(self, ids, labels):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy((x @ self.embed.weight.t()).flatten(0, 1), labels.flatten())


class NormedBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.inner = nn.Linear(dim, dim)
        self.gain = nn.Parameter(torch.ones(dim, 1))
        deepspeed.zero.register_external_parameter(self, self.inner.weight)

    def forward(self, x):
        weight = self.gain * self.inner.weight / self.inner.weight.norm(dim=1, keepdim=True)
        return torch.tanh(nn.functional.linear(x, weight, self.inner.bias))


def test_a_registered_external_parameter_of_the_same_block_trains_as_the_plain_model(tmp_path):
    """deepspeed.zero.register_external_parameter exists (transformers calls it) and a block reading its submodule's
    weight in its own forward trains bitwise as the plain model, built under zero.Init."""
    losses = []
    for init in (None, deepspeed.zero.Init(config_dict_or_path=config(tmp_path))):
        torch.manual_seed(0)
        with init or contextlib.nullcontext():
            model = NormedBlocks()
        engine, *_ = deepspeed.initialize(model=model, config=config(tmp_path))
        run = three_steps(engine)
        engine.close()
        losses.append(run)
    assert losses[0] == losses[1]


FULL_DISK_16BIT = textwrap.dedent("""
    import json, os, resource, signal, sys
    sys.path.insert(0, sys.argv[2])
    import zero
    from stage3_models import stage3_config, tiny_gpt2
    out = sys.argv[1]
    config = stage3_config("cpu", "cpu")
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, *_ = zero.initialize(model=tiny_gpt2(), config=config)
    os.makedirs(out)
    with open(os.path.join(out, "pytorch_model.bin"), "wb") as f:
        f.write(b"the last save")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, resource.RLIM_INFINITY))
    try:
        engine.save_16bit_model(out)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"error": error, "files": sorted(os.listdir(out)),
                      "kept": open(os.path.join(out, "pytorch_model.bin"), "rb").read().decode()}))
    """)


def test_save_16bit_model_on_a_full_disk_is_one_error_and_the_last_file_stays(tmp_path):
    """torch.save past a file size limit says only "unexpected pos": the error names the file and the room, the
    temporary file goes, the file saved before is as it was (and with several ranks every rank raises it)."""
    done = subprocess.run([sys.executable, "-c", FULL_DISK_16BIT, str(tmp_path / "out"),
                           os.path.dirname(os.path.abspath(__file__))], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["error"].startswith("CheckpointError: writing the 16-bit weights to "), result["error"]
    assert "bytes free on its filesystem" in result["error"]
    assert result["files"] == ["pytorch_model.bin"] and result["kept"] == "the last save"
