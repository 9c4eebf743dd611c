"""`python -m zero.train`: the main job (see run.py)."""
from ..cli import run_command
from .run import main

run_command("zero.train", main, errors=(ValueError,))  # ValueError: a data file too short, a bad preset override
