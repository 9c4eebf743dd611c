"""`python -m zero.plan`: bytes per tier from the engine's own units and budgets, a chosen config that the engine
takes, and bad input named."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import zero
from zero.config import load_config
from zero.plan.__main__ import disk_figures, main, nvme_place, nvme_space, parse_args
from zero.plan.__main__ import plan as plan_with_base
from zero.cli import run_command
from zero.plan.machine import nvme_free, per_thread_count
from zero.plan.model_source import PlanInputError, from_preset
from zero.report.bandwidth import DiskFigures, save_figures

from conftest import child_env
from models import one_thread  # noqa: F401  (autouse fixture)

DISK = ["--disk-read", "2.0", "--disk-write", "2.5"]


def plan(tmp_path, *args: str) -> dict:
    return main(["--model", "tiny", "--nvme-path", str(tmp_path), *DISK, "--json", *args])


def test_every_placement_is_priced_and_the_chosen_config_trains(tmp_path, capsys):
    out = tmp_path / "ds_config.json"
    result = plan(tmp_path, "--out", str(out))
    assert {"predicted_peak_rss_bytes", "predicted_step_s", "predicted_bytes_per_step", "config"} <= result.keys()
    assert len(result["placements"]) == 3 * 3 + 3 * 3  # stages 0-2 x optimizer, stage 3 x params x optimizer
    assert result["fits"] and json.loads(out.read_text()) == result["config"]
    assert "fastest placement that fits" in result["explanation"]
    fastest = min((p for p in result["placements"] if p["fits"]),
                  key=lambda p: (p["predicted_step_s"], p["predicted_peak_rss_bytes"]))  # ties: the smaller
    assert result["placement"] == fastest["placement"]
    load_config(result["config"])  # a valid ds_config
    from zero.train import main as train

    run = train(["--config", str(out), "--preset", "tiny", "--steps", "1", "--nvme-path", str(tmp_path / "n")])
    assert len(run.reports) == 1


def test_bytes_per_tier_are_the_engines(tmp_path):
    """fp32, stage 3, params and optimizer on cpu: the parameter shard is the master, so each (padded) element
    holds 4 bytes of parameter, 8 of moments and 4 of gradient, all on host."""
    shape = from_preset("tiny")
    config = str(tmp_path / "c.json")
    with open(config, "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
            "stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}, f)
    result = plan(tmp_path, "--config", config)
    engine = zero.initialize(model=from_preset("tiny").model, config=config)[0]
    padded = sum(unit.flat.padded_numel for unit in engine.units)
    engine.close()
    assert result["tier_bytes"] == {"device": 0, "host": 16 * padded, "nvme": 0}
    assert padded >= shape.params and result["predicted_bytes_per_step"] == 0


def test_a_machine_too_small_fits_nothing_and_says_why(tmp_path):
    result = plan(tmp_path, "--ram", "256MiB")
    assert not result["fits"] and result["explanation"].startswith("nothing fits")
    assert "RAM" in result["explanation"]


@pytest.mark.parametrize("args, message", [
    (["--model", "9z"], "model '9z': not a preset"),
    (["--model", "tiny", "--ram", "lots"], "--ram 'lots'"),
    (["--model", "tiny", "--ram", "1KiB"], "is not a machine's memory"),
    (["--model", "tiny", "--nvme-path", "/no/such/dir"], "--nvme-path '/no/such/dir': no such directory"),
    (["--model", "tiny", "--disk-read", "-1", "--disk-write", "2"], "--disk-read -1.0"),
    (["--model", "missing.json"], "model 'missing.json': no such file"),
    (["--model", "tiny", "--layers", "0"], "PlanInputError: model 'tiny': GPTConfig.n_layer = 0: must be >= 1"),
    (["--model", "tiny", "--seq-len", "0"], "GPTConfig.seq_len = 0"),
    (["--model", "tiny", "--heads", "5"], "is not a multiple of n_head = 5"),
])
def test_bad_input_is_named(args, message, tmp_path, capsys):
    if "--disk-read" not in args:
        args = [*args, *DISK]
    if "--nvme-path" not in args:
        args = [*args, "--nvme-path", str(tmp_path)]
    with pytest.raises(SystemExit) as info:
        cli(args)
    err = capsys.readouterr().err
    assert info.value.code == 1 and err.startswith("zero.plan: ") and message in err and err.count("\n") == 1, err


def cli(args: list[str]) -> dict:
    """The command as the shell runs it: bad input is one line, `zero.plan: ErrorType: message`, exit status 1."""
    return run_command("zero.plan", main, args, errors=(PlanInputError,))


def test_given_disk_rates_share_the_disks_time_when_mixed(tmp_path):
    """--disk-read / --disk-write: reading and writing at once, the disk's time is shared (their harmonic mean in
    all, as zero.report's mixed rate measures it within tens of percent), not the sum of both."""
    disk = plan(tmp_path)["machine"]["disk"]
    assert disk["mixed_gbps"] == pytest.approx(2 / (1 / 2.0 + 1 / 2.5))


def test_a_config_key_given_twice_is_named(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, '
                    '"gradient_accumulation_steps": 2}')
    with pytest.raises(SystemExit):
        cli(["--model", "tiny", "--config", str(path), *DISK, "--nvme-path", str(tmp_path)])
    assert "zero.plan: ConfigError: gradient_accumulation_steps: appears twice" in capsys.readouterr().err


def test_a_configs_train_batch_size_sets_its_micro_batch(tmp_path):
    """DeepSpeed derives the micro-batch from train_batch_size / (accumulation x ranks): --micro-batch fills in
    only a config that gives neither."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train_batch_size": 16, "gradient_accumulation_steps": 2}))
    result = plan(tmp_path, "--config", str(path), "--micro-batch", "3")
    assert load_config(result["config"]).train_micro_batch_size_per_gpu == 8
    path.write_text(json.dumps({"gradient_accumulation_steps": 2}))
    result = plan(tmp_path, "--config", str(path), "--micro-batch", "3")
    assert load_config(result["config"]).train_micro_batch_size_per_gpu == 3


def test_a_configs_free_disk_is_its_own_nvme_paths(tmp_path, capsys):
    """The free space a config on nvme is checked against is that of its nvme_path (each directory of a list),
    not --nvme-path's."""
    path = tmp_path / "c.json"
    offload = {"device": "nvme", "nvme_path": [str(tmp_path / "a"), str(tmp_path / "b")]}
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "offload_param": offload, "offload_optimizer": offload}}))
    (tmp_path / "a").mkdir()
    with pytest.raises(SystemExit):
        cli(["--model", "tiny", "--config", str(path), *DISK, "--nvme-path", str(tmp_path)])
    assert f"zero_optimization.offload_param.nvme_path {str(tmp_path / 'b')!r}: no such directory" in \
        capsys.readouterr().err
    (tmp_path / "b").mkdir()
    result = main(["--model", "tiny", "--config", str(path), *DISK, "--nvme-path", "/no/such/dir", "--json"])
    assert result["tier_bytes"]["nvme"] > 0


def saved_figures(tmp_path, measured_in: str) -> str:
    """Disk figures as `zero.report --bandwidth DIR` saves them, in a file of the test's (never the user's cache)."""
    file = tmp_path / "machine.json"
    save_figures(DiskFigures(nvme_path=measured_in, read_gbps=2.0, write_gbps=2.5, mixed_gbps=4.0, engine="threads",
                             measured_at="2026-01-01T00:00:00+00:00", bytes=1 << 30), file)
    return str(file)


def test_saved_figures_whose_directory_is_gone_say_so(tmp_path, capsys):
    """No --nvme-path given: the saved figures' directory is where the state goes (they price that disk); one a
    reboot removed is named with the file it came from and how to refresh it, not as a --nvme-path never typed."""
    gone = str(tmp_path / "cleared")
    with pytest.raises(SystemExit):
        cli(["--model", "tiny", "--disk", saved_figures(tmp_path, gone)])
    err = capsys.readouterr().err
    assert f"disk figures {str(tmp_path / 'machine.json')!r} were measured in nvme_path {gone!r}: no such directory" \
        in err and "python -m zero.report --bandwidth DIR" in err and "--nvme-path '" not in err, err


def test_saved_figures_directory_is_where_nvme_placements_keep_state(tmp_path):
    args = parse_args(["--model", "tiny", "--disk", saved_figures(tmp_path, str(tmp_path))])
    assert nvme_place(args, disk_figures(args))[0] == str(tmp_path)
    args = parse_args(["--model", "tiny", "--disk", args.disk, "--nvme-path", "/elsewhere"])
    assert nvme_place(args, disk_figures(args)) == ("/elsewhere", "--nvme-path")


def test_a_file_as_nvme_path_is_not_a_directory(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(PlanInputError, match=f"--nvme-path '{tmp_path / 'file'}': not a directory"):
        nvme_free([str(tmp_path / "file")], "--nvme-path")


def test_a_config_with_nothing_on_nvme_asks_for_no_directory():
    """--config keeping its state on cpu: no nvme directory is looked at (the default one may not exist)."""
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "offload_param": {
        "device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}
    assert nvme_space("/no/such/dir", "--nvme-path", config, 64) is None


def test_a_hugging_face_config_missing_fields_is_named(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": None}))
    with pytest.raises(SystemExit):
        cli(["--model", str(path), *DISK, "--nvme-path", str(tmp_path)])
    assert "zero.plan: PlanInputError: " in capsys.readouterr().err


def test_gpt2s_own_spellings_are_read_from_its_directory(tmp_path):
    """GPT-2's config.json says n_embd / n_layer / n_head; `--model DIR` takes the directory holding it."""
    from transformers import GPT2Config

    GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=256, n_positions=64).save_pretrained(tmp_path / "gpt2")
    result = main(["--model", str(tmp_path / "gpt2"), *DISK, "--nvme-path", str(tmp_path), "--json"])
    assert result["model"]["layers"] == 2 and result["model"]["hidden"] == 64


def test_a_hugging_face_config_and_a_factory_plan(tmp_path):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=256)
    config.save_pretrained(tmp_path)
    llama = main(["--model", str(tmp_path / "config.json"), *DISK, "--nvme-path", str(tmp_path), "--json"])
    assert llama["fits"] and llama["tier_bytes"]["device"] + llama["tier_bytes"]["host"] > 0
    factory = main(["--model", "stage3_models:own_gpt", *DISK, "--nvme-path", str(tmp_path), "--json"])
    assert factory["fits"] and factory["config"]["train_micro_batch_size_per_gpu"] == 4


def test_a_vision_language_model_plans_and_says_what_it_leaves_out(tmp_path, capsys):
    """Its image encoder's compute (per image) is not priced: the model line says so."""
    config = {"model_type": "llava", "text_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                                     "num_hidden_layers": 2, "num_attention_heads": 4,
                                                     "vocab_size": 256},
              "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                                "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 32, "patch_size": 8}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    main(["--model", str(tmp_path), *DISK, "--nvme-path", str(tmp_path), "--seq-len", "16"])
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("model: "))
    assert line.endswith("16 tokens a sequence; its image encoder (0.0M parameters) is stored and stepped, its "
                         "compute (per image) not priced")


