"""`python -m zero.launch [flags] script.py [script args ...]`: the `deepspeed` launcher's single-node flags over
torchrun, so a DeepSpeed job's command line runs with `deepspeed` replaced by `python -m zero.launch`.

The flags pick the GPUs (`--num_gpus`, `--include`, `--exclude`, a localhost-only `--hostfile`); without CUDA,
`--num_gpus N` CPU processes (the script joins with gloo). torchrun (torch.distributed.run) starts and watches
the processes and sets their environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); each runs
`zero.launch.rank`, which passes `--local_rank=<i>` to the script as DeepSpeed's launcher does. Several nodes are
torchrun's job: its own multi-node flags, with `-m zero.launch.rank` as the program.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun

MULTI_NODE = ("zero.launch runs on this node only; for several nodes run torchrun on each with its multi-node "
              "flags (--nnodes, --node-rank, --master-addr, --master-port, --nproc-per-node) and "
              "`-m zero.launch.rank script.py [args]` as the program")
"""What to do instead of a multi-node request."""

HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)$")
"""DeepSpeed's (MPI-style) hostfile line: `host slots=N`."""


class LaunchError(ValueError):
    """A flag asks for something this launcher cannot do here (another node, a GPU that does not exist)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zero.launch", usage="%(prog)s [flags] script.py [script args ...]", allow_abbrev=False,
        description="The `deepspeed` launcher's single-node flags over torchrun. With CUDA the processes are the "
                    "GPUs selected (CUDA_VISIBLE_DEVICES is set to them); without CUDA, --num_gpus N CPU "
                    "processes (default 1) that join with the gloo backend.")
    parser.add_argument("--num_gpus", "--num-gpus", "--num_accelerators", type=int, default=None, metavar="N",
                        help="use GPUs 0..N-1 (default: all); without CUDA, run N CPU processes (default 1)")
    parser.add_argument("-i", "--include", default="", metavar="localhost:ID[,ID...]",
                        help="the GPUs to use, in DeepSpeed's syntax, e.g. localhost:1,3 (this node only)")
    parser.add_argument("-e", "--exclude", default="", metavar="localhost:ID[,ID...]",
                        help="the GPUs not to use (same syntax; not with --include)")
    parser.add_argument("--num_nodes", type=int, default=None, metavar="1",
                        help="only 1: zero.launch runs on this node (several nodes: torchrun's flags)")
    parser.add_argument("-H", "--hostfile", default=None, metavar="PATH",
                        help="a hostfile listing localhost only (`localhost slots=N`): GPU ids 0..N-1")
    parser.add_argument("--master_port", type=int, default=29500, help="rendezvous port (default 29500)")
    parser.add_argument("--master_addr", default="127.0.0.1", help="rendezvous address (default 127.0.0.1)")
    parser.add_argument("--no_local_rank", action="store_true",
                        help="do not pass --local_rank=<i> to the script")
    parser.add_argument("--module", action="store_true", help="run the script as a module, as `python -m`")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="script.py [script args ...]",
                        help="the script (or module) and its arguments")
    return parser


def hostfile_slots(path: str) -> int:
    """The slot count of a hostfile that lists localhost only; another host means several nodes."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise LaunchError(f"--hostfile {path}: {e.strerror}") from None
    hosts: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = HOSTFILE_LINE.match(line)
        if match is None:
            raise LaunchError(f"--hostfile {path}, line {number}: {line!r} is not `host slots=N`")
        if match[1] in hosts:
            raise LaunchError(f"--hostfile {path}, line {number}: {match[1]} is listed twice")
        hosts[match[1]] = int(match[2])
    if list(hosts) != ["localhost"]:
        listed = ", ".join(hosts) or "no host"
        raise LaunchError(f"--hostfile {path} lists {listed}, not localhost alone: {MULTI_NODE}")
    return hosts["localhost"]


def named_ids(flag: str, spec: str) -> list[int] | None:
    """The ids a DeepSpeed resource spec names on localhost (`localhost:0,2`), in order; None for the whole
    host (`localhost`). Specs for several hosts join with `@`; any host but localhost is another node."""
    ids: list[int] = []
    whole = False
    for node in spec.split("@"):
        host, has_slots, slots = node.partition(":")
        if host != "localhost":
            raise LaunchError(f"{flag} {spec}: host {host!r}: {MULTI_NODE}")
        if not has_slots:
            whole = True
            continue
        try:
            ids += [int(slot) for slot in slots.split(",")]
        except ValueError:
            raise LaunchError(f"{flag} {spec}: ids are integers, as in localhost:0,2") from None
    return None if whole else list(dict.fromkeys(ids))


