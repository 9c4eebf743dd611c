"""The main job (`python -m zero.train`, the README's first command): its built-in default trains a model
bigger than its device budget with parameters and optimizer state on nvme, reports each step, and learns."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tiering.disk_busy import DiskBusy
from zero.train.corpus import default_corpus, split_held_out
from zero.train import main
from zero.cli import run_command
from zero.config import ConfigError, load_config
from zero.train.run import config_dtype, load_ds_config, model_config, parse_args

from conftest import REPO_ROOT, child_env
from models import one_thread  # noqa: F401  (autouse fixture)
from stage3_models import free_port


def test_default_job_offloads_and_the_held_out_loss_falls(tmp_path, capsys):
    summary = tmp_path / "summary.json"
    run = main(["--steps", "4", "--nvme-path", str(tmp_path / "nvme"), "--summary-json", str(summary)])
    out = capsys.readouterr().out
    assert len(run.reports) == 4 and all(torch.isfinite(torch.tensor(r.loss)) for r in run.reports)
    assert run.held_out_after < run.held_out_before, "four steps at the default settings must learn something"
    assert f"held-out loss: {run.held_out_before:.4f} before training, {run.held_out_after:.4f} after 4 steps" in out
    moved = run.reports[-1].bytes_moved
    assert moved.get("nvme->host", 0) > 0 and moved.get("host->nvme", 0) > 0, "offload did no work"
    assert "step 3: loss" in out and "overlap" in out
    # stdout here is not a terminal: no progress-bar redraws, one line a step
    assert "\r" not in out and [line.split(":")[0] for line in out.splitlines() if line.startswith("step ")] == [
        f"step {n}" for n in range(4)]
    written = json.loads(summary.read_text())
    assert written["held_out_loss"] == [run.held_out_before, run.held_out_after]
    assert [s["step"] for s in written["steps"]] == [0, 1, 2, 3]
    if DiskBusy([str(tmp_path)]).files:  # the nvme device's own busy time, where the kernel says it
        assert all(0 <= s["disk_busy_s"] <= s["step_s"] + 0.05 for s in written["steps"])
        assert "disk busy" in out
    assert not os.listdir(tmp_path / "nvme"), "the swap file outlived the job"


def test_held_out_part_is_never_trained_on_and_a_short_corpus_is_named():
    tokens = torch.arange(1000, dtype=torch.int64)
    train, held = split_held_out(tokens, seq_len=8)
    assert torch.equal(torch.cat([train, held]), tokens) and held.numel() == 50
    with pytest.raises(ValueError, match="30 tokens is too short"):
        split_held_out(tokens[:30], seq_len=16)


def test_the_default_corpus_is_the_standard_librarys_own_sources_in_a_fixed_order(tmp_path, monkeypatch):
    """Installed packages and tests are left out, so the data (and every loss) is the same on every machine with
    the same Python."""
    files = {"b.py": b"B", "a/x.py": b"X", "a/y.txt": b"not source", "site-packages/pkg/p.py": b"P",
             "test/t.py": b"T", "a/tests/u.py": b"U", "a/__pycache__/x.py": b"C", "c/z.py": b"Z"}
    for path, data in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(data)
    monkeypatch.setattr("sysconfig.get_paths", lambda: {"stdlib": str(tmp_path)})
    assert bytes(default_corpus().tolist()) == b"BXZ"  # the root's files, then each directory's, sorted
    assert bytes(default_corpus(limit=2).tolist()) == b"BX"


CONFIGS = sorted(name for name in os.listdir(os.path.join(REPO_ROOT, "configs")) if name.endswith(".json"))


@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_config_trains_the_main_job(name, tmp_path, capsys):
    """Each config under configs/ (stages 0-3, every offload) trains the main job's model, built on meta, for
    two steps."""
    run = main(["--config", os.path.join(REPO_ROOT, "configs", name), "--preset", "tiny", "--steps", "2",
                "--nvme-path", str(tmp_path / "nvme")])
    assert len(run.reports) == 2 and all(torch.isfinite(torch.tensor(r.loss)) for r in run.reports)
    assert "held-out loss" in capsys.readouterr().out


def test_under_torchrun_rank_zero_alone_reports(tmp_path):
    """Two ranks train; the job's lines (model, tiers, steps, held-out loss) are printed once."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
         str(free_port()), "-m", "zero.train", "--preset", "tiny", "--steps", "2", "--nvme-path", str(nvme)],
        env=child_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for line in ("model: ", "tiers: ", "step 1: loss", "held-out loss: "):
        assert done.stdout.count(line) == 1, f"{line!r} printed {done.stdout.count(line)} times:\n{done.stdout}"