def test_the_command_runs(tmp_path):
    done = subprocess.run([sys.executable, "-m", "zero.plan", "--model", "tiny", *DISK, "--nvme-path",
                           str(tmp_path)], env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "fastest placement that fits" in done.stdout and "peak RSS" in done.stdout


def test_activations_are_counted_where_they_rest(tmp_path):
    """bf16 on an 80 GiB GPU, 6 layers, seq 2048, micro-batch 2, one placement: checkpointing keeps each block's input
    (tokens x hidden x 2 bytes) and one block's recomputation on the device; offloaded to cpu, the inputs but two
    leave the device for the host tier; to nvme with no host room set aside, they are written and read back."""
    shape = from_preset("tiny")
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                                  "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
                                                        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}},
                                  "zero_tiering": {"activation_host_bytes": 0}}))
    layers = 6
    common = ["--config", str(config), "--layers", str(layers), "--seq-len", "2048", "--gpu-memory", "80GiB",
              "--precision", "bf16"]
    kept = plan(tmp_path, *common, "--activation-checkpointing")
    cpu = plan(tmp_path, *common, "--activation-offload", "cpu")
    nvme = plan(tmp_path, *common, "--activation-offload", "nvme")
    inputs = 2 * 2048 * shape.hidden * 2  # one block's input
    assert kept["predicted_device_peak_bytes"] - cpu["predicted_device_peak_bytes"] == (layers - 2) * inputs
    assert nvme["predicted_device_peak_bytes"] == cpu["predicted_device_peak_bytes"]
    assert nvme["predicted_bytes_per_step"] - cpu["predicted_bytes_per_step"] == 2 * layers * inputs


def test_a_config_on_nvme_without_disk_figures_is_named(tmp_path, capsys):
    config = tmp_path / "nvme.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}))
    with pytest.raises(SystemExit) as info:
        cli(["--model", "tiny", "--config", str(config), "--nvme-path", str(tmp_path),
             "--disk", str(tmp_path / "no-figures.json")])
    assert info.value.code == 1 and "puts state on nvme, and there are no disk figures" in capsys.readouterr().err


def test_compact_bytes_per_tier_are_the_engines(tmp_path):
    """int8 moments, stage 3, params and optimizer on cpu: 4 bytes of parameter (the master) and 4 of gradient per
    element, and the moments as the engine's sub-groups store them (block-wise int8, fp32 under 4096 elements)."""
    config = str(tmp_path / "c.json")
    with open(config, "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": 2, "zero_tiering": {"moments": "int8"}, "zero_optimization": {
            "stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}, f)
    result = plan(tmp_path, "--config", config)
    engine = zero.initialize(model=from_preset("tiny").model, config=config)[0]
    padded = sum(unit.flat.padded_numel for unit in engine.units)
    moments = sum(engine.swap.segments[sg.segment(part)].nbytes for sg in engine.driver.sub_groups
                  for part in ("exp_avg", "exp_avg_sq"))
    engine.close()
    assert moments < 8 * padded / 3  # int8 where it counts
    assert result["tier_bytes"] == {"device": 0, "host": 8 * padded + moments, "nvme": 0}
    assert "int8 moments, fp32 master" in result["placement"]


def test_where_exact_state_fits_nowhere_a_compact_format_is_proposed(tmp_path):
    """No disk figures (cpu placements only) and a RAM between what exact state and int8 moments need: the plan
    chooses int8 moments and says what it trades."""
    def run(*args: str) -> dict:  # the same base RSS every call: this process's grows as the suite runs
        return plan_with_base(parse_args(["--model", "small", "--json", *args]), 300 << 20)

    exact = min(p["predicted_peak_rss_bytes"] for p in run("--ram", "1TiB")["placements"])
    compact = min(p["predicted_peak_rss_bytes"] for p in run("--ram", "1TiB", "--moments", "int8")["placements"])
    assert compact < exact
    result = run("--ram", str(int((exact + compact) / 2 / 0.9)))
    assert result["fits"] and "int8 moments" in result["placement"]
    assert "Exact fp32 state fits nowhere" in result["explanation"] and "price in loss" in result["explanation"]
    assert result["config"]["zero_tiering"]["moments"] == "int8"
    load_config(result["config"])


def test_speculation_counts_the_room_its_kept_extents_need():
    """A sub-group steps early only where its previous state fits a fresh extent (tiering/kept.py): the share of a
    step's nvme writes the nvme budget, or the disk's free space less its reserve, holds beside what is stored."""
    from zero.plan.predict import speculated_share
    from tiering.nvme_store import RESERVE_MAX

    budgeted = load_config({"train_micro_batch_size_per_gpu": 1, "zero_tiering": {"nvme_budget": 100 << 20}})
    assert speculated_share(budgeted, 60 << 20, 80 << 20, None) == 0.5
    assert speculated_share(budgeted, 100 << 20, 80 << 20, None) == 0.0
    plain = load_config({"train_micro_batch_size_per_gpu": 1})
    free = 100 << 30
    assert speculated_share(plain, 60 << 30, 76 << 30, free) == ((40 << 30) - RESERVE_MAX) / (76 << 30)
    assert speculated_share(plain, 1 << 30, 2 << 30, free) == 1.0
    assert speculated_share(plain, 1 << 30, 2 << 30, None) == 1.0


def test_on_a_cpu_device_the_speculated_step_counts_the_checksums_beside_the_compute(tmp_path):
    """Without a GPU the compute and the I/O's CPU work share the cores: with checksums on (the default), the
    speculated step counts one pass of the checksum over every byte read or written; off, none."""
    from zero.plan.__main__ import disk_figures
    from zero.plan.machine import Machine
    from zero.plan.predict import predict

    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3, "offload_param": nvme, "offload_optimizer": nvme}}
    args = parse_args(["--model", "tiny", "--nvme-path", str(tmp_path), *DISK])
    machine = Machine(ram_bytes=64 << 30, gpu_bytes=0, disk=disk_figures(args), matmul_flops=1e11,
                      adam_elements=1e8, copy_bytes=1e10, fresh_bytes=1e10, checksum_bytes=1e6, compact_adam={})
    on = predict(from_preset("tiny"), machine, config, 0, None)
    off = predict(from_preset("tiny"), machine, {**config, "zero_tiering": {"checksums": False}}, 0, None)
    assert on.bytes_per_step == off.bytes_per_step > 0
    assert on.step_s >= on.bytes_per_step / 1e6 > off.step_s


