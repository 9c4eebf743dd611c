"""DeepSpeed's `deepspeed.runtime.zero.stage3` memory estimators for ZeRO-3, same names, arguments and table,
printing what zero-tiering's engine holds (plan/model_states.py), not DeepSpeed's formulas.

Per GPU: the largest block's unit gathered in bf16 and its gradient, beside the root unit (embeddings and head)
and the persistent units, which stay gathered, and the reduction's scratch, where DeepSpeed counts 4 bytes for
its largest layer (a module's own parameters); with offload_param none, this rank's bf16 shard (2 bytes a parameter
/ GPUs); without offload, its fp32 master and moments and its gradient shard in the compute dtype (12 + 2).
Per CPU (a node): what each rank homes there (fp32 master, moments and gradient, 16 bytes a parameter / GPUs, with
offload_optimizer cpu; its bf16 shard, 2, with offload_param cpu) and the gradients' staging, or what it builds
before `initialize`: the fp32 model (zero_init=0) or its 1/GPUs slices of it (zero_init=1), the larger.
"""
from __future__ import annotations

from torch import nn

from ...plan.model_states import cold_units, unit_sizes
from .estimate import model_to_params, needs, print_table

ROWS = ((True, True), (False, True), (False, False))
"""(offload_param cpu, offload_optimizer cpu) of the table's rows, each with zero_init 1 then 0: DeepSpeed's."""


def estimate_zero3_model_states_mem_needs(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1,
                                          cpu_offload=True, cpu_offload_params=True, zero_init=True,
                                          additional_buffer_factor=1.5) -> tuple[int, int, int]:
    """(bytes per CPU, bytes per GPU, of those the gathers') of ZeRO-3 for a model known by counts: blocks of
    `largest_layer_params` (taken for its largest unit) and the rest in the root unit. As DeepSpeed's,
    cpu_offload_params counts only with cpu_offload."""
    return _needs(cold_units(total_params, largest_layer_params), num_gpus_per_node, num_nodes,
                  cpu_offload and cpu_offload_params, cpu_offload, zero_init, additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5) -> None:
    """Print the ZeRO-3 table for `model`: its units as the engine cuts them, parameters counted by ds_numel (a
    model built under zero.Init, or an engine's, is counted whole)."""
    total, largest = model_to_params(model)
    _print(unit_sizes(model), total, largest, num_gpus_per_node, num_nodes, additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params, num_gpus_per_node=1,
                                                   num_nodes=1, additional_buffer_factor=1.5) -> None:
    """Print the ZeRO-3 table for a model known by counts (see estimate_zero3_model_states_mem_needs)."""
    _print(cold_units(total_params, largest_layer_params), total_params, largest_layer_params, num_gpus_per_node,
           num_nodes, additional_buffer_factor)


def _needs(sizes: list[int], num_gpus_per_node, num_nodes, offload_param, offload_optimizer, zero_init,
           factor) -> tuple[int, int, int]:
    return needs(sizes, num_gpus_per_node, num_nodes, factor, stage=3, zero_init=bool(zero_init),
                 offload_param="cpu" if offload_param else "none",
                 offload_optimizer="cpu" if offload_optimizer else "none")


def _print(sizes: list[int], total_params, largest_layer_params, num_gpus_per_node, num_nodes, factor) -> None:
    rows = []
    for param, optimizer in ROWS:
        for zero_init in (1, 0):
            cpu_mem, gpu_mem, _ = _needs(sizes, num_gpus_per_node, num_nodes, param, optimizer, zero_init, factor)
            options = (f"offload_param={'cpu' if param else 'none':4}, "
                       f"offload_optimizer={'cpu' if optimizer else 'none':4}, zero_init={zero_init}")
            rows.append((cpu_mem, gpu_mem, options))
    print_table(rows, total_params=total_params, num_gpus_per_node=num_gpus_per_node, num_nodes=num_nodes,
                largest_layer_params=largest_layer_params)
