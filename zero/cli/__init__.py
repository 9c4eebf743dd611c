"""How the command-line tools end on bad input: one line, `prog: what went wrong`, on stderr and exit status 1,
never a traceback (argparse's own errors keep their usage line and status 2). Our typed errors name the problem
and its numbers already; a traceback would bury that line. `--debug` keeps the traceback. An error that is not
ours (a bug) keeps its traceback: that is what a bug report needs."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TypeVar

from tiering import TieringError

from ..checkpoint.format import CheckpointError
from ..config import ConfigError
from ..engine import NonFiniteLossError

T = TypeVar("T")
USER_ERRORS = (TieringError, ConfigError, CheckpointError, NonFiniteLossError, json.JSONDecodeError, OSError)
"""Bad input, a full disk, a corrupt file, a diverged run: what the user can fix. OSError: a missing or unreadable
file named on the command line (a config, a data file). NonFiniteLossError: a nan or inf loss (too high a learning
rate; its message names the step and zero_tiering.nonfinite "skip")."""


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    """`--debug`, and the `--local_rank` a launcher passes (DeepSpeed's, and `python -m zero.launch`, pass it to
    every command they start; the rank is read from LOCAL_RANK, which they set too)."""
    parser.add_argument("--debug", action="store_true", help="on an error, print its traceback too")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="this process's rank on its node, as a launcher passes it (LOCAL_RANK says the same)")


def run_command(prog: str, main: Callable[[list[str]], T], argv: list[str] | None = None,
                errors: tuple[type[BaseException], ...] = ()) -> T:
    """`main(argv)`, with our typed errors (and `errors`, a tool's own) turned into one line and exit status 1."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        return main(argv)
    except (*USER_ERRORS, *errors) as exc:
        if "--debug" in argv:
            raise
        print(f"{prog}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        if "--debug" in argv:
            raise
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