def test_below_stage_3_autograds_gradients_are_where_the_device_is():
    """Below stage 3 the resident parameters' gradients, as autograd leaves them, are in the device's memory: in
    the host's RSS where the device is the CPU, in the device peak (not the RSS) with a GPU."""
    from zero.plan.machine import Machine
    from zero.plan.predict import ALLOCATOR_SLACK, predict

    shape = from_preset("tiny")
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    figures = dict(ram_bytes=64 << 30, disk=None, matmul_flops=1e11, adam_elements=1e8, copy_bytes=1e10,
                   fresh_bytes=1e10, checksum_bytes=1e10, compact_adam={})
    cpu = predict(shape, Machine(gpu_bytes=0, **figures), config, 0, None)
    gpu = predict(shape, Machine(gpu_bytes=80 << 30, **figures), config, 0, None)
    grads = cpu.tier_bytes["device"]  # bf16 parameters on the device; their gradients the same bytes
    assert grads > 0 and gpu.device_peak_bytes - cpu.device_peak_bytes >= grads - (16 << 10)  # pages round the CPU's
    # The CPU device's RSS holds its device tier and the gradients; the GPU machine's holds neither.
    assert abs(cpu.peak_rss_bytes - gpu.peak_rss_bytes - ALLOCATOR_SLACK * (cpu.device_peak_bytes + grads)) <= 1


