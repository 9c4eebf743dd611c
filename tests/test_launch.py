"""`python -m zero.launch`, the `deepspeed` launcher's single-node flags over torchrun: two CPU processes (gloo)
all-reduce and see DeepSpeed's `--local_rank=<i>`; `--no_local_rank` and `--module` behave as DeepSpeed's; bad
flags end with one argparse-style line and exit status 2; a failed process's exit status comes back. The GPU
selection (--include/--exclude/--num_gpus/--hostfile) is checked against a pretend machine with 4 GPUs.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from argparse import Namespace

import pytest
from conftest import child_env

from zero import launch
from zero.launch import LaunchError, build_parser, select, visible_devices

RECORD = textwrap.dedent("""
    import json, os, sys
    out = os.environ["RECORD_DIR"]
    record = {"name": __name__, "argv": sys.argv[1:], "local_rank": os.environ["LOCAL_RANK"],
              "threads": os.environ.get("OMP_NUM_THREADS")}
    if os.environ.get("ALL_REDUCE"):
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        total = torch.tensor([dist.get_rank()])
        dist.all_reduce(total)
        record.update(rank=dist.get_rank(), world_size=dist.get_world_size(), sum=int(total))
        dist.destroy_process_group()
    if os.environ.get("FAIL_ON_RANK") == os.environ["RANK"]:  # once the others have recorded: torchrun then stops them
        import time
        others = [os.path.join(out, f"rank{r}.json") for r in range(int(os.environ["WORLD_SIZE"]))
                  if str(r) != os.environ["RANK"]]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(map(os.path.exists, others)):
            time.sleep(0.05)
        sys.exit(3)
    with open(os.path.join(out, f".rank{os.environ['RANK']}.tmp"), "w") as f:
        json.dump(record, f)
    os.replace(f.name, os.path.join(out, f"rank{os.environ['RANK']}.json"))
""")
"""A script (or module) that records what its process saw, one file per rank (whole or not at all); a rank told
to fail exits 3 once the others have recorded (a launcher stops the rest when one fails)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_launch(tmp_path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**child_env(), "RECORD_DIR": str(tmp_path), **env}
    return subprocess.run([sys.executable, "-m", "zero.launch", "--master_port", str(free_port()), *argv],
                          env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=120)


def records(tmp_path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}


