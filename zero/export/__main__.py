"""`python -m zero.export CKPT_DIR OUT_DIR`: see zero/export/__init__.py."""
import sys

from ..cli import run_command
from . import main

sys.exit(0 if run_command("zero.export", main) else 1)
