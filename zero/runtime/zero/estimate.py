"""What DeepSpeed's memory estimators (stage_1_and_2.py, stage3.py) share: the model counted as DeepSpeed counts it,
the per-node and per-GPU bytes of a placement from zero-tiering's own accounting (plan/model_states.py), and the
table they print, in DeepSpeed's layout."""
from __future__ import annotations

from torch import nn

from ...plan.model_states import model_states, numel


def model_to_params(model: nn.Module) -> tuple[int, int]:
    """(total parameters, the largest layer's): a shared parameter once, a partitioned one by its `ds_numel`, a
    layer's being its module's own parameters (DeepSpeed's count, which the table's header shows)."""
    total = sum(numel(p) for p in model.parameters())
    largest = max((sum(numel(p) for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return total, largest


def needs(sizes: list[int], num_gpus_per_node: int, num_nodes: int, additional_buffer_factor: float,
          **placement) -> tuple[int, int, int]:
    """(host bytes a node needs, device bytes a GPU needs, of those the stage-3 gathers'): one rank's model states
    (model_states) times the node's ranks, the host's times `additional_buffer_factor` as DeepSpeed's is."""
    states = model_states(sizes, world_size=num_gpus_per_node * num_nodes, **placement)
    return (int(states["host"] * num_gpus_per_node * additional_buffer_factor), states["device"],
            states["gathered"])


def print_table(rows: list[tuple[int, int, str]], *, total_params: int, num_gpus_per_node: int, num_nodes: int,
                largest_layer_params: int | None = None) -> None:
    """DeepSpeed's table: the setup, the model's size, then per CPU (node) | per GPU | options, in GiB."""
    layer = "" if largest_layer_params is None else f", {int(largest_layer_params / 1e6)}M largest layer params"
    print("Estimated memory needed for params, optim states and gradients for a:\n"
          f"HW: Setup with {num_nodes} node{'s' if num_nodes > 1 else ''}, {num_gpus_per_node} "
          f"GPU{'s' if num_gpus_per_node > 1 else ''} per node.\n"
          f"SW: Model with {int(total_params / 1e6)}M total params{layer}.")
    print("  per CPU  |  per GPU |   Options")
    for cpu_mem, gpu_mem, options in rows:
        print(f" {cpu_mem / 2**30:7.2f}GB | {gpu_mem / 2**30:6.2f}GB | {options}")