@pytest.mark.parametrize("gpu_bytes", [0, 80 << 30])
def test_the_unit_the_forward_uses_first_steps_after_the_backward(tmp_path, gpu_bytes):
    """Speculated, the root unit (the embedding's) has its gradient final only when the backward ends: its
    share of the optimizer phase comes after the compute, however long the compute, with or without a GPU."""
    from zero.comm import DataParallel
    from zero.initialize import plan_units
    from zero.optim.param_groups import param_groups_from
    from zero.plan.__main__ import disk_figures
    from zero.plan.machine import Machine
    from zero.plan.predict import predict

    shape = from_preset("tiny")
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3, "offload_param": nvme, "offload_optimizer": nvme}}
    args = parse_args(["--model", "tiny", "--nvme-path", str(tmp_path), *DISK])
    machine = Machine(ram_bytes=64 << 30, gpu_bytes=gpu_bytes, disk=disk_figures(args), matmul_flops=1e7,
                      adam_elements=1e12, copy_bytes=1e12, fresh_bytes=1e12, checksum_bytes=1e12, compact_adam={})
    prediction = predict(shape, machine, config, 0, None)
    flats = [flat for flat, _ in plan_units(shape.model, param_groups_from(shape.model, None, None,
                                                                           load_config(config)), DataParallel())]
    assert flats[0].name == ""  # the root unit: the embedding and the tied head
    tail = flats[0].padded_numel / sum(flat.padded_numel for flat in flats)
    assert prediction.compute_s > 100 * prediction.io_s  # the I/O all but hidden, but for the tail's
    assert prediction.step_s - prediction.compute_s >= 0.99 * tail * prediction.optimizer_s > 0


def test_a_host_budget_below_the_engines_minimum_does_not_fit(tmp_path):
    """The planner never proposes a config initialize would refuse: a host budget below budgets.host_minimum (here
    the tied embedding's head gradient and the staging beside the largest shard) is a why-not."""
    from zero.plan.__main__ import disk_figures
    from zero.plan.machine import Machine
    from zero.plan.predict import predict
    from zero.train.gpt import GPT, PRESETS

    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    args = parse_args(["--model", "tiny", "--nvme-path", str(tmp_path), *DISK])
    machine = Machine(ram_bytes=64 << 30, gpu_bytes=0, disk=disk_figures(args), matmul_flops=1e11,
                      adam_elements=1e8, copy_bytes=1e10, fresh_bytes=1e10, checksum_bytes=1e10, compact_adam={})
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
        "stage": 3, "offload_param": nvme, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(zero.config.ConfigError, match=r"raise it to at least (\d+) bytes") as refused:
        zero.initialize(model=GPT(PRESETS["tiny"]), config={**config, "zero_tiering": {"host_budget": 1}})
    least = int(refused.value.args[0].split("at least ")[-1].split(" bytes")[0])
    short = predict(from_preset("tiny"), machine, {**config, "zero_tiering": {"host_budget": least - 1}}, 0, None)
    enough = predict(from_preset("tiny"), machine, {**config, "zero_tiering": {"host_budget": least}}, 0, None)
    assert not short.fits and any("the engine needs at least" in why for why in short.why_not)
    assert not any("the engine needs at least" in why for why in enough.why_not)


