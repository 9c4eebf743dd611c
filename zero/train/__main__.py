"""`python -m zero.train`: the main job (see run.py)."""
from .run import main

main()