def test_nvme_path_takes_one_directory_or_several(tmp_path):
    """One --nvme-path stays DeepSpeed's string; several become the list that stripes the tier; each is made."""
    one = load_ds_config(parse_args(["--nvme-path", str(tmp_path / "a")]))["zero_optimization"]
    assert one["offload_param"]["nvme_path"] == one["offload_optimizer"]["nvme_path"] == str(tmp_path / "a")
    dirs = [str(tmp_path / "b"), str(tmp_path / "c")]
    two = load_ds_config(parse_args(["--nvme-path", *dirs]))["zero_optimization"]
    assert two["offload_param"]["nvme_path"] == two["offload_optimizer"]["nvme_path"] == dirs
    assert all(os.path.isdir(d) for d in [str(tmp_path / "a"), *dirs])


def config_file(tmp_path, text: str) -> list[str]:
    path = tmp_path / "c.json"
    path.write_text(text)
    return ["--config", str(path)]


def test_a_null_section_is_absent_and_a_configs_faults_are_config_errors(tmp_path):
    """A section set to null is absent, as DeepSpeed reads it; the file is read as load_config reads it (a key
    twice, a top level not an object); nvme without a directory names the key that needs one."""
    nulls = '{"train_micro_batch_size_per_gpu": 1, "bf16": null, "fp16": null, "scheduler": null, "optimizer": null, ' \
        '"zero_optimization": null, "zero_tiering": null}'
    config = load_ds_config(parse_args([*config_file(tmp_path, nulls), "--lr", "0.01"]))
    assert config_dtype(config) == torch.float32 and config["optimizer"]["params"]["lr"] == 0.01
    load_config(config)
    for text, key, problem in [
        ("[1, 2]", str(tmp_path / "c.json"), "expected a JSON object"),
        ('{"train_micro_batch_size_per_gpu": 1, "train_micro_batch_size_per_gpu": 2}',
         "train_micro_batch_size_per_gpu", "appears twice"),
        ('{"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}',
         "zero_optimization.offload_param.nvme_path", "required when device is"),
        ('{"optimizer": {"type": "AdamW", "params": [1]}}', "optimizer.params", "expected an object"),
    ]:
        with pytest.raises(ConfigError, match=problem) as info:
            load_ds_config(parse_args(config_file(tmp_path, text)))
        assert info.value.key == key


@pytest.mark.parametrize("scheduler, peak", [
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 2}}, 0.01),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": 0.5}}, 0.01),
    ({"type": "WarmupDecayLR"}, 0.01),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 4}}, None),  # its peak is the optimizer's lr
])
def test_lr_is_the_peak_of_the_warmup(scheduler, peak, tmp_path):
    config = load_ds_config(parse_args([*config_file(tmp_path, json.dumps({"scheduler": scheduler})), "--lr", "0.01"]))
    assert config["optimizer"]["params"]["lr"] == 0.01
    assert config["scheduler"].get("params", {}).get("warmup_max_lr") == peak


def test_a_zero_size_override_is_refused_not_ignored():
    with pytest.raises(ValueError, match="n_layer = 0"):
        model_config(parse_args(["--preset", "tiny", "--layers", "0"]))


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_activation_offload_trains_the_same_steps_as_autograd_keeping_them(offload, tmp_path, capsys):
    """--activation-offload checkpoints every block and offloads its input: the losses are those of
    --activation-checkpointing alone, bit for bit, and each step reports the activations it handed over."""
    common = ["--preset", "tiny", "--steps", "2", "--seq-len", "64", "--nvme-path", str(tmp_path / "nvme")]
    kept = main(common + ["--activation-checkpointing"])
    summary = tmp_path / "summary.json"
    moved = main(common + ["--activation-offload", offload, "--summary-json", str(summary)])
    out = capsys.readouterr().out
    assert [r.loss for r in moved.reports] == [r.loss for r in kept.reports]
    assert kept.reports[0].activations is None
    tiny_input = 4 * 64 * 64 * 2  # micro-batch 4 x 64 tokens x width 64, bf16
    assert all(r.activations["count"] >= 2 and r.activations["bytes"] >= 2 * tiny_input for r in moved.reports)
    assert f"offloaded to {'host memory' if offload == 'cpu' else 'nvme'}" in out and "| activations " in out
    assert json.loads(summary.read_text())["steps"][0]["activations"]["count"] == moved.reports[0].activations["count"]


