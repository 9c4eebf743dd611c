"""The swap manager's configuration for an engine: tier budgets, prefetch and live-byte limits, the nvme store.

Where `zero_tiering.host_budget` is unset it is derived from the config (bytes; P = the compute dtype's
bytes per element, "range" = this rank's part of a unit: its shard from stage 1 on, else the whole unit):

    | term                 | bytes                                                                        |
    |----------------------|------------------------------------------------------------------------------|
    | homed on host        | S x sum(range) with offload_optimizer cpu (S: a sub-group's state and        |
    |                      | gradient per element, `window_bytes`: 16, or 12 when the master is the       |
    |                      | shard, for exact state; less for a compact state format); + P x sum(shard)   |
    |                      | with stage 3 offload_param cpu                                               |
    | working window       | 4 sub-groups' state: 4 x S x sub-group; stage 3: + 4 parameter shards        |
    |                      | (P x largest shard); parameters on nvme: + P x min(max_in_cpu, all shards)   |
    |                      | offload_optimizer: + 2 x R x sub-group, the gradients' staging on their way  |
    |                      | to the host (R: the bytes of the dtype the reduction leaves them in)         |
    | prefetch             | 2 sub-groups' state: 2 x S x sub-group; stage 3: + P x                       |
    |                      | stage3_prefetch_bucket_size                                                  |
    | activations          | zero_tiering.activation_host_bytes with activation_offload cpu or nvme       |

and the host budget is their sum; sub-group = min(largest range, sub_group_size or largest range) elements. DeepSpeed counts its stage-3 limits
(prefetch bucket, max live parameters, max reuse distance) in parameters; the swap manager in bytes of the
compute dtype.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tiering import NvmeStoreConfig, SwapConfig, Tier, align_up

from ..config import Config, ConfigError
from ..optim.gradient_copies import SLOTS
from ..optim.gradients import COMM_DTYPES
from ..params import int8_weights
from ..params.flat_unit import FlatUnit
from ..params.persistence import persistent_units
from ..params.root_uses import parkable
from ..params.tied_head import STAGING, tied_heads

HOMES: dict[str, Tier] = {"none": "device", "cpu": "host", "nvme": "nvme"}
"""The tier an offload device setting ("none", "cpu", "nvme") rests a segment in."""


def compute_dtype(cfg: Config) -> torch.dtype:
    """The dtype the config computes in: its bf16 or fp16 section, else fp32."""
    return torch.bfloat16 if cfg.bf16.enabled else torch.float16 if cfg.fp16.enabled else torch.float32


def masters_are_params(cfg: Config, dtype: torch.dtype) -> bool:
    """Stage 3 computing in the master's dtype (fp32, or bf16 with a bf16 master) with parameters and optimizer
    state offloaded to the same tier: each unit's parameter shard is its master (identical values), so the master
    is not stored a second time and the optimizer updates the shard in place. Elsewhere the master is a copy of
    its own: the compute dtype differs, or the parameters rest in another tier than the optimizer works in."""
    zo = cfg.zero_optimization
    return (zo.stage == 3 and dtype == cfg.state_format.master_dtype
            and zo.offload_param.device == zo.offload_optimizer.device != "none")


def window_bytes(cfg: Config, dtype: torch.dtype, unit: FlatUnit, *, master: bool | None = None) -> list[int]:
    """Host bytes each of `unit`'s sub-groups takes for a step: its state as the state format stores it (the
    master unless it is the parameter shard, or as `master` says) and its gradient, counted at 4 bytes, each
    segment in whole pages as the host budget charges it."""
    master = not masters_are_params(cfg, dtype) if master is None else master
    return [sum(align_up(max(b, 1)) for b in cfg.state_format.segment_bytes(n, master=master, index=index,
                                                                            extents=unit.extents) + [4 * n])
            for index, n in sub_groups(cfg, unit)]


def largest_window(cfg: Config, dtype: torch.dtype, units: list[FlatUnit], *, master: bool | None = None) -> int:
    """The most host bytes one sub-group takes for a step (`window_bytes`)."""
    return max((b for unit in trained(units) for b in window_bytes(cfg, dtype, unit, master=master)), default=0)


def shard_bytes(cfg: Config, unit: FlatUnit, dtype: torch.dtype) -> int:
    """Bytes of a unit's parameter shard as it rests in its tier (stage 3): the compute dtype's, or for a frozen
    unit under zero_quantized_nontrainable_weights, block-wise int8 with its scales."""
    if unit.frozen and cfg.zero_optimization.zero_quantized_nontrainable_weights:
        return int8_weights.stored_numel(unit.shard_numel)
    return dtype.itemsize * unit.shard_numel


def trained(units: list[FlatUnit]) -> list[FlatUnit]:
    """The units with optimizer state and gradients: all but the frozen ones."""
    return [u for u in units if not u.frozen]


def reduce_dtype(cfg: Config, dtype: torch.dtype) -> torch.dtype:
    """What the reduction leaves gradients in, and they cross the bus in: the communication or compute dtype."""
    return COMM_DTYPES.get(cfg.communication_data_type) or dtype


def grad_dtype(cfg: Config, dtype: torch.dtype) -> torch.dtype:
    """What the accumulated gradient is kept in (AdamDriver.grad_dtype): without accumulation each step's
    gradient is stored once, exactly as the reduction leaves it (in the communication or compute dtype), so
    16 bits lose nothing; accumulating sums in fp32."""
    return reduce_dtype(cfg, dtype) if cfg.gradient_accumulation_steps == 1 else torch.float32


def pin_memory(cfg: Config, cuda: bool | None = None) -> bool:
    """Whether the host tier's buffers are page-locked: one pool serves both offload sections, so it is pinned
    if either section asks, unpinned if a section says false and none asks, and by default where CUDA is present
    (the pool pins exactly its budget). Without CUDA (`cuda`: default, whether it is available) there is
    nothing to pin for."""
    if not (torch.cuda.is_available() if cuda is None else cuda):
        return False
    zo = cfg.zero_optimization
    asked = {section.pin_memory for section in (zo.offload_param, zo.offload_optimizer)
             if section.device != "none"} - {None}
    return not asked or True in asked


def nvme_segments(cfg: Config, units: list[FlatUnit], dtype: torch.dtype, *, optimizer: bool = True) -> list[int]:
    """Bytes of each segment the engine will home on nvme, in the order it registers them (per unit: its
    parameter shard, then each sub-group's master, moments, compensation and gradient): what the room check adds up
    before any of them is written."""
    zo = cfg.zero_optimization
    params_on_nvme = zo.stage == 3 and HOMES[zo.offload_param.device] == "nvme"
    state_on_nvme = optimizer and HOMES[zo.offload_optimizer.device] == "nvme"  # the gradient is homed with it
    fmt, own_master = cfg.state_format, not masters_are_params(cfg, dtype)
    sizes = []
    for unit in units:
        if params_on_nvme:
            sizes.append(shard_bytes(cfg, unit, dtype))
        if state_on_nvme and not unit.frozen:
            for index, n in sub_groups(cfg, unit):
                sizes += fmt.segment_bytes(n, master=own_master, index=index, extents=unit.extents)
                sizes.append(grad_dtype(cfg, dtype).itemsize * n)
    return sizes


def sub_groups(cfg: Config, unit: FlatUnit) -> list[tuple[int, int]]:
    """(index of its first element in the unit's flat buffer, elements) of each sub-group the driver cuts this
    rank's range of `unit` into (AdamDriver.add_unit)."""
    zo = cfg.zero_optimization
    start, numel = unit.rank_range(zo.stage >= 1)
    chunk = zo.sub_group_size or numel
    return [(start + offset, min(chunk, numel - offset)) for offset in range(0, numel, chunk)]


def largest_sub_group(cfg: Config, units: list[FlatUnit]) -> int:
    """Elements of the largest sub-group: the largest range, cut at sub_group_size."""
    zo = cfg.zero_optimization
    largest = max((u.rank_range(zo.stage >= 1)[1] for u in trained(units)), default=0)
    return min(largest, zo.sub_group_size or largest)


def swap_config(cfg: Config, units: list[FlatUnit], dtype: torch.dtype, *, optimizer: bool = True) -> SwapConfig:
    """Tier budgets from the zero_tiering section; where unset, the host budget holds everything homed on
    the host plus a working window: the state of a few sub-groups, a few parameter shards, and (parameters
    on nvme) up to offload_param.max_in_cpu parameter elements kept in host memory as a cache. `optimizer`
    False (inference): there is no optimizer state, so neither its window nor its read-ahead; prefetch reads
    ahead the prefetch bucket's parameters alone, leaving the rest of the host budget to cache them."""
    zo, zt = cfg.zero_optimization, cfg.zero_tiering
    state = largest_window(cfg, dtype, units) if optimizer else 0  # (master,) two moments, grad
    window = 4 * state  # the segments of up to four sub-groups
    offload = zo.offload_optimizer.device
    homed_on_host = 0
    if optimizer and offload == "cpu":
        homed_on_host = sum(sum(window_bytes(cfg, dtype, unit)) for unit in trained(units))
    if optimizer and offload != "none":  # gradient_copies.py: the staging of the gradients' way to the host
        window += SLOTS * reduce_dtype(cfg, dtype).itemsize * largest_sub_group(cfg, units)
    prefetch = 2 * state  # read ahead the next sub-groups' state
    max_live = reuse_distance = None
    if zo.stage == 3:
        param_bytes = [shard_bytes(cfg, u, dtype) for u in units]
        window += 4 * max(param_bytes, default=0)
        homed_on_host += sum(param_bytes) if zo.offload_param.device == "cpu" else 0
        if zo.offload_param.device == "nvme":  # DeepSpeed's max_in_cpu: parameters cached on host before nvme
            window += min(zo.offload_param.max_in_cpu * dtype.itemsize, sum(param_bytes))
        # DeepSpeed counts these in parameters; the swap manager in bytes of the compute dtype.
        prefetch += zo.prefetch_bucket_size * dtype.itemsize
        max_live = zo.max_live_parameters * dtype.itemsize
        reuse_distance = zo.max_reuse_distance * dtype.itemsize
    if cfg.activation_offload in ("cpu", "nvme"):
        homed_on_host += zt.activation_host_bytes
    paths = {(o.nvme_path,) if isinstance(o.nvme_path, str) else o.nvme_path
             for o in (zo.offload_optimizer, zo.offload_param) if o.device == "nvme"}
    if len(paths) > 1:
        raise ConfigError("zero_optimization.offload_param.nvme_path",
                          "offload_param and offload_optimizer must share one nvme_path (the same directories, in "
                          "the same order)", value=sorted((p[0] if len(p) == 1 else list(p) for p in paths), key=str))
    if cfg.activation_offload == "nvme" and not paths:
        raise ConfigError("zero_tiering.activation_offload", "activations on nvme need the nvme store: set "
                          "offload_param or offload_optimizer to nvme with an nvme_path", value="nvme")
    nvme = None
    if paths:
        nvme = NvmeStoreConfig(nvme_path=paths.pop(), budget=zt.nvme_budget, aio=cfg.to_aio_config(), create=True)
    return SwapConfig(
        host_budget=zt.host_budget if zt.host_budget is not None else homed_on_host + window + prefetch,
        device_budget=zt.device_budget,
        nvme=nvme,
        prefetch_bytes=prefetch if zt.prefetch else 0,
        max_live_bytes=max_live,
        reuse_distance=reuse_distance,
        checksums=zt.checksums,
        pin=pin_memory(cfg),
    )


def host_minimum(cfg: Config, units: list[FlatUnit], dtype: torch.dtype, *, heads: list[int] = (),
                 optimizer: bool = True) -> dict[str, int]:
    """The least host budget a step runs in, by part: what is homed on the host (the optimizer's state and
    gradients with offload_optimizer cpu, the parameter shards with stage 3 offload_param cpu); with the parameters
    on nvme, the largest shard, which a gather (and a step updating it) holds in host memory whole; and the larger
    of what the backward holds there beside it (`heads`: each tied embedding's head gradient, tied_head_bytes; the
    gradients' staging on their way to the host, gradient_copies.py; with the state on nvme, the sub-groups'
    gradients the staged parts are added to) and what a step of one sub-group holds (its state and gradient, read
    from nvme). `optimizer` False (inference): none of the last. (Offloaded activations spill to nvme where the
    budget has no room for them.)"""
    zo = cfg.zero_optimization
    parts = {"optimizer state": 0, "parameter shards": 0, "largest parameter shard": 0}
    if optimizer and zo.offload_optimizer.device == "cpu":
        parts["optimizer state"] = sum(sum(window_bytes(cfg, dtype, unit)) for unit in trained(units))
    if zo.stage == 3 and zo.offload_param.device == "cpu":
        parts["parameter shards"] = sum(align_up(shard_bytes(cfg, unit, dtype)) for unit in units)
    if zo.stage == 3 and zo.offload_param.device == "nvme":
        parts["largest parameter shard"] = max((align_up(shard_bytes(cfg, unit, dtype)) for unit in units), default=0)
    if optimizer and zo.offload_optimizer.device != "none" and trained(units):
        part = max(largest_sub_group(cfg, units), 1)
        staging = SLOTS * align_up(reduce_dtype(cfg, dtype).itemsize * part)
        backward = sum(align_up(n) for n in heads) + staging
        step = 0
        if zo.offload_optimizer.device == "nvme":  # each staged part is added to its sub-group's gradient
            backward += SLOTS * align_up(grad_dtype(cfg, dtype).itemsize * part)
            step = largest_window(cfg, dtype, units)
        if backward >= step:
            parts["head gradients and gradient staging" if heads else "gradient staging"] = backward
        else:
            parts["a sub-group's state and gradient"] = step
    return parts


def tied_head_bytes(plan: list[tuple[FlatUnit, nn.Module]], model: nn.Module, dtype: torch.dtype) -> list[int]:
    """Bytes of each tied embedding's head gradient (stage 3: tied_head.py), the whole weight in the compute dtype,
    held off the device from the head's backward to the root unit's reduction."""
    return [slot.numel * dtype.itemsize for flat, module in plan if not flat.frozen and module is model
            for slot, *_ in tied_heads(module, flat.slots)]


def parks_root(cfg: Config, plan: list[tuple[FlatUnit, nn.Module]], model: nn.Module, dtype: torch.dtype,
               *, charge: Callable[[int], int]) -> bool:
    """Whether the engine parks the root unit between its uses (zero_tiering.park_root; null: where the device budget
    is below what holding the root takes). Only at stage 3, for a model whose root's uses can be seen (parkable)."""
    asked = cfg.zero_tiering.park_root
    if asked is False or cfg.zero_optimization.stage != 3 or not root_parkable(plan, model, cfg):
        return False
    budget = cfg.zero_tiering.device_budget
    return asked or (budget is not None and budget < sum(device_minimum(cfg, plan, model, dtype, charge=charge,
                                                                        parked=False).values()))


def root_parkable(plan: list[tuple[FlatUnit, nn.Module]], model: nn.Module, cfg: Config) -> bool:
    """Whether the plan has a root unit to park and its uses can be seen (root_uses.parkable)."""
    persists = persistent_units(cfg.zero_optimization, [flat for flat, _ in plan])
    roots = [flat for (flat, module), kept in zip(plan, persists) if module is model and not kept]
    return bool(roots) and parkable(model, [slot.param for flat in roots for slot in flat.slots],
                                    [module for flat, module in plan if (flat.within or module) is not model])


def device_minimum(cfg: Config, plan: list[tuple[FlatUnit, nn.Module]], model: nn.Module, dtype: torch.dtype,
                   *, charge: Callable[[int], int], parked: bool | None = None) -> dict[str, int]:
    """The least device budget the engine runs this plan in, by the device tier's parts (what `DeviceTier.parts`
    names at the backward's peak): `charge(nbytes)` is what one buffer takes from the budget (the CPU stand-in's
    pool hands out whole pages).

    Stage 3 gathers: persistent units stay gathered; the root unit (what follows the whole model: its embeddings
    and head, used at both ends of the step) is held beside the blocks, or, `parked` (None: wherever it can be,
    the least budget; parks_root says whether it will be), parked while they run (root_uses.py); the largest
    other unit is gathered in its turn (prefetching the next one needs its full buffer's room on top: without it
    the engine runs, unprefetched).
    The gradients of the root and of that unit are on the device at once, until each is reduced, less a tied
    embedding's head gradient, which waits on the host meanwhile; the root's whole gradient, and the staging the head
    part comes back through, only after the blocks' backward (tied_head.py): parked, the root's peak is at the
    step's ends, gathered (a module before the blocks may read its weights in its backward) with that whole
    gradient, or in a block's backward, whichever is larger. The reduction's
    scratch, one per gradient copy in flight to the host: where the gradients go there (one rank, or
    reduce-scattered), a sub-group's part from every rank's range and its reduced piece (gradients.py); else the
    largest unit's flattened gradients, its reduced shard when reduce-scattered, and the fp32 cast where the device
    steps. Segments homed on the device (parameter shards, optimizer state) stay there. Activations kept on the
    device are not counted: they depend on the batch."""
    zo = cfg.zero_optimization
    world = plan[0][0].world_size if plan else 1
    stage3 = zo.stage == 3
    learning = [(flat, module) for flat, module in plan if not flat.frozen]
    largest = max((flat.padded_numel for flat, _ in learning), default=0)
    reduce_bytes = reduce_dtype(cfg, dtype).itemsize
    work_on_host = zo.offload_optimizer.device != "none"
    slots = SLOTS if work_on_host else 1
    if work_on_host and (world == 1 or zo.stage >= 2):  # a sub-group's part at a time (gradients.py)
        part = max(largest_sub_group(cfg, [flat for flat, _ in plan]), 1)
        scratch = slots * charge(world * part * reduce_bytes) + (slots * charge(part * reduce_bytes) if world > 1 else 0)
    else:
        scratch = slots * charge(largest * reduce_bytes)
        if zo.stage >= 2 and world > 1:
            scratch += slots * charge(largest // world * reduce_bytes)
    if not work_on_host and reduce_bytes != 4:
        scratch += charge(largest * 4)
    parts = {"segments": 0, "gathered units": 0, "unit gradients": 0, "reduction scratch": scratch if learning else 0}
    if stage3:
        # A block's units (one per param group, and its frozen ones: in the backward they stay until the block's
        # ends) are gathered together, the root's frozen parts with the root; an int8 frozen unit's stored bytes
        # land beside its full buffer before they are decoded into it.
        def gathered(flat: FlatUnit) -> int:
            int8 = flat.frozen and zo.zero_quantized_nontrainable_weights
            return charge(flat.padded_numel * dtype.itemsize) + (charge(shard_bytes(cfg, flat, dtype)) if int8 else 0)

        persists = persistent_units(zo, [flat for flat, _ in plan])
        persistent = sum(gathered(flat) for (flat, _), kept in zip(plan, persists) if kept)
        released = [(flat, flat.within or module) for (flat, module), kept in zip(plan, persists) if not kept]
        by_module: dict[int, int] = {}
        for flat, block in released:
            if block is not model:
                by_module[id(block)] = by_module.get(id(block), 0) + gathered(flat)
        root_units = [flat for flat, block in released if block is model]
        root_gathered = sum(gathered(flat) for flat in root_units)
        block = max(by_module.values(), default=0)
        grads: dict[int, int] = {}
        for flat, module in learning:
            grads[id(module)] = grads.get(id(module), 0) + charge(flat.padded_numel * dtype.itemsize)
        root = grads.pop(id(model), 0)
        block_grads = max(grads.values(), default=0)
        heads = tied_head_bytes(plan, model, dtype)
        staging = max((min(STAGING, n) for n in heads), default=0)
        if parked is None:
            parked = cfg.zero_tiering.park_root is not False and root_parkable(plan, model, cfg)
        if learning and parked:
            # The blocks run with the root parked; at the ends it is gathered with its whole gradient.
            gathered_part, grads_part = max([(block, root - sum(heads) + block_grads), (root_gathered, root + staging)],
                                            key=sum)
        else:
            gathered_part, grads_part = root_gathered + block, max(root - sum(heads) + block_grads, root + staging)
        parts["gathered units"] = persistent + gathered_part
        parts["unit gradients"] = grads_part
        if zo.offload_param.device == "none":
            parts["segments"] += sum(charge(flat.shard_numel * dtype.itemsize) for flat, _ in plan)
    if not work_on_host:  # the optimizer's state and gradient live on the device
        state = 3 if masters_are_params(cfg, dtype) else 4
        for flat, _ in learning:
            for _, n in sub_groups(cfg, flat):
                parts["segments"] += (state - 1) * charge(4 * n) + charge(grad_dtype(cfg, dtype).itemsize * n)
    return parts