def test_unit_major_accumulation_moves_each_unit_once_and_keeps_every_micro_batchs_inputs(tmp_path):
    """Accumulation 4, stage 3 on nvme, the host budget the engine derives (its working window: no cache):
    unit-major reads each parameter twice a step and its gradient accumulator not at all, writing that once, where
    micro-batch by micro-batch does so 4 times; its device peak holds every micro-batch's block inputs."""
    from zero.comm import DataParallel
    from zero.initialize import plan_units
    from zero.optim.param_groups import param_groups_from
    from zero.plan.__main__ import disk_figures
    from zero.plan.machine import Machine
    from zero.plan.predict import predict

    shape = from_preset("tiny")
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    base = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 3, "offload_param": nvme, "offload_optimizer": nvme},
            "zero_tiering": {"speculative_step": False}}
    args = parse_args(["--model", "tiny", "--nvme-path", str(tmp_path), *DISK])
    machine = Machine(ram_bytes=64 << 30, gpu_bytes=0, disk=disk_figures(args), matmul_flops=1e11,
                      adam_elements=1e8, copy_bytes=1e10, fresh_bytes=1e10, checksum_bytes=1e10,
                      compact_adam={})
    runs = {}
    for schedule in ("unit-major", "micro-batch"):
        config = json.loads(json.dumps(base))
        config["zero_tiering"]["accumulation"] = schedule
        runs[schedule] = predict(shape, machine, config, 0, None, checkpointing=True)
    unit_major, micro = runs["unit-major"], runs["micro-batch"]
    assert (unit_major.schedule, micro.schedule) == ("unit-major", "micro-batch")
    assert unit_major.read_bytes < micro.read_bytes and unit_major.write_bytes < micro.write_bytes
    groups = param_groups_from(shape.model, None, None, load_config(base))
    params = 4 * sum(flat.padded_numel for flat, _ in plan_units(shape.model, groups, DataParallel()))  # fp32
    assert micro.read_bytes - unit_major.read_bytes >= 3 * 2 * params  # 3 more gathers each way
    inputs = shape.layers * 2 * shape.seq_len * shape.hidden * 4  # every block's input, one micro-batch, fp32
    assert unit_major.device_peak_bytes - micro.device_peak_bytes >= 3 * inputs
    assert "unit-major" in json.dumps(unit_major.to_json())


def test_frozen_parameters_are_read_twice_a_step_and_never_written(tmp_path):
    """The tiny preset with its blocks frozen (an adapter's base), stage 3 on nvme, the host budget the engine
    derives (no cache): the frozen bytes are read in the forward and again in the backward, never written, and hold
    no optimizer state; the same model trained whole writes them and their state every step."""
    from zero.plan.__main__ import disk_figures
    from zero.plan.machine import Machine
    from zero.plan.predict import predict

    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3, "offload_param": {**nvme, "max_in_cpu": 0}, "offload_optimizer": nvme,
                                    "stage3_prefetch_bucket_size": 0},
              "zero_tiering": {"speculative_step": False}}
    args = parse_args(["--model", "tiny", "--nvme-path", str(tmp_path), *DISK])
    machine = Machine(ram_bytes=64 << 30, gpu_bytes=0, disk=disk_figures(args), matmul_flops=1e11,
                      adam_elements=1e8, copy_bytes=1e10, fresh_bytes=1e10, checksum_bytes=1e10,
                      compact_adam={})
    whole = predict(from_preset("tiny"), machine, config, 0, None)
    shape = from_preset("tiny")
    for block in shape.model.blocks:
        block.requires_grad_(False)
    base = predict(shape, machine, config, 0, None)
    frozen = 4 * sum(p.numel() for b in shape.model.blocks for p in b.parameters())  # fp32
    assert base.read_bytes >= 2 * frozen
    assert whole.write_bytes - base.write_bytes >= frozen + 3 * frozen  # their weights and fp32 Adam state
    # (each frozen layer's unit padded on its own: a few pages more than the blocks' trained layout)
    from zero.comm import DataParallel
    from zero.initialize import plan_units
    padding = 4 * sum(flat.padded_numel - flat.numel for flat, _ in plan_units(shape.model, [], DataParallel(),
                                                                              frozen="layer") if flat.frozen)
    assert base.tier_bytes["nvme"] < whole.tier_bytes["nvme"] - 3 * frozen + padding


def test_machine_rates_are_measured_once_for_each_thread_count():
    """The rates are cached for the process, but a process that changes torch's thread count between plans gets
    them measured again (CPU-Adam, matmuls and copies all run on torch's threads)."""
    calls = []
    rate = per_thread_count(lambda what: calls.append((torch.get_num_threads(), what)) or len(calls))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert rate("adam") == rate("adam") == 1
        torch.set_num_threads(2)
        assert (rate("adam"), rate("adam"), rate("copy")) == (2, 2, 3)
    finally:
        torch.set_num_threads(threads)
    assert calls == [(1, "adam"), (2, "adam"), (2, "copy")]