def test_compact_state_moves_fewer_bytes_a_step_and_says_so(tmp_path, capsys):
    """--moments int8 on the default job (state on nvme, the host budget smaller than it): each step's line shows
    the bytes per parameter it moved, fewer than exact state's on the same steps."""
    def run(*flags: str):
        return main(["--preset", "tiny", "--layers", "4", "--steps", "3", "--host-budget", "1200KiB",
                     "--nvme-path", str(tmp_path / flags[-1]), "--save-dir", str(tmp_path / "ck"), *flags])

    exact = run("--moments", "fp32")
    compact = run("--moments", "int8")
    out = capsys.readouterr().out
    assert "stored as moments int8, master fp32" in out and "B/param)" in out
    assert sum(r.bytes_per_param for r in compact.reports[1:]) < sum(r.bytes_per_param for r in exact.reports[1:])


def command(argv: list[str], capsys) -> tuple[str, str]:
    """The command run as `python -m zero.train` runs it (zero/train/__main__.py), ending on bad input: (stdout,
    its one stderr line)."""
    with pytest.raises(SystemExit) as info:
        run_command("zero.train", main, argv, errors=(ValueError,))
    out, err = capsys.readouterr()
    assert info.value.code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    return out, err


@pytest.mark.parametrize("flags, line", [
    (["--nvme-path", "{file}"], "NotADirectoryError: --nvme-path '{file}' is not a directory"),
    (["--save-dir", "{file}"], "NotADirectoryError: --save-dir '{file}' is not a directory"),
    (["--save-dir", "{file}/ck", "--save-every", "1"], "NotADirectoryError: --save-dir '{file}/ck': '{file}' is not a "
                                                       "directory"),
    (["--summary-json", "{dir}"], "IsADirectoryError: --summary-json '{dir}' is a directory: name a file"),
    (["--trace", "{dir}/no/t.json"], "FileNotFoundError: --trace '{dir}/no/t.json': its directory '{dir}/no' does not "
                                     "exist"),
    (["--resume", "{dir}", "--summary-json", "{dir}/s.json"], "CheckpointNotFoundError: --resume: no `latest` there to "
                                                              "resume from: '{dir}'"),
    (["--save-dir", "{run}"], "RunExistsError: --save-dir '{run}' already holds a run's checkpoints (latest: "
                              "global_step7), which this run's saves would replace: pass --resume auto to continue it"),
    (["--resume", "{dir}", "--save-dir", "{run}"], "RunExistsError: --save-dir '{run}' already holds a run's"),
    (["--data", "{empty}"], "ValueError: the data files hold 0 bytes ('{empty}' 0 bytes): need at least 2"),
    (["--config", "{fp16_yes}"], "ConfigError: fp16.enabled = 'yes': expected true or false"),
    (["--config", "{bf16_false}", "--dtype", "fp32"], "ConfigError: bf16.enabled = 'false': expected true or false"),
])
def test_bad_paths_and_values_are_one_line_before_the_model_is_built(flags, line, tmp_path, capsys):
    """A file where a directory belongs, an output that cannot be written, a --resume with nothing to resume, a
    --save-dir holding another run, an empty data file, a precision section's wrong-typed `enabled` (which the
    job's own dtype choice used to overwrite): each one line naming the flag or key, before any step runs."""
    names = {"file": tmp_path / "file", "dir": tmp_path, "run": tmp_path / "run", "empty": tmp_path / "empty.txt",
             "fp16_yes": tmp_path / "fp16.json", "bf16_false": tmp_path / "bf16.json"}
    names["file"].write_text("not a directory")
    names["run"].mkdir()
    (names["run"] / "latest").write_text("global_step7")
    names["empty"].write_bytes(b"")
    names["fp16_yes"].write_text('{"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": "yes"}}')
    names["bf16_false"].write_text('{"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": "false"}}')
    names = {key: str(path) for key, path in names.items()}
    argv = ["--preset", "tiny", "--steps", "1", "--nvme-path", str(tmp_path / "nvme"), "--save-dir",
            str(tmp_path / "ck"), *flags]
    out, err = command([arg.format(**names) for arg in argv], capsys)
    assert err.startswith("zero.train: " + line.format(**names)), err
    assert "model: " not in out and "step 0" not in out
    assert (tmp_path / "run" / "latest").read_text() == "global_step7" and os.listdir(tmp_path / "run") == ["latest"]


