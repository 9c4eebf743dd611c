"""The command-line tools end on bad input with one line on stderr (`prog: ErrorType: message`) and a non-zero
exit status, never a traceback; `--debug` keeps the traceback. A bug's own exception is not ours to hide."""
from __future__ import annotations

import subprocess
import sys

import pytest

from zero.cli import run_command
from zero.engine import NonFiniteLossError

from conftest import REPO_ROOT, child_env


def command(*argv: str, cwd=REPO_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], env=child_env(), capture_output=True, text=True,
                          timeout=120, cwd=cwd)


@pytest.mark.parametrize("argv, message", [
    (["zero.train", "--config", "{missing}"], "zero.train: FileNotFoundError: [Errno 2] No such file"),
    (["zero.train", "--config", "{not_json}"], "zero.train: ConfigError: {not_json}: not valid JSON"),
    (["zero.train", "--config", "{bad_key}"], "zero.train: UnknownKeyError: zero_optimization.stag"),
    (["zero.train", "--data", "{short}", "--nvme-path", "{out}"], "zero.train: ValueError: corpus of 5 tokens is too short"),
    (["zero.export", "{missing}", "{out}"], "zero.export: CheckpointNotFoundError: no checkpoint directory"),
    (["zero.inference", "--model", "{out}", "--prompt", "hi"], "zero.inference: ValueError: --model"),
    (["zero.plan", "--model", "tiny", "--config", "{bad_key}"], "zero.plan: "),
])
def test_bad_input_is_one_line_and_a_nonzero_exit(argv, message, tmp_path):
    files = {"missing": tmp_path / "missing.json", "not_json": tmp_path / "not.json", "bad_key": tmp_path / "bad.json",
             "short": tmp_path / "short.txt", "out": tmp_path}
    files["not_json"].write_text('{"zero_optimization": {')
    files["bad_key"].write_text('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stag": 3}}')
    files["short"].write_text("hello")
    names = {key: str(path) for key, path in files.items()}
    done = command(*[arg.format(**names) for arg in argv])
    assert done.returncode != 0
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(message.format(**names)), done.stderr


def test_debug_keeps_the_traceback(tmp_path):
    done = command("zero.train", "--config", str(tmp_path / "missing.json"), "--debug")
    assert done.returncode != 0 and "Traceback" in done.stderr and "FileNotFoundError" in done.stderr


def test_a_nonfinite_loss_is_one_line(capsys):
    """`zero.train --lr 1e12` diverges: the engine's NonFiniteLossError names the step and the way to skip it."""
    def main(argv):
        raise NonFiniteLossError(4, float("nan"), float("nan"))

    with pytest.raises(SystemExit) as info:
        run_command("zero.train", main, [])
    assert info.value.code == 1
    assert capsys.readouterr().err.startswith("zero.train: NonFiniteLossError: step 4: the gradient norm is nan")


def test_a_bug_keeps_its_traceback(capsys):
    def main(argv):
        raise AttributeError("a bug")

    with pytest.raises(AttributeError):
        run_command("tool", main, [])
    assert capsys.readouterr().err == ""