def test_two_cpu_processes_all_reduce_and_get_their_local_rank(tmp_path):
    (tmp_path / "train.py").write_text(RECORD)
    done = run_launch(tmp_path, "--num_gpus", "2", "train.py", "--deepspeed", "ds.json", ALL_REDUCE="1")
    assert done.returncode == 0, done.stderr[-3000:]
    seen = records(tmp_path)
    assert sorted(seen) == [0, 1]
    for rank, record in seen.items():
        assert (record["rank"], record["world_size"], record["sum"]) == (rank, 2, 0 + 1)
        assert record["local_rank"] == str(rank)
        assert record["argv"] == [f"--local_rank={rank}", "--deepspeed", "ds.json"]  # first, as DeepSpeed puts it
        assert record["name"] == "__main__"
        assert record["threads"] == str(max(1, len(os.sched_getaffinity(0)) // 2))  # the cores shared out


def test_no_local_rank_leaves_argv_alone_and_the_script_dir_is_on_the_path(tmp_path):
    """As `python sub/train.py` would: the script's own directory is importable."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "helper.py").write_text("VALUE = 'imported'\n")
    (tmp_path / "sub" / "train.py").write_text("import helper\n" + RECORD)
    done = run_launch(tmp_path, "--no_local_rank", "sub/train.py", "a", "--b")
    assert done.returncode == 0, done.stderr[-3000:]
    assert records(tmp_path)[0]["argv"] == ["a", "--b"]


def test_module_runs_as_python_dash_m(tmp_path):
    (tmp_path / "recorder.py").write_text(RECORD)
    done = run_launch(tmp_path, "--module", "recorder", "x")
    assert done.returncode == 0, done.stderr[-3000:]
    record = records(tmp_path)[0]
    assert record["name"] == "__main__" and record["argv"] == ["--local_rank=0", "x"]


def test_a_failed_process_exit_status_comes_back(tmp_path):
    (tmp_path / "train.py").write_text(RECORD)
    done = run_launch(tmp_path, "--num_gpus", "2", "train.py", FAIL_ON_RANK="1", OMP_NUM_THREADS="3")
    assert done.returncode == 3, done.stderr[-3000:]
    assert sorted(records(tmp_path)) == [0]
    assert records(tmp_path)[0]["threads"] == "3"  # the user's own setting is kept


def test_bad_flags_from_the_command_line_are_one_message_and_status_2(tmp_path):
    (tmp_path / "train.py").write_text(RECORD)
    done = run_launch(tmp_path, "--num_nodes", "2", "train.py")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith("python -m zero.launch: error: --num_nodes 2: zero.launch runs "
                                                   "on this node only; for several nodes run torchrun")


@pytest.mark.parametrize("argv, message", [
    (["--no_such_flag", "train.py"], "unrecognized arguments: --no_such_flag"),
    (["--include", "localhost:0", "--exclude", "localhost:1", "train.py"],
     "--include and --exclude are mutually exclusive"),
    (["--num_gpus", "2", "--include", "localhost:0", "train.py"],
     "--num_gpus and --include/--exclude are mutually exclusive"),
    (["--include", "localhost:5", "train.py"], "--include localhost:5: id 5 does not exist (ids 0-0: there is no "
                                               "CUDA device; --num_gpus N (default 1) sets the number of CPU"),
    (["--include", "localhost:0@worker-1:0", "train.py"], "--include localhost:0@worker-1:0: host 'worker-1': "
                                                          "zero.launch runs on this node only"),
    (["--num_nodes", "2", "train.py"], "--num_nodes 2: zero.launch runs on this node only"),
    (["--num_gpus", "0", "train.py"], "--num_gpus 0: at least 1"),
    (["--hostfile", "{missing}", "train.py"], "--hostfile {missing}: No such file or directory"),
    ([], "no script given"),
    (["--num_gpus", "2"], "no script given"),
    (["missing.py"], "script 'missing.py': no such file"),
    (["--module", "zero.nosuch"], "--module 'zero.nosuch': no such module"),
    (["--module", "nosuchpackage.train"], "--module 'nosuchpackage.train': no such module"),
    (["--master_port", "99999", "train.py"], "--master_port 99999: a TCP port, 1-65535"),
])
def test_bad_flags_exit_2_naming_the_problem(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(RECORD)
    missing = str(tmp_path / "missing-hostfile")
    with pytest.raises(SystemExit) as exit_:
        launch.main([arg.format(missing=missing) for arg in argv])
    assert exit_.value.code == 2
    assert f"python -m zero.launch: error: {message.format(missing=missing)}" in capsys.readouterr().err


# -- which GPUs, on a pretend machine with 4 ------------------------------------------------------------------

def flags(*argv: str) -> Namespace:
    return build_parser().parse_args([*argv, "train.py"])


@pytest.mark.parametrize("argv, ids", [
    ([], [0, 1, 2, 3]),
    (["--num_gpus", "2"], [0, 1]),
    (["--num-gpus", "3"], [0, 1, 2]),
    (["--include", "localhost:3,1"], [3, 1]),
    (["-i", "localhost:1,1"], [1]),
    (["--include", "localhost"], [0, 1, 2, 3]),
    (["--exclude", "localhost:0,2"], [1, 3]),
    (["--num_nodes", "1", "--exclude", "localhost:3"], [0, 1, 2]),
])
def test_gpu_selection_follows_deepspeed(argv, ids):
    assert select(flags(*argv), cuda_devices=4) == ids


@pytest.mark.parametrize("argv, message", [
    (["--num_gpus", "5"], "--num_gpus 5: this machine has 4 CUDA device(s)"),
    (["--include", "localhost:1,4"], "--include localhost:1,4: id 4 does not exist (ids 0-3: this machine has 4"),
    (["--exclude", "localhost"], "--exclude localhost leaves nothing to run on"),
    (["--include", "localhost:a"], "--include localhost:a: ids are integers, as in localhost:0,2"),
])
def test_gpu_selection_errors(argv, message):
    with pytest.raises(LaunchError) as error:
        select(flags(*argv), cuda_devices=4)
    assert str(error.value).startswith(message)


def test_a_localhost_hostfile_gives_the_slots(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# this node\n\nlocalhost slots=2\n")
    assert select(flags("--hostfile", str(hostfile)), cuda_devices=4) == [0, 1]
    assert select(flags("-H", str(hostfile)), cuda_devices=0) == [0, 1]  # without CUDA: two CPU processes
    with pytest.raises(LaunchError, match=r"localhost slots=2, but this machine has 1 CUDA device"):
        select(flags("--hostfile", str(hostfile)), cuda_devices=1)


@pytest.mark.parametrize("text, message", [
    ("localhost slots=2\nworker-1 slots=2\n", "lists localhost, worker-1, not localhost alone: zero.launch runs"),
    ("# nothing\n", "lists no host, not localhost alone"),
    ("localhost 2\n", "line 1: 'localhost 2' is not `host slots=N`"),
    ("localhost slots=2\nlocalhost slots=4\n", "line 2: localhost is listed twice"),
])
def test_a_hostfile_other_than_one_localhost_line_is_refused(text, message, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(text)
    with pytest.raises(LaunchError) as error:
        select(flags("--hostfile", str(hostfile)), cuda_devices=4)
    assert message in str(error.value)


def test_visible_devices_index_an_inherited_cuda_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_devices([3, 1]) == "3,1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 5,6,7")
    assert visible_devices([1, 3]) == "5,7"
