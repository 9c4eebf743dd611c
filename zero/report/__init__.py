"""`python -m zero.report`: is this machine ready to train with zero-tiering (DeepSpeed's `ds_report` for us).

`checks` answers each question (torch and CUDA, the CPU-Adam kernel, libaio, the nvme path's filesystem,
O_DIRECT and engine, memory, fio) with a verdict and, where it falls short, what to do. `bandwidth` measures
the nvme path through our own NvmeStore and saves the figures the planner reads with `load_figures`.
"""
from .bandwidth import DEFAULT_FIGURES, DiskFigures, load_figures, measure, save_figures
from .checks import Check, run_checks

__all__ = ["DEFAULT_FIGURES", "Check", "DiskFigures", "load_figures", "measure", "run_checks", "save_figures"]
