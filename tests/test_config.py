"""zero.config: DeepSpeed-format configs load unchanged where supported; every bad one names its key."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tiering.aio_config import AioConfig
from zero.config import (
    Config,
    ConfigError,
    OffloadParamConfig,
    TrainingArgs,
    UnknownKeyError,
    UnresolvedAutoError,
    UnsupportedKeyError,
    WarmupDecayLRParams,
    format_size,
    load_config,
    parse_size,
    read_json,
)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
EXAMPLES = {"zero3_nvme.json": 3, "zero3_cpu.json": 3, "zero2_cpu.json": 2, "zero1.json": 1, "no_offload.json": 0}

# What the Hugging Face Trainer docs tell users to write for ZeRO-3 with offload (every "auto" it fills).
HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                             "total_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": "auto",
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
HF_ARGS = TrainingArgs(
    per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=1.0, learning_rate=3e-4,
    adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.01, warmup_steps=100,
    num_training_steps=1000, fp16=False, bf16=True, zero3_save_16bit_model=True,
)


def with_keys(base: dict, **updates: object) -> dict:
    """A deep copy of `base` with keys set by path, `__` separating levels (zero_optimization__stage=3)."""
    config = copy.deepcopy(base)
    for dotted, value in updates.items():
        *parents, leaf = dotted.split("__")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return config


MINIMAL = {"train_batch_size": 8}


# ------------------------------------------------------------------------------------------------------
# Configs that load


def test_every_example_config_is_there():
    assert EXAMPLES.keys() <= {path.name for path in CONFIGS.glob("*.json")}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.json")), ids=lambda p: p.name)
def test_every_config_in_configs_loads(path: Path):
    config = load_config(path)
    assert isinstance(config, Config)
    assert (config.train_batch_size
            == config.train_micro_batch_size_per_gpu * config.gradient_accumulation_steps)
    assert isinstance(config.to_aio_config(), AioConfig)
    if path.name in EXAMPLES:
        assert config.zero_optimization.stage == EXAMPLES[path.name]
    assert load_config(path, world_size=2).train_batch_size % 2 == 0


def test_nvme_example_puts_state_on_nvme_with_our_section():
    config = load_config(CONFIGS / "zero3_nvme.json")
    zero = config.zero_optimization
    assert (zero.offload_param.device, zero.offload_optimizer.device) == ("nvme", "nvme")
    assert zero.offload_param.nvme_path == "/tmp/zero_tiering_nvme"
    assert zero.prefetch_bucket_size == 50_000_000 and isinstance(zero.prefetch_bucket_size, int)
    assert config.zero_tiering.host_budget == 32 << 30
    assert config.zero_tiering.nvme_budget == 1 << 40


def test_hf_trainer_config_resolves_every_auto():
    config = load_config(HF_ZERO3, world_size=2, hidden_size=768, args=HF_ARGS)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps) == (2 * 4 * 2, 4, 2)
    assert config.gradient_clipping == 1.0
    assert (config.fp16.enabled, config.bf16.enabled) == (False, True)
    params = config.optimizer.params
    assert (params.lr, params.betas, params.eps, params.weight_decay) == (3e-4, (0.9, 0.95), 1e-8, 0.01)
    sched = config.scheduler.params
    assert isinstance(sched, WarmupDecayLRParams)
    assert (sched.warmup_min_lr, sched.warmup_max_lr, sched.warmup_num_steps, sched.total_num_steps) == (
        0.0, 3e-4, 100, 1000)
    zero = config.zero_optimization
    assert zero.reduce_bucket_size == 768 * 768
    assert zero.prefetch_bucket_size == int(0.9 * 768 * 768)
    assert zero.param_persistence_threshold == 10 * 768
    assert zero.gather_16bit_weights_on_model_save is True
    assert config.ignored == ("steps_per_print", "wall_clock_breakdown")


def test_loading_does_not_modify_the_callers_dict():
    before = copy.deepcopy(HF_ZERO3)
    load_config(HF_ZERO3, hidden_size=64, args=HF_ARGS)
    assert HF_ZERO3 == before


def test_batch_autos_without_args_follow_deepspeeds_derivation():
    config = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
                          "gradient_accumulation_steps": "auto"}, world_size=4)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps) == (8, 2, 1)


@settings(max_examples=100, deadline=None)
@given(micro=st.integers(1, 64), accum=st.integers(1, 16), world=st.integers(1, 8),
       given_keys=st.sets(st.sampled_from(["train", "micro", "accum"]), min_size=1))
def test_any_sufficient_subset_of_batch_sizes_derives_the_rest(micro, accum, world, given_keys):
    assume(given_keys != {"accum"})
    full = {"train": micro * accum * world, "micro": micro, "accum": accum}
    # DeepSpeed's rule: with only one of train / micro given, accumulation is 1.
    if "accum" not in given_keys and len(given_keys) == 1:
        full = ({"train": micro * accum * world, "micro": micro * accum, "accum": 1} if "train" in given_keys
                else {"train": micro * world, "micro": micro, "accum": 1})
    names = {"train": "train_batch_size", "micro": "train_micro_batch_size_per_gpu",
             "accum": "gradient_accumulation_steps"}
    config = load_config({names[k]: full[k] for k in given_keys}, world_size=world)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps) == (full["train"], full["micro"], full["accum"])


def test_integral_floats_from_json_become_ints():
    config = load_config(with_keys(MINIMAL, zero_optimization__reduce_bucket_size=5e8,
                                   zero_optimization__stage=3.0))
    assert config.zero_optimization.reduce_bucket_size == 500_000_000
    assert type(config.zero_optimization.reduce_bucket_size) is int
    assert config.zero_optimization.stage == 3


@pytest.mark.parametrize("prefixed, plain, field", [
    ("stage3_prefetch_bucket_size", "prefetch_bucket_size", "prefetch_bucket_size"),
    ("stage3_param_persistence_threshold", "param_persistence_threshold", "param_persistence_threshold"),
    ("stage3_max_live_parameters", "max_live_parameters", "max_live_parameters"),
    ("stage3_max_reuse_distance", "max_reuse_distance", "max_reuse_distance"),
    ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
     "gather_16bit_weights_on_model_save"),
])
def test_stage3_aliases(prefixed: str, plain: str, field: str):
    value, other = (True, False) if field.startswith("gather") else (12345, 678)
    for spelled in ({prefixed: value}, {plain: value}, {prefixed: value, plain: value}):
        zero = load_config({**MINIMAL, "zero_optimization": {"stage": 3, **spelled}}).zero_optimization
        assert getattr(zero, field) == value
    with pytest.raises(ConfigError) as err:
        load_config({**MINIMAL, "zero_optimization": {"stage": 3, prefixed: value, plain: other}})
    assert err.value.key == f"zero_optimization.{plain}"
    assert f"zero_optimization.{prefixed}" in str(err.value)


def test_aio_maps_onto_tiering_with_the_engine_from_our_section():
    config = load_config(with_keys(MINIMAL, aio={"block_size": 1 << 20, "thread_count": 2, "queue_depth": 8},
                                   zero_tiering={"engine": "threads"}))
    aio = config.to_aio_config()
    assert (aio.engine, aio.block_size, aio.intra_op_parallelism, aio.queue_depth) == ("threads", 1 << 20, 2, 8)
    assert aio.overlap_events == AioConfig().overlap_events  # not written: tiering's default


def test_optimizer_type_is_case_insensitive_and_adam_defaults_to_decoupled_decay():
    adam = load_config(with_keys(MINIMAL, optimizer={"type": "adam"})).optimizer
    assert adam.type == "Adam" and adam.decoupled_weight_decay
    classic = load_config(with_keys(MINIMAL, optimizer={"type": "Adam", "params": {"adam_w_mode": False}}))
    assert not classic.optimizer.decoupled_weight_decay
    adamw = load_config(with_keys(MINIMAL, optimizer={"type": "ADAMW", "params": {"adam_w_mode": False}}))
    assert adamw.optimizer.type == "AdamW" and adamw.optimizer.decoupled_weight_decay


def test_unsupported_keys_at_their_off_value_load():
    config = load_config({
        **MINIMAL,
        "amp": {"enabled": False, "opt_level": "O1"},
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                     "contiguous_memory_optimization": False, "number_checkpoints": None,
                                     "synchronize_checkpoint_boundary": False, "profile": False},
        "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1, "zero_quantized_weights": False,
                              "offload_optimizer": {"device": "cpu", "ratio": 1.0}},
        "aio": {"use_gds": False},
    })
    assert config.zero_optimization.stage == 3


def test_deepspeed_chat_s_hybrid_engine_section_is_accepted():
    """DeepSpeed-Chat's actor config (dschat/utils/ds_utils.py): generation runs through the ZeRO-3 units either way;
    the kernel settings are reported as ignored."""
    config = load_config({**MINIMAL, "hybrid_engine": {
        "enabled": True, "max_out_tokens": 512, "inference_tp_size": 1, "release_inference_cache": False,
        "pin_parameters": True, "tp_gather_partition_size": 8}})
    assert config.hybrid_engine.enabled
    assert set(config.ignored) == {f"hybrid_engine.{k}" for k in (
        "max_out_tokens", "release_inference_cache", "pin_parameters", "tp_gather_partition_size")}


def test_deepspeed_s_newer_keys_are_known():
    """DeepSpeed's later keys: served, refused by name, or named as ignored where they change nothing here; never
    'unknown'."""
    config = load_config({**MINIMAL, "zero_optimization": {
        "stage": 3, "stage3_allgather_sequential": True, "enable_sanity_checks": True,
        "leaf_module": {"classes": ["MixtralSparseMoeBlock"]}, "save_muon_momentum_buffer_in_memory": False}})
    assert set(config.ignored) == {"zero_optimization.stage3_allgather_sequential",
                                   "zero_optimization.enable_sanity_checks", "zero_optimization.leaf_module"}
    config = load_config({**MINIMAL, "dataloader_drop_last": True, "gradient_allreduce_op": "mean",
                          "use_data_before_expert_parallelism": False, "seq_parallel_communication_data_type": "fp32",
                          "checkpoint": {"parallel_write": {"pipeline_stage": False}}})
    assert config.dataloader_drop_last
    assert set(config.ignored) == {"seq_parallel_communication_data_type", "checkpoint.parallel_write"}
    with pytest.raises(UnsupportedKeyError, match="summed over ranks"):
        load_config({**MINIMAL, "gradient_allreduce_op": "sum"})


def test_monitoring_keys_are_accepted_and_reported_as_ignored():
    config = load_config({**MINIMAL, "tensorboard": {"enabled": True, "output_path": "/tmp/tb"},
                          "wandb": {"enabled": False}, "flops_profiler": {"enabled": True},
                          "zero_optimization": {"stage": 2, "round_robin_gradients": True}})
    assert set(config.ignored) == {"tensorboard", "wandb", "flops_profiler", "zero_optimization.round_robin_gradients"}


def test_overlap_comm_defaults_like_deepspeed():
    assert load_config(with_keys(MINIMAL, zero_optimization={"stage": 3})).zero_optimization.overlap_comm
    assert not load_config(with_keys(MINIMAL, zero_optimization={"stage": 2})).zero_optimization.overlap_comm


def test_collective_timeout_is_seconds_defaulting_to_ten_minutes():
    assert load_config(MINIMAL).zero_tiering.collective_timeout == 600.0
    timeout = load_config(with_keys(MINIMAL, zero_tiering={"collective_timeout": 7})).zero_tiering.collective_timeout
    assert timeout == 7.0 and isinstance(timeout, float)


def test_a_config_file_on_disk(tmp_path: Path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(with_keys(MINIMAL, zero_optimization={"stage": 2})))
    assert load_config(str(path)).zero_optimization.stage == 2


# ------------------------------------------------------------------------------------------------------
# Configs that fail, each naming the key

NVME = {"device": "nvme", "nvme_path": "/tmp/zero_tiering_nvme"}

BAD = [
    # unknown keys: the message has the closest known key
    ("unknown top-level", with_keys(MINIMAL, gradient_clip=1.0), UnknownKeyError,
     "gradient_clip", "gradient_clipping"),
    ("unknown nested", with_keys(MINIMAL, zero_optimization={"stage": 3, "stage3_prefetch_bucket": 1}),
     UnknownKeyError, "zero_optimization.stage3_prefetch_bucket", "stage3_prefetch_bucket_size"),
    ("unknown in offload", with_keys(MINIMAL, zero_optimization={"stage": 3, "offload_param": {
        "device": "cpu", "pin_memroy": True}}), UnknownKeyError,
     "zero_optimization.offload_param.pin_memroy", "pin_memory"),
    ("unknown in our section", with_keys(MINIMAL, zero_tiering={"host_budgett": "1GiB"}), UnknownKeyError,
     "zero_tiering.host_budgett", "host_budget"),
    # wrong type
    ("stage as string", with_keys(MINIMAL, zero_optimization={"stage": "3"}), ConfigError,
     "zero_optimization.stage", "'3'"),
    ("bool for a number", with_keys(MINIMAL, gradient_clipping=True), ConfigError, "gradient_clipping", "True"),
    ("number for a bool", with_keys(MINIMAL, fp16={"enabled": 1}), ConfigError, "fp16.enabled", "true or false"),
    ("fractional int", with_keys(MINIMAL, zero_optimization={"sub_group_size": 1.5}), ConfigError,
     "zero_optimization.sub_group_size", "1.5"),
    ("section not an object", with_keys(MINIMAL, zero_optimization=3), ConfigError, "zero_optimization", "object"),
    ("bad device", with_keys(MINIMAL, zero_optimization={"stage": 3, "offload_param": {"device": "disk"}}),
     ConfigError, "zero_optimization.offload_param.device", "'none', 'cpu', 'nvme'"),
    ("bad size string", with_keys(MINIMAL, zero_tiering={"host_budget": "2 gigs"}), ConfigError,
     "zero_tiering.host_budget", "2GiB"),
    ("bad engine", with_keys(MINIMAL, zero_tiering={"engine": "io_uring"}), ConfigError,
     "zero_tiering.engine", "'libaio'"),
    # out of range
    ("negative bucket", with_keys(MINIMAL, zero_optimization={"reduce_bucket_size": -1}), ConfigError,
     "zero_optimization.reduce_bucket_size", ">= 0"),
    ("zero collective timeout", with_keys(MINIMAL, zero_tiering={"collective_timeout": 0}), ConfigError,
     "zero_tiering.collective_timeout", "> 0"),
    ("negative collective timeout", with_keys(MINIMAL, zero_tiering={"collective_timeout": -5}), ConfigError,
     "zero_tiering.collective_timeout", "> 0"),
    ("collective timeout as string", with_keys(MINIMAL, zero_tiering={"collective_timeout": "10s"}), ConfigError,
     "zero_tiering.collective_timeout", "a number"),
    ("beta of 1", with_keys(MINIMAL, optimizer={"type": "AdamW", "params": {"betas": [0.9, 1.0]}}),
     ConfigError, "optimizer.params.betas", "[0, 1)"),
    ("zero loss-scale window", with_keys(MINIMAL, fp16={"enabled": True, "loss_scale_window": 0}),
     ConfigError, "fp16.loss_scale_window", ">= 1"),
    ("aio block size (tiering's rule)", with_keys(MINIMAL, aio={"block_size": 1000}), ConfigError,
     "aio.block_size", "4096"),
    ("aio old name, tiering's rule", with_keys(MINIMAL, aio={"thread_count": 0}), ConfigError,
     "aio.thread_count", "1..1024"),
    # nvme without nvme_path
    ("nvme params without path", with_keys(MINIMAL, zero_optimization={"stage": 3, "offload_param": {
        "device": "nvme"}}), ConfigError, "zero_optimization.offload_param.nvme_path", "nvme"),
    ("nvme optimizer without path", with_keys(MINIMAL, zero_optimization={"stage": 2, "offload_optimizer": {
        "device": "nvme", "nvme_path": ""}}), ConfigError, "zero_optimization.offload_optimizer.nvme_path", "nvme"),
    # nvme_path as a list of directories (our extension): not empty, strings, each directory once
    ("empty nvme_path list", with_keys(MINIMAL, zero_optimization={"stage": 3, "offload_param": {
        "device": "nvme", "nvme_path": []}}), ConfigError, "zero_optimization.offload_param.nvme_path",
     "[]: an empty list names no directory"),
    ("nvme_path list of non-strings", with_keys(MINIMAL, zero_optimization={"stage": 2, "offload_optimizer": {
        "device": "nvme", "nvme_path": ["/mnt/nvme0", 1]}}), ConfigError,
     "zero_optimization.offload_optimizer.nvme_path", "['/mnt/nvme0', 1]: expected a directory path"),
    ("nvme_path list naming a directory twice", with_keys(MINIMAL, zero_optimization={"stage": 2, "offload_optimizer": {
        "device": "nvme", "nvme_path": ["/mnt/nvme0", "/mnt/nvme0/"]}}), ConfigError,
     "zero_optimization.offload_optimizer.nvme_path", "names the directory '/mnt/nvme0' twice"),
    ("nvme_path neither string nor list", with_keys(MINIMAL, zero_optimization={"stage": 2, "offload_optimizer": {
        "device": "nvme", "nvme_path": {"dir": "/mnt"}}}), ConfigError,
     "zero_optimization.offload_optimizer.nvme_path", "a string or a list"),
    # DeepSpeed keys we do not support
    ("hpZ", with_keys(MINIMAL, zero_optimization={"stage": 3, "zero_hpz_partition_size": 8}),
     UnsupportedKeyError, "zero_optimization.zero_hpz_partition_size", "does not support"),
    ("quantized weights", with_keys(MINIMAL, zero_optimization={"stage": 3, "zero_quantized_weights": True}),
     UnsupportedKeyError, "zero_optimization.zero_quantized_weights", "does not support"),
    ("masters from model weights", with_keys(MINIMAL, zero_optimization={"stage": 3, "load_from_fp32_weights": False}),
     UnsupportedKeyError, "zero_optimization.load_from_fp32_weights", "does not support"),
    ("ZenFlow", with_keys(MINIMAL, zero_optimization={"stage": 2, "zenflow": {"topk_ratio": 0.1}}),
     UnsupportedKeyError, "zero_optimization.zenflow", "DeepSpeed ZenFlow"),
    ("hybrid engine over tensor-parallel ranks",
     with_keys(MINIMAL, hybrid_engine={"enabled": True, "inference_tp_size": 2}), UnsupportedKeyError, "hybrid_engine.inference_tp_size", "tensor parallelism in generation"),
    ("partial optimizer offload", with_keys(MINIMAL, zero_optimization={"stage": 3, "offload_optimizer": {
        "device": "cpu", "ratio": 0.3}}), UnsupportedKeyError, "zero_optimization.offload_optimizer.ratio",
     "set it to 1.0"),
    ("offload ratio above 1", with_keys(MINIMAL, zero_optimization={"stage": 3, "offload_optimizer": {
        "device": "cpu", "ratio": 1.5}}), UnsupportedKeyError, "zero_optimization.offload_optimizer.ratio",
     "set it to 1.0"),
    ("node-local checkpoints", with_keys(MINIMAL, checkpoint={"use_node_local_storage": True}),
     UnsupportedKeyError, "checkpoint.use_node_local_storage", "does not support"),
    ("apex amp", with_keys(MINIMAL, amp={"enabled": True, "opt_level": "O2"}), UnsupportedKeyError, "amp",
     "does not support"),
    ("activation partitioning", with_keys(MINIMAL, activation_checkpointing={"partition_activations": True}),
     UnsupportedKeyError, "activation_checkpointing.partition_activations", "no model parallelism"),
    ("contiguous checkpoints", with_keys(MINIMAL, activation_checkpointing={"contiguous_memory_optimization": True}),
     UnsupportedKeyError, "activation_checkpointing.contiguous_memory_optimization", "does not support"),
    ("activation key typo", with_keys(MINIMAL, activation_checkpointing={"cpu_checkpoint": True}),
     UnknownKeyError, "activation_checkpointing.cpu_checkpoint", "cpu_checkpointing"),
    ("activation offload twice", with_keys(MINIMAL, activation_checkpointing={"cpu_checkpointing": True},
                                           zero_tiering={"activation_offload": "nvme"}),
     ConfigError, "zero_tiering.activation_offload", "cpu_checkpointing asks for host memory"),
    ("activation offload choice", with_keys(MINIMAL, zero_tiering={"activation_offload": "gpu"}),
     ConfigError, "zero_tiering.activation_offload", "gpu"),
    ("compression", with_keys(MINIMAL, compression_training={"weight_quantization": {}}), UnsupportedKeyError,
     "compression_training", "does not support"),
    ("pipeline", with_keys(MINIMAL, pipeline={"stages": "auto"}), UnsupportedKeyError, "pipeline",
     "does not support"),
    ("GDS with nvme", with_keys(MINIMAL, zero_optimization={"stage": 3, "offload_optimizer": NVME},
                                aio={"use_gds": True}), UnsupportedKeyError, "aio.use_gds", "does not support"),
    ("optimizer type", with_keys(MINIMAL, optimizer={"type": "Lamb"}), UnsupportedKeyError, "optimizer.type",
     "'Adam', 'AdamW'"),
    ("amsgrad", with_keys(MINIMAL, optimizer={"type": "Adam", "params": {"amsgrad": True}}),
     UnsupportedKeyError, "optimizer.params.amsgrad", "does not support"),
    ("schedule type", with_keys(MINIMAL, scheduler={"type": "OneCycle", "params": {}}), UnsupportedKeyError,
     "scheduler.type", "WarmupCosineLR"),
    ("deprecated cpu_offload beside offload_optimizer", with_keys(MINIMAL, zero_optimization={
        "stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}),
     ConfigError, "zero_optimization.cpu_offload", "keep one of the two"),
    ("deprecated cpu_offload_param", with_keys(MINIMAL, zero_optimization={"stage": 3, "cpu_offload_param": True}),
     UnsupportedKeyError, "zero_optimization.cpu_offload_param", "offload_param"),
    # "auto" that cannot be resolved
    ("auto bucket without hidden size", with_keys(MINIMAL, zero_optimization={"stage": 3,
                                                                               "reduce_bucket_size": "auto"}),
     UnresolvedAutoError, "zero_optimization.reduce_bucket_size", "hidden_size"),
    ("auto lr without args", with_keys(MINIMAL, optimizer={"type": "AdamW", "params": {"lr": "auto"}}),
     UnresolvedAutoError, "optimizer.params.lr", "learning_rate"),
    ("auto total steps", with_keys(MINIMAL, scheduler={"type": "WarmupDecayLR", "params": {
        "total_num_steps": "auto"}}), UnresolvedAutoError, "scheduler.params.total_num_steps",
     "num_training_steps"),
    ("auto no rule knows", with_keys(MINIMAL, zero_optimization={"stage": 3, "stage3_max_live_parameters": "auto"}),
     UnresolvedAutoError, "zero_optimization.stage3_max_live_parameters", "1000000000"),
    ("all batch sizes auto", {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"},
     UnresolvedAutoError, "train_micro_batch_size_per_gpu", "per_device_train_batch_size"),
    # batch-size inconsistency
    ("batch sizes disagree", {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                              "gradient_accumulation_steps": 2}, ConfigError, "train_batch_size", "4 * 2 * 1 = 8"),
    ("batch not divisible", {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, ConfigError,
     "train_batch_size", "not divisible"),
    ("no batch size", {"gradient_accumulation_steps": 2}, ConfigError, "train_batch_size", "missing"),
    ("zero micro batch", {"train_micro_batch_size_per_gpu": 0}, ConfigError, "train_micro_batch_size_per_gpu",
     ">= 1"),
    # keys that contradict each other
    ("fp16 and bf16", with_keys(MINIMAL, fp16={"enabled": True}, bf16={"enabled": True}), ConfigError,
     "bf16.enabled", "both"),
    ("required schedule key", with_keys(MINIMAL, scheduler={"type": "WarmupCosineLR", "params": {}}),
     ConfigError, "scheduler.params.total_num_steps", "required"),
]


@pytest.mark.parametrize("name, config, error, key, detail", BAD, ids=[case[0] for case in BAD])
def test_bad_config_fails_naming_the_key(name, config, error, key, detail):
    with pytest.raises(error) as raised:
        load_config(config)
    assert raised.value.key == key
    message = str(raised.value)
    assert message.startswith(key) and detail in message, message


def test_unsupported_message_says_deepspeed_key():
    with pytest.raises(UnsupportedKeyError, match="a DeepSpeed key zero-tiering does not support"):
        load_config(with_keys(MINIMAL, sparse_gradients=True))


def test_explicit_value_that_contradicts_the_training_arguments_fails():
    config = with_keys(HF_ZERO3, optimizer__params__lr=1e-3)
    with pytest.raises(ConfigError, match=r"optimizer\.params\.lr = 0\.001: disagrees") as raised:
        load_config(config, hidden_size=64, args=HF_ARGS)
    assert raised.value.key == "optimizer.params.lr"


def test_auto_for_a_model_fact_is_fine_once_given():
    config = with_keys(MINIMAL, zero_optimization={"stage": 3, "reduce_bucket_size": "auto"})
    assert load_config(config, hidden_size=16).zero_optimization.reduce_bucket_size == 256


def test_duplicate_keys_in_a_file_fail(tmp_path: Path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ConfigError, match="train_batch_size: appears twice"):
        load_config(path)


def test_a_config_with_comments_and_trailing_commas_loads_as_deepspeed_reads_it(tmp_path: Path):
    """DeepSpeed reads its config files as hjson: the same file here gives the same config as its strict JSON,
    and a key twice is still an error."""
    strict = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.9, 0.95]}},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    path = tmp_path / "ds_config.json"
    path.write_text("""{
      // ZeRO-3 with the parameters on the CPU
      "train_batch_size": 8,  # the global batch
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.9, 0.95,],},},
      /* offload */ "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
    }""")
    assert read_json(path) == strict
    assert load_config(path) == load_config(strict)
    path.write_text('{"train_batch_size": 8, // once\n "train_batch_size": 16,}')
    with pytest.raises(ConfigError, match="train_batch_size: appears twice"):
        load_config(path)


def test_invalid_json_names_the_file(tmp_path: Path, monkeypatch):
    path = tmp_path / "broken.json"
    path.write_text('{"train_batch_size": [8}')
    with pytest.raises(ConfigError, match="broken.json: not valid JSON"):
        load_config(path)
    monkeypatch.setitem(sys.modules, "hjson", None)  # a machine without hjson (the device machine's install)
    with pytest.raises(ConfigError, match=r"broken.json: not valid JSON: .*line 1 column 24.*pip install hjson"):
        load_config(path)
    path.write_bytes(b"\x7fELF\x02\x01\xff")  # a binary given as --config
    with pytest.raises(ConfigError, match=r"broken.json: not UTF-8 text \(byte 6\)"):
        load_config(path)


def test_nvme_path_may_list_several_directories():
    """A list (our extension) loads as a tuple, a DeepSpeed string as itself; the store gets the directories."""
    zero = load_config(with_keys(MINIMAL, zero_optimization={"stage": 3, "offload_param": {
        "device": "nvme", "nvme_path": ["/mnt/nvme0", "/mnt/nvme1"]}})).zero_optimization
    assert zero.offload_param.nvme_path == ("/mnt/nvme0", "/mnt/nvme1")
    assert load_config(with_keys(MINIMAL, zero_optimization={"stage": 3, "offload_param": NVME})
                       ).zero_optimization.offload_param.nvme_path == NVME["nvme_path"]
    assert OffloadParamConfig(device="nvme", nvme_path=["/a", "/b"]).nvme_path == ("/a", "/b")


def test_sections_built_in_python_are_validated_too():
    with pytest.raises(ConfigError) as raised:
        OffloadParamConfig(device="disk")
    assert raised.value.key == "device"
    with pytest.raises(ConfigError, match="nvme_path"):
        OffloadParamConfig(device="nvme")


def test_config_error_is_a_value_error():
    assert issubclass(UnknownKeyError, ConfigError) and issubclass(ConfigError, ValueError)


# ------------------------------------------------------------------------------------------------------
# Sizes

SCALES = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=1 << 60))
def test_size_format_round_trip(nbytes: int):
    text = format_size(nbytes)
    assert parse_size(text) == nbytes
    assert parse_size(text.lower()) == nbytes


@settings(max_examples=100, deadline=None)
@given(count=st.integers(0, 10**6), unit=st.sampled_from(sorted(SCALES)), space=st.sampled_from(["", " "]))
def test_size_with_unit_is_exact(count: int, unit: str, space: str):
    assert parse_size(f"{count}{space}{unit}") == count * SCALES[unit]


@pytest.mark.parametrize("text, nbytes", [("2GiB", 2 << 30), ("512MB", 512 * 10**6), ("1.5GiB", 3 << 29),
                                          ("1.5KB", 1500), ("4096", 4096), (2e9, 2_000_000_000), (0, 0)])
def test_size_examples(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("bad", ["0.3KiB", "1.5B", "-1", "2XB", "GiB", "", True, -5, 1.5, None])
def test_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_deepspeeds_deprecated_cpu_offload_is_offload_optimizer_on_cpu():
    """DeepSpeed 0.19 still reads `cpu_offload: true` as offload_optimizer on cpu (scripts in its examples set it)."""
    on = load_config(with_keys(MINIMAL, zero_optimization={"stage": 2, "cpu_offload": True}))
    assert on.zero_optimization.offload_optimizer.device == "cpu"
    off = load_config(with_keys(MINIMAL, zero_optimization={"stage": 2, "cpu_offload": False}))
    assert off.zero_optimization.offload_optimizer.device == "none"


def test_offload_param_below_stage_3_is_ignored_with_a_warning_as_deepspeed_ignores_it():
    config = with_keys(MINIMAL, zero_optimization={"stage": 2, "offload_param": {"device": "cpu"},
                                                   "offload_optimizer": {"device": "cpu"}})
    with pytest.warns(UserWarning, match=r"zero_optimization.offload_param \(device 'cpu'\) is read at stage 3 only"):
        loaded = load_config(config)
    assert loaded.zero_optimization.offload_param.device == "none"
    assert loaded.zero_optimization.offload_optimizer.device == "cpu"
    assert "zero_optimization.offload_param" in loaded.ignored


EFFICIENCY = {"enabled": True, "seed": 1234,
              "data_routing": {"enabled": True, "random_ltd": {"enabled": False}},
              "data_sampling": {"enabled": True, "num_workers": 0, "curriculum_learning": {"enabled": False}}}


@pytest.mark.parametrize("turn_on", [None, "data_routing.random_ltd", "data_sampling.curriculum_learning"])
def test_data_efficiency_is_refused_only_where_it_asks_for_something(turn_on):
    """DeepSpeed's engine acts on `data_efficiency` only through random-LTD or curriculum learning (DeepSpeed's
    data_efficiency templates carry "enabled": true with both off): that config loads; either one on is refused."""
    section = copy.deepcopy(EFFICIENCY)
    if turn_on is None:
        load_config({**MINIMAL, "data_efficiency": section})
        return
    parent, feature = turn_on.split(".")
    section[parent][feature]["enabled"] = True
    with pytest.raises(UnsupportedKeyError, match="data_efficiency.*random-LTD, curriculum learning"):
        load_config({**MINIMAL, "data_efficiency": section})