def test_a_resume_with_nothing_to_resume_is_one_line_without_a_warning_before_it(tmp_path):
    done = subprocess.run([sys.executable, "-m", "zero.train", "--preset", "tiny", "--steps", "1", "--resume",
                           str(tmp_path), "--nvme-path", str(tmp_path / "nvme")],
                          env=child_env(), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr  # (a UserWarning came first)
    assert done.stderr == f"zero.train: CheckpointNotFoundError: --resume: no `latest` there to resume from: " \
                          f"'{tmp_path}'\n"


def test_a_second_run_into_a_save_dir_is_refused_and_the_first_runs_checkpoints_kept(tmp_path, capsys):
    """Run again without --resume, a job saving into --save-dir would replace the first run's global_step1 and
    move `latest` back, and a later --resume auto would continue the wrong run: it is refused before training,
    nothing stored changes, and --resume auto continues the first run."""
    data = tmp_path / "data.txt"
    data.write_bytes(bytes(range(256)) * 8)
    save_dir = tmp_path / "ck"
    argv = ["--preset", "tiny", "--seq-len", "16", "--steps", "1", "--save-every", "1", "--save-dir", str(save_dir),
            "--data", str(data), "--nvme-path", str(tmp_path / "nvme")]
    main(argv)
    stored = {path: path.read_bytes() for path in save_dir.rglob("*") if path.is_file()}
    capsys.readouterr()
    out, err = command(argv, capsys)
    assert err == f"zero.train: RunExistsError: --save-dir '{save_dir}' already holds a run's checkpoints (latest: " \
                  "global_step1), which this run's saves would replace: pass --resume auto to continue it, or choose " \
                  "another --save-dir\n"
    assert "model: " not in out
    assert {path: path.read_bytes() for path in save_dir.rglob("*") if path.is_file()} == stored
    main([*argv, "--steps", "2", "--resume", "auto"])
    out = capsys.readouterr().out
    assert f"resumed from {save_dir}/global_step1 at step 1" in out
    assert re.search(r"held-out loss: \d+\.\d+ at step 1 \(resumed\), \d+\.\d+ after 2 steps", out), out
    assert (save_dir / "latest").read_text().strip() == "global_step2"


def test_steps_are_zero_or_more(capsys):
    """--steps -1 used to run no step and exit 0; 0 is the held-out loss alone (of a resumed model, say)."""
    assert parse_args(["--steps", "0"]).steps == 0
    for text in ("-1", "two"):
        with pytest.raises(SystemExit) as info:
            parse_args(["--steps", text])
        assert info.value.code == 2
        assert f"argument --steps: '{text}': expected a whole number of steps, 0 or more" in capsys.readouterr().err


def test_a_resume_on_another_number_of_ranks_gives_each_rank_its_own_data(tmp_path):
    """Saved by one rank, resumed on two: each rank's state file was rank 0's, so both ranks drew rank 0's batches
    (the run trained as one rank, silently); now each starts a stream of its own, and the resume says so."""
    nvme, one, two = tmp_path / "nvme", tmp_path / "one", tmp_path / "two"
    nvme.mkdir()
    common = ["--preset", "tiny", "--nvme-path", str(nvme)]
    main([*common, "--steps", "3", "--save-every", "1", "--save-dir", str(one)])
    shutil.copytree(one, two)
    alone = main([*common, "--steps", "5", "--save-dir", str(one), "--resume", "auto"])
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         "-m", "zero.train", *common, "--steps", "5", "--save-dir", str(two), "--resume", "auto"],
        env=child_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "saved by 1 ranks, resumed on 2: each rank's data stream starts afresh" in done.stdout
    held = [line for line in done.stdout.splitlines() if line.startswith("held-out loss: ")]
    assert len(held) == 1 and f"{alone.held_out_after:.4f} after 5 steps" not in held[0], (held, alone.held_out_after)
