"""Start-up checks of the paths the main job reads and writes. A fault in one (a directory named as a file, a
parent that is missing, a file where a directory belongs, a --save-dir holding another run) is named in one
line before the model is built, not after the training that the failed write would throw away."""
from __future__ import annotations

import argparse
import os

from ..checkpoint.format import LATEST, CheckpointError, CheckpointNotFoundError, read_latest


class RunExistsError(CheckpointError, FileExistsError):
    """--save-dir holds another run's checkpoints: this run's saves (global_step1, ... and `latest`) would
    replace them, and a later `--resume auto` would continue the wrong run."""


def check_paths(args: argparse.Namespace) -> None:
    """Every path the command line names, checked before anything is built or written."""
    for flag, path in (("--summary-json", args.summary_json), ("--trace", args.trace)):
        if path:
            check_output_file(flag, path)
    check_save_dir(args)
    if args.resume and args.resume != "auto" and not os.path.exists(os.path.join(args.resume, LATEST)):
        raise CheckpointNotFoundError(args.resume, "--resume: no `latest` there to resume from")


def check_output_file(flag: str, path: str) -> None:
    """`path` can be written: not a directory, its directory there and writable."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"{flag} {path!r} is a directory: name a file")
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        raise (NotADirectoryError if os.path.exists(parent) else FileNotFoundError)(
            f"{flag} {path!r}: {parent!r} is not a directory" if os.path.exists(parent) else
            f"{flag} {path!r}: its directory {parent!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise PermissionError(f"{flag} {path!r} is not writable")


def check_save_dir(args: argparse.Namespace) -> None:
    """--save-dir is a directory (or can be made), writable where the run saves every N steps, and holds no
    other run: a save there (every N steps, or on a signal, which any run may get) would replace its
    checkpoints. Continuing it (`--resume auto`, or --resume naming it) is the one way to write into it."""
    save_dir = args.save_dir
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise NotADirectoryError(f"--save-dir {save_dir!r} is not a directory")
    if args.save_every:
        existing = save_dir
        while not os.path.exists(existing):  # save_checkpoint makes the missing part
            existing = os.path.dirname(os.path.abspath(existing))
        if not os.path.isdir(existing):
            raise NotADirectoryError(f"--save-dir {save_dir!r}: {existing!r} is not a directory")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise PermissionError(f"--save-dir {save_dir!r}: {existing!r} is not writable")
    continues = args.resume == "auto" or (
        args.resume is not None and os.path.realpath(args.resume) == os.path.realpath(save_dir))
    tag = None if continues else read_latest(save_dir)
    if tag is not None:
        raise RunExistsError(f"--save-dir {save_dir!r} already holds a run's checkpoints (latest: {tag}), which this "
                             "run's saves would replace: pass --resume auto to continue it, or choose another "
                             "--save-dir")
