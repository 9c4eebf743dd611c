"""What each process of `zero.launch` runs (torchrun starts it with `-m zero.launch.rank`): the user's script, or
module, with `--local_rank=<LOCAL_RANK>` first among its arguments, as DeepSpeed's launcher passes it (torchrun
only sets the environment variable), and its `deepspeed` imports resolving to `zero`
(zero/integrations/deepspeed_alias.py) and transformers' HfDeepSpeedConfig being ours (hf_alias.py), so a script
written for DeepSpeed runs with no line changed; where it checks for the deepspeed package itself, the error is
followed by what to use instead. Run under torchrun directly for jobs over several nodes:
`torchrun --nnodes ... -m zero.launch.rank [--module] [--no_local_rank] script.py [args ...]`.
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys

from ..integrations import deepspeed_alias, hf_alias


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zero.launch.rank", allow_abbrev=False)
    parser.add_argument("--module", action="store_true", help="run the target as a module, as `python -m`")
    parser.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=<i>")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="script.py [args ...]")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("no script given")
    target, *script_args = args.command
    if not args.no_local_rank:
        script_args.insert(0, f"--local_rank={os.environ['LOCAL_RANK']}")
    sys.argv = [target, *script_args]
    deepspeed_alias.install()
    hf_alias.install()
    try:
        if args.module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` has it
            runpy.run_path(target, run_name="__main__")
    except ImportError as err:
        if not deepspeed_alias.asks_for_the_package(err):
            raise
        raise deepspeed_alias.PackageAskedError(deepspeed_alias.PACKAGE_ASKED) from err


if __name__ == "__main__":
    main()
