"""The main job, an application of the library: a GPT-style model (gpt.py), a byte-level corpus (corpus.py)
and the training command (run.py, `python -m zero.train`)."""
from .run import TrainRun, main

__all__ = ["TrainRun", "main"]