def pool(args: argparse.Namespace, cuda_devices: int) -> tuple[int, str]:
    """How many ids there are to choose from (GPUs, or without CUDA CPU processes), and a phrase saying why."""
    slots = hostfile_slots(args.hostfile) if args.hostfile else None
    if cuda_devices:
        devices = f"this machine has {cuda_devices} CUDA device(s)"
        if slots is None:
            return cuda_devices, devices
        if slots > cuda_devices:
            raise LaunchError(f"--hostfile {args.hostfile}: localhost slots={slots}, but {devices}")
        return slots, f"the hostfile gives localhost slots={slots}"
    if slots is not None:
        return slots, f"no CUDA device; the hostfile gives localhost slots={slots} CPU processes"
    return args.num_gpus or 1, "there is no CUDA device; --num_gpus N (default 1) sets the number of CPU processes"


def select(args: argparse.Namespace, cuda_devices: int) -> list[int]:
    """The GPU ids to run on (without CUDA, the CPU processes' slots), as DeepSpeed picks them: --num_gpus N
    takes 0..N-1, --include keeps the ids it names, --exclude drops them; none of them: the whole pool."""
    if args.num_nodes is not None and args.num_nodes != 1:
        raise LaunchError(f"--num_nodes {args.num_nodes}: {MULTI_NODE}")
    if args.include and args.exclude:
        raise LaunchError("--include and --exclude are mutually exclusive")
    if args.num_gpus is not None and (args.include or args.exclude):
        raise LaunchError("--num_gpus and --include/--exclude are mutually exclusive (as in DeepSpeed)")
    if args.num_gpus is not None and args.num_gpus < 1:
        raise LaunchError(f"--num_gpus {args.num_gpus}: at least 1")
    size, why = pool(args, cuda_devices)
    if args.num_gpus is not None:
        if args.num_gpus > size:
            raise LaunchError(f"--num_gpus {args.num_gpus}: {why}")
        return list(range(args.num_gpus))
    flag, spec = ("--include", args.include) if args.include else ("--exclude", args.exclude)
    if not spec:
        return list(range(size))
    named = named_ids(flag, spec)
    missing = [i for i in named or () if not 0 <= i < size]
    if missing:
        raise LaunchError(f"{flag} {spec}: id {missing[0]} does not exist (ids 0-{size - 1}: {why})")
    if flag == "--include":
        return list(range(size)) if named is None else named
    ids = [] if named is None else [i for i in range(size) if i not in named]
    if not ids:
        raise LaunchError(f"--exclude {spec} leaves nothing to run on")
    return ids


def visible_devices(ids: list[int]) -> str:
    """CUDA_VISIBLE_DEVICES for the processes: the ids count the devices this process sees, so they index an
    inherited CUDA_VISIBLE_DEVICES (physical ids when there is none, as in DeepSpeed)."""
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = inherited.split(",") if inherited else [str(i) for i in range(max(ids) + 1)]
    return ",".join(names[i].strip() for i in ids)


def threads_per_process(processes: int) -> int:
    """Each process's share of this process's cores, for OMP_NUM_THREADS when the user set none: torchrun
    would set 1 (DeepSpeed's launcher leaves every process all cores), and CPU-Adam steps on as many threads
    as torch uses."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // processes)


def torchrun_argv(args: argparse.Namespace, processes: int) -> list[str]:
    """torchrun's arguments: one node, `processes` workers, each running zero.launch.rank on the script."""
    child = ["-m", "zero.launch.rank", *(["--module"] if args.module else []),
             *(["--no_local_rank"] if args.no_local_rank else []), *args.command]
    return ["--nnodes", "1", "--nproc-per-node", str(processes), "--master-addr", args.master_addr,
            "--master-port", str(args.master_port), *child]


def module_found(name: str) -> bool:
    """Whether `python -m name` would find the module (its parent packages imported to look, as -m does)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that is missing, or an empty name
        return False


def exit_status(exitcode: int) -> int:
    """A failed process's exit status for the shell: its own, or 128 + the signal that killed it."""
    return 128 - exitcode if exitcode < 0 else exitcode or 1


def main(argv: list[str] | None = None) -> int:
    """Launch; the exit status is 0, the first failed process's, or 2 for bad flags (argparse's)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("no script given")
    if not args.module and not os.path.isfile(args.command[0]):
        parser.error(f"script {args.command[0]!r}: no such file (with --module, a module name)")
    if args.module and not module_found(args.command[0]):
        parser.error(f"--module {args.command[0]!r}: no such module on this Python's path")
    if not 0 < args.master_port < 65536:
        parser.error(f"--master_port {args.master_port}: a TCP port, 1-65535")
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        ids = select(args, cuda_devices)
    except LaunchError as e:
        parser.error(str(e))
    if cuda_devices:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices(ids)
    if len(ids) > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_process(len(ids))))
    try:
        torchrun(torchrun_argv(args, len(ids)))
    except ChildFailedError as e:  # torchrun has logged which rank failed and how
        return exit_status(e.get_first_failure()[1].exitcode)
    return 0
