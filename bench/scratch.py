"""The benches' --dir: where a bench's files go (its nvme stores, fio's file), in a temporary folder of its own."""
from __future__ import annotations

import argparse
import os
import tempfile


def scratch_dir(parser: argparse.ArgumentParser, directory: str | None) -> tempfile.TemporaryDirectory:
    """A temporary folder inside `directory` (made, with its parents, where missing; None: the system's temporary
    folder), removed when the bench ends. One that cannot be made is the parser's one-line error (exit 2), not a
    traceback after the bench has started."""
    if directory:
        try:
            os.makedirs(directory, exist_ok=True)
            return tempfile.TemporaryDirectory(dir=directory)
        except OSError as exc:
            parser.error(f"--dir {directory}: {exc.strerror or exc}")
    return tempfile.TemporaryDirectory()
