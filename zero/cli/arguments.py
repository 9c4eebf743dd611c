"""DeepSpeed's command-line arguments (`deepspeed.add_config_arguments`): a script that adds them to its parser
passes the parsed `args` to `initialize`, which reads the config from `args.deepspeed_config` (or the older
`args.deepscale_config`)."""
from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `--deepspeed` and `--deepspeed_config` (and DeepSpeed's older `--deepscale`, `--deepscale_config`)
    to `parser`, as DeepSpeed does; returns it."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (read by zero-tiering)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser
