"""Configs through `zero.initialize`: every example in configs/ trains, every bad config fails naming its key."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

import zero
from zero.config import ConfigError, UnknownKeyError, UnresolvedAutoError, UnsupportedKeyError, load_config

from models import one_thread  # noqa: F401  (autouse fixture)
from models import batches, engine_train, make_config, tied_blocks, tiny_gpt2

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
FILES = sorted(CONFIGS.glob("*.json"))


def test_configs_exist():
    names = {f.name for f in FILES}
    assert {"no_offload.json", "zero1.json", "zero2_cpu.json", "zero3_cpu.json", "zero3_nvme.json"} <= names


def state(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in engine.module_state_dict().items()}


@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_example_config_trains(path, tmp_path):
    """Each example, as written (nvme paths pointed at a directory that does not exist yet: the engine creates it, as
    DeepSpeed does), trains two optimizer steps
    of the tiny GPT-2 with the config's own micro batch size and accumulation. The stage-3 examples were
    expected to raise "stage 3 ... not built yet" until the ZeRO-3 partitioner landed; they now train too.
    The examples with a warmup schedule start at lr 0 (warmup_min_lr 0 / warmup_min_ratio 0): their first
    step moves nothing, so for them the check is that the lr leaves 0."""
    raw = json.loads(path.read_text())
    for key in ("offload_param", "offload_optimizer"):
        section = raw.get("zero_optimization", {}).get(key)
        if section and "nvme_path" in section:
            section["nvme_path"] = str(tmp_path / "nvme" / "swap")
    load_config(path)  # the file itself, unmodified, loads
    model = tiny_gpt2(0)
    engine, optimizer, _, scheduler = zero.initialize(model=model, config=raw)
    try:
        cfg = engine.config
        assert engine.stage == raw["zero_optimization"]["stage"]
        assert (scheduler is not None) == ("scheduler" in raw)
        before = state(engine)
        first_lr = engine.get_lr()
        losses = engine_train(engine, batches(2 * cfg.gradient_accumulation_steps,
                                              batch=cfg.train_micro_batch_size_per_gpu))
        assert engine.global_steps == 2 and engine.skipped_steps == 0 and optimizer.step_count == 2
        assert (tmp_path / "nvme" / "swap").is_dir() == ("nvme" in path.read_text())
        after = state(engine)
        assert all(torch.isfinite(v).all() for v in after.values()) and all(map(math.isfinite, losses))
        if scheduler is None:
            assert first_lr == [raw["optimizer"]["params"]["lr"]]
            assert any(not torch.equal(before[k], after[k]) for k in before), "two steps changed no parameter"
        else:
            assert first_lr == [0.0] and engine.get_lr()[0] > 0.0
    finally:
        engine.close()
    assert not any(f for f in tmp_path.rglob("*") if not f.is_dir()), "close() left nvme files behind"


def with_change(change, base=None):
    config = copy.deepcopy(base or make_config(2, "cpu"))
    change(config)
    return config


BAD = {  # name: (config, exception type, the key its message must name)
    "unknown key": (
        with_change(lambda c: c["zero_optimization"].update(offload_optimiser={"device": "cpu"})),
        UnknownKeyError, "zero_optimization.offload_optimiser"),
    "unknown top-level key": (
        with_change(lambda c: c.update(gradient_clip=1.0)), UnknownKeyError, "gradient_clip"),
    "wrong type": (
        with_change(lambda c: c.update(gradient_clipping="1.0")), ConfigError, "gradient_clipping"),
    "wrong type in a section": (
        with_change(lambda c: c["zero_optimization"].update(stage="2")), ConfigError, "zero_optimization.stage"),
    "out of range": (
        with_change(lambda c: c["optimizer"]["params"].update(betas=[0.9, 1.5])), ConfigError,
        "optimizer.params.betas"),
    "nvme without nvme_path": (
        with_change(lambda c: c["zero_optimization"]["offload_optimizer"].update(device="nvme")), ConfigError,
        "zero_optimization.offload_optimizer.nvme_path"),
    "unsupported DeepSpeed key": (
        with_change(lambda c: c["zero_optimization"].update(zero_quantized_gradients=True)), UnsupportedKeyError,
        "zero_optimization.zero_quantized_gradients"),
    "unsupported DeepSpeed section": (
        with_change(lambda c: c.update(amp={"enabled": True})), UnsupportedKeyError, "amp"),
    "unsupported optimizer": (
        with_change(lambda c: c["optimizer"].update(type="Lamb")), UnsupportedKeyError, "optimizer.type"),
    "unsupported schedule": (
        with_change(lambda c: c.update(scheduler={"type": "OneCycle", "params": {}})), UnsupportedKeyError,
        "scheduler.type"),
    "unsupported optimizer option": (
        with_change(lambda c: c["optimizer"]["params"].update(amsgrad=True)), UnsupportedKeyError,
        "optimizer.params.amsgrad"),
    "no bias correction": (
        with_change(lambda c: c["optimizer"]["params"].update(bias_correction=False)), ConfigError,
        "optimizer.params.bias_correction"),
    "unresolvable auto (needs training args)": (
        with_change(lambda c: c["optimizer"]["params"].update(lr="auto")), UnresolvedAutoError, "optimizer.params.lr"),
    "unresolvable auto (no rule)": (
        with_change(lambda c: c["zero_optimization"].update(sub_group_size="auto")), UnresolvedAutoError,
        "zero_optimization.sub_group_size"),
    "unresolvable auto batch size": (
        with_change(lambda c: c.update(train_micro_batch_size_per_gpu="auto")), UnresolvedAutoError,
        "train_micro_batch_size_per_gpu"),
    "inconsistent batch sizes": (
        with_change(lambda c: c.update(train_batch_size=3)), ConfigError, "train_batch_size"),
    "fp16 and bf16": (
        with_change(lambda c: c.update(fp16={"enabled": True}, bf16={"enabled": True})), ConfigError, "bf16.enabled"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_config_fails_at_initialize_naming_the_key(name):
    config, error, key = BAD[name]
    model = tied_blocks(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error) as info:
        zero.initialize(model=model, config=config)
    assert info.value.key == key
    assert str(info.value).startswith(key), f"the message does not lead with the key: {info.value}"
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before), \
        "a rejected config left the model changed"


def test_unknown_key_message_names_the_closest_known_key():
    config, _, _ = BAD["unknown key"]
    with pytest.raises(UnknownKeyError, match="offload_optimizer"):
        zero.initialize(model=tied_blocks(0), config=config)


def test_auto_bucket_size_resolves_from_the_model_hidden_size():
    """reduce_bucket_size "auto" is hidden_size**2 (the HF Trainer's rule): a transformers model says its
    hidden size; a plain module does not, and the error names the key and what to give."""
    config = with_change(lambda c: c["zero_optimization"].update(reduce_bucket_size="auto"))
    engine, *_ = zero.initialize(model=tiny_gpt2(0), config=config)
    assert engine.config.zero_optimization.reduce_bucket_size == 32 * 32
    engine.close()
    with pytest.raises(UnresolvedAutoError, match="hidden_size") as info:
        zero.initialize(model=tied_blocks(0), config=config)
    assert info.value.key == "zero_optimization.reduce_bucket_size"


def test_config_file_path_and_duplicate_keys(tmp_path):
    """A ds_config.json path works like the dict; a key written twice in one object is an error."""
    good = tmp_path / "ds_config.json"
    good.write_text(json.dumps(make_config(1, "cpu", accum=2)))
    engine, *_ = zero.initialize(model=tied_blocks(0), config=str(good))
    assert engine.gradient_accumulation_steps() == 2 and engine.stage == 1
    engine.close()
    duplicate = tmp_path / "duplicate.json"
    duplicate.write_text('{"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "gradient_clipping": 2.0}')
    with pytest.raises(ConfigError) as info:
        zero.initialize(model=tied_blocks(0), config=str(duplicate))
    assert info.value.key == "gradient_clipping"


def test_failed_initialize_leaves_no_nvme_file(tmp_path):
    """A host budget smaller than any one sub-group's master (4 KiB: no segment can pass through host) fails
    at initialize with the sizes in the message (below the host minimum: before any segment is registered), and
    leaves nothing in nvme_path (the file would outlive the process until another store on that path sweeps it)."""
    config = make_config(2, "nvme", nvme_path=tmp_path, zero_tiering={"host_budget": "4KiB"})
    with pytest.raises(ConfigError, match=r"host_budget.*4.0 KiB is below the .* raise it to at least \d+ bytes"):
        zero.initialize(model=tiny_gpt2(0), config=config)
    assert not list(tmp_path.iterdir())
