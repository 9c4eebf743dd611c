"""What DeepSpeed's launcher does beside torchrun's job, for the harness's multi-rank runs under torchrun: each
rank's script gets `--local_rank=<LOCAL_RANK>` first among its arguments (torchrun only sets the variable), and runs
as `python script.py` would (its directory first on sys.path). `zero.launch.rank` does the same for zero's runs, but
also points the script's `deepspeed` imports at zero: DeepSpeed's own recordings need them left alone.

    python -m torch.distributed.run ... local_rank.py script.py [args ...]
"""
import os
import runpy
import sys

script, *args = sys.argv[1:]
sys.argv = [script, f"--local_rank={os.environ['LOCAL_RANK']}", *args]
sys.path[0] = os.path.dirname(os.path.abspath(script))
runpy.run_path(script, run_name="__main__")
