"""DeepSpeed's `deepspeed.runtime.zero.stage_1_and_2` memory estimators for ZeRO-2, same names, arguments and table,
printing what zero-tiering's engine holds (plan/model_states.py), not DeepSpeed's formulas.

Per GPU: the bf16 parameters' full buffers and the gradients autograd leaves beside them (2 + 2 bytes a parameter),
the reduction's scratch (sized by the largest unit) and, without offload, this rank's fp32 master and moments and its
gradient shard in the compute dtype (12 + 2 bytes a parameter / GPUs), where DeepSpeed counts fp32 gradients whole.
Per CPU (a node): with offload_optimizer cpu, each rank's master, moments and fp32 gradient (16 bytes a parameter /
GPUs) and the gradients' staging, or the fp32 model each rank builds before `initialize`, the larger.
"""
from __future__ import annotations

from torch import nn

from ...plan.model_states import cold_units, unit_sizes
from .estimate import model_to_params, needs, print_table


def estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True,
                                          additional_buffer_factor=1.5) -> tuple[int, int]:
    """(bytes per CPU, bytes per GPU) of ZeRO-2 with the optimizer offloaded to cpu or not. From a count alone the
    model is one unit, so the reduction's scratch is counted for all of it: the live estimate counts its units."""
    return _needs(cold_units(total_params, 0), num_gpus_per_node, num_nodes, cpu_offload, additional_buffer_factor)


def estimate_zero2_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5) -> None:
    """Print the ZeRO-2 table for `model` (its units as the engine cuts them, parameters counted by ds_numel)."""
    _print(unit_sizes(model), model_to_params(model)[0], num_gpus_per_node, num_nodes, additional_buffer_factor)


def estimate_zero2_model_states_mem_needs_all_cold(total_params, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5) -> None:
    """Print the ZeRO-2 table for a model of `total_params` parameters, without building it (one unit)."""
    _print(cold_units(total_params, 0), total_params, num_gpus_per_node, num_nodes, additional_buffer_factor)


def _needs(sizes: list[int], num_gpus_per_node, num_nodes, cpu_offload, factor) -> tuple[int, int]:
    cpu_mem, gpu_mem, _ = needs(sizes, num_gpus_per_node, num_nodes, factor, stage=2,
                                offload_optimizer="cpu" if cpu_offload else "none")
    return cpu_mem, gpu_mem


def _print(sizes: list[int], total_params, num_gpus_per_node, num_nodes, factor) -> None:
    rows = [(*_needs(sizes, num_gpus_per_node, num_nodes, offload, factor),
             f"offload_optimizer={'cpu' if offload else 'none'}") for offload in (True, False)]
    print_table(rows, total_params=total_params, num_gpus_per_node=num_gpus_per_node, num_nodes=num_nodes)
