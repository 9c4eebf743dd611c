"""Is this machine ready to train with zero-tiering? One line per check: OK, WARN or FAIL, what was found and,
short of OK, what to do.

    python -m zero.report                                  # the checks, on the main job's nvme path
    python -m zero.report --nvme-path /mnt/nvme --json     # on another path, as JSON
    python -m zero.report --nvme-path /mnt/nvme0 /mnt/nvme1   # each directory of a striped nvme_path
    python -m zero.report --bandwidth /mnt/nvme            # also measure it; save the figures for the planner

Exit status: 1 when a check FAILs (a missing nvme path, a failed measurement), 2 for bad arguments, else 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from tiering import TieringError
from tiering.errors import fmt_bytes
from ..cli import add_common_flags, run_command
from ..config.sizes import parse_size
from .bandwidth import DEFAULT_FIGURES, DiskFigures, check_size, load_figures, measure, save_figures
from .checks import Check, run_checks
from ..train.run import DEFAULT_CONFIG

MAIN_JOB_NVME = DEFAULT_CONFIG["zero_optimization"]["offload_param"]["nvme_path"]
REMEASURE = "python -m zero.report --bandwidth DIR measures and saves them"


def directory_arg(text: str) -> str:
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{text!r} does not exist")
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return os.path.abspath(text)


def file_arg(text: str) -> Path:
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    return Path(text).absolute()


def size_arg(text: str) -> int:
    try:
        nbytes = parse_size(text)
        check_size(nbytes)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return nbytes


def describe(figures: DiskFigures) -> str:
    return (f"read {figures.read_gbps:.2f}, write {figures.write_gbps:.2f}, mixed {figures.mixed_gbps:.2f} GB/s "
            f"({fmt_bytes(figures.bytes)} per direction on {figures.nvme_path}, {figures.engine}; "
            f"measured {figures.measured_at})")


def bandwidth_check(path: str, nbytes: int, file: Path) -> tuple[Check, DiskFigures | None]:
    try:
        figures = measure(path, nbytes)
        save_figures(figures, file)
    except (TieringError, OSError, ValueError) as exc:
        fix = "see the nvme lines above; a smaller --bandwidth-size needs less RAM and disk"
        return Check("bandwidth", "FAIL", f"measuring {path}: {exc}", fix), None
    return Check("bandwidth", "OK", f"{describe(figures)}; saved to {file}"), figures


def figures_check(file: Path) -> tuple[Check, DiskFigures | None]:
    """The figures the planner will read, if any."""
    try:
        figures = load_figures(file)
    except ValueError as exc:
        return Check("figures", "FAIL", str(exc), f"delete it; {REMEASURE}"), None
    if figures is None:
        return Check("figures", "WARN", f"no disk figures in {file}", REMEASURE), None
    return Check("figures", "OK", f"{describe(figures)}, from {file}"), figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zero.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", metavar="DIR", nargs="+",
                        help=f"the directory to check, or several: each directory of an nvme_path list (default: "
                             f"the --bandwidth DIR, else the main job's {MAIN_JOB_NVME} if it exists, else /tmp)")
    parser.add_argument("--bandwidth", metavar="DIR", type=directory_arg,
                        help="measure sequential read, write and mixed GB/s in DIR through NvmeStore")
    parser.add_argument("--bandwidth-size", metavar="SIZE", type=size_arg, default=1 << 30,
                        help="bytes per direction, held in RAM once, twice that on disk (default 1GiB)")
    parser.add_argument("--save", metavar="FILE", type=file_arg, default=DEFAULT_FIGURES,
                        help="where --bandwidth saves the figures and the report reads them (default "
                             "~/.cache/zero_tiering/machine.json)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    add_common_flags(parser)
    args = parser.parse_args(argv)
    if args.nvme_path:
        nvme_paths = [os.path.abspath(path) for path in args.nvme_path]
    else:
        nvme_paths = [args.bandwidth or (MAIN_JOB_NVME if os.path.isdir(MAIN_JOB_NVME) else "/tmp")]

    checks = run_checks(nvme_paths)
    if args.bandwidth:
        if not args.json:
            print(f"measuring {fmt_bytes(args.bandwidth_size)} per direction in {args.bandwidth} ...", file=sys.stderr)
        check, figures = bandwidth_check(args.bandwidth, args.bandwidth_size, args.save)
    else:
        check, figures = figures_check(args.save)
    checks.append(check)

    if args.json:
        nvme_path = nvme_paths[0] if len(nvme_paths) == 1 else nvme_paths  # as a config's nvme_path spells it
        print(json.dumps({"checks": [asdict(c) for c in checks], "nvme_path": nvme_path,
                          "figures": figures and asdict(figures), "figures_file": str(args.save)}, indent=2))
    else:
        for c in checks:
            print(f"{c.verdict:<5} {c.name:<11} {c.found}" + (f"  -- fix: {c.fix}" if c.fix else ""))
    return 1 if any(c.verdict == "FAIL" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(run_command("zero.report", main))
