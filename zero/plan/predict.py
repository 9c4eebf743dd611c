"""What a placement costs on a machine: bytes per tier, predicted peak host RSS and device peak, nvme bytes moved
and step time, for one rank.

The tiers' budgets come from the engine's own rules (zero/services/budgets.py) applied to the model's units (the wrap
policy on the meta model), so the plan and the engine agree on what each tier holds. The rest is a model of
today's engine, with its terms measured on this machine or counted from the model:

- peak RSS = this process's RSS before planning (python, torch, zero) + the host tier's peak (its homed
  bytes, plus nvme-homed bytes cached up to the host budget) + the device tier's peak where the device is
  host memory (no CUDA; it holds the activations and logits) + what no budget holds: below stage 3, the
  resident parameters' gradients as autograd leaves them (with a GPU, in the device peak instead); activations
  offloaded to cpu (or to nvme, up to activation_host_bytes) are in the host tier;
- step time = forward/backward compute (FLOPs / the measured matmul rate, times COMPUTE_OVERHEAD for what is
  not a matmul, plus the bytes the gathers and the gradient path copy / the measured copy rate, plus fresh
  gradients and activations / the measured first-touch rate) + its parameter reads and gradient writes + the optimizer phase, the larger of CPU-Adam and
  its own nvme reads and writes. The optimizer phase's I/O cannot overlap the backward it follows (it needs the
  gradient's norm), so the I/O is added, at IO_EFFICIENCY of the disk's measured mixed rate, but for the
  parameter reads of units small enough for the prefetch budget and the backward's gradient writes
  (write-behind), which hide behind compute;
  With the speculative step (zero_tiering.speculative_step, where it is served) the optimizer phase runs
  inside the backward: the step is then the larger of the compute plus what runs beside it on the same cores
  (with a GPU, nothing; on a CPU device, the early steps' CPU-Adam, a copy pass over each byte the I/O moves and
  its checksum) and the forward plus the early steps' I/O, then the optimizer phase of the unit the forward uses
  first (its gradient is final only when the backward ends), and the boundary's gradients are stepped while in
  host memory (not written and read back). With state on nvme, a sub-group steps early only where the previous
  state can be kept in a fresh extent (tiering/kept.py: within the nvme budget, or without one the disk's free
  space less its reserve): the share of the step's nvme writes that room holds speculates, the rest steps at the
  boundary (its gradients written and read back, its I/O after the backward);
- device peak = what is homed there, the engine's least device budget (budgets.device_minimum: stage 3's gathered
  units and their gradients until reduced, the reduction's scratch), the activations kept (see activation_bytes)
  and the head's logits (one chunk's where the model computes its loss in chunks: ModelShape.loss_rows);
- nvme bytes: activations spilled to nvme, written and read back (hidden behind compute, as prefetched
  parameters are); forward and backward read each parameter shard, backward writes each gradient, the step reads
  gradients and optimizer state and writes state and parameters back; the share of nvme-homed bytes that
  the host budget keeps cached (beyond its working window) moves no I/O.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from tiering.device_tier import device_charge
from tiering.nvme_store import RESERVE_MAX, RESERVE_SHARE

from ..services.budgets import (HOMES, device_minimum, grad_dtype, host_minimum, masters_are_params, sub_groups,
                                swap_config, tied_head_bytes)
from ..comm import DataParallel
from ..config import load_config
from ..initialize import frozen_units, plan_units, speculates
from ..optim.param_groups import param_groups_from
from ..optim.state_format import StateFormat
from .machine import Machine
from .model_source import ModelShape

COMPUTE_OVERHEAD = 1.35
"""Forward/backward time over its matmul FLOPs at the measured matmul rate, for what is not a matmul: layer
norms, GELU, softmax, attention's small matmuls, the embedding. Set by hand, not fitted: with it the 124m
cpu-offload prediction came within 3% of its measured step (bench/RESULTS.md), so that case is no independent
check of it."""
IO_EFFICIENCY = 0.8
"""The share of the disk's measured mixed (read + write) rate the engine's I/O reaches where it is not hidden
behind compute (the optimizer phase). Fitted, 2026-11-23 after write-behind (bench/RESULTS.md, "The disk in a
real step"), to two runs: 1b x 4 layers moved ~8.5 GB in its ~5.5 s optimizer phase at fio 1.32 GB/s (1.17),
the README's scale command ~73 GB in ~50 s at fio 1.99 GB/s measured after the run (0.74); 0.8 puts both
predicted steps within 20%, so neither is an independent check. The disk drifts 2x within minutes here."""
ALLOCATOR_SLACK = 1.10
"""RSS over the bytes the model above counts (the allocator's free lists and fragmentation): an allowance, not
a measurement."""
ACTIVATION_FACTOR = 16
"""Bytes a block saves for its backward per token, in units of hidden x the compute dtype's size (a GPT block
with flash-style attention saves about 16 such tensors: norms' inputs, q/k/v, the attention output, the MLP's
4x-wide input and activation)."""
RAM_HEADROOM = 0.9
"""A plan fits when its peak RSS is within this share of RAM (the OS and page cache need the rest)."""
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Placement:
    stage: int
    offload_param: str
    offload_optimizer: str
    precision: str
    state_format: StateFormat = StateFormat()

    @property
    def name(self) -> str:
        return (f"stage {self.stage}, params {self.offload_param if self.stage == 3 else 'on device'}, "
                f"optimizer {self.offload_optimizer}, {self.precision}"
                + ("" if self.state_format.exact else
                   f", {self.state_format.moments} moments, {self.state_format.master} master"))


def placements(precision: str, nvme: bool, state_format: StateFormat = StateFormat()) -> list[Placement]:
    """Every placement the engine supports in one precision and state format (nvme ones only where a disk is
    planned; a compact format only with the optimizer offloaded, where CPU-Adam steps it)."""
    devices = ("none", "cpu", "nvme") if nvme else ("none", "cpu")
    out = [Placement(stage, "none", optimizer, precision, state_format) for stage in (0, 1, 2) for optimizer in devices]
    out += [Placement(3, param, optimizer, precision, state_format) for param in devices for optimizer in devices]
    return [p for p in out if state_format.exact or p.offload_optimizer != "none"]


def compact_formats(precision: str) -> list[StateFormat]:
    """The compact formats proposed where exact state does not fit: int8 moments, and with bf16 compute the
    bf16 master rounded stochastically as well (the fewest bytes)."""
    return [StateFormat("int8", "fp32")] + ([StateFormat("int8", "bf16-sr")] if precision == "bf16" else [])


def ds_config(placement: Placement, *, micro_batch: int, nvme_path: str | None, host_budget: int | None = None,
              device_budget: int | None = None, activation_offload: str | None = None) -> dict:
    """The DeepSpeed-format config of a placement (what `zero.train --config` and `zero.initialize` take)."""
    zero = {"stage": placement.stage, "offload_optimizer": {"device": placement.offload_optimizer},
            "sub_group_size": 4_000_000}
    if placement.stage == 3:
        zero["offload_param"] = {"device": placement.offload_param}
        zero["stage3_param_persistence_threshold"] = 0
    for section in ("offload_param", "offload_optimizer"):
        if zero.get(section, {}).get("device") == "nvme":
            zero[section]["nvme_path"] = nvme_path
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
              "zero_optimization": zero}
    if placement.precision != "fp32":
        config[placement.precision] = {"enabled": True}
    fmt = placement.state_format
    tiering = {key: value for key, value in (("host_budget", host_budget), ("device_budget", device_budget),
                                             ("activation_offload", activation_offload),
                                             ("moments", None if fmt.exact else fmt.moments),
                                             ("master", None if fmt.exact else fmt.master)) if value is not None}
    if tiering:
        config["zero_tiering"] = tiering
    return config


def placement_of(config: dict) -> Placement:
    cfg = load_config(config)
    zo = cfg.zero_optimization
    precision = "bf16" if cfg.bf16.enabled else "fp16" if cfg.fp16.enabled else "fp32"
    return Placement(zo.stage, zo.offload_param.device if zo.stage == 3 else "none", zo.offload_optimizer.device,
                     precision, cfg.state_format)


@dataclass
class Prediction:
    placement: Placement
    config: dict
    tier_bytes: dict[str, int]
    """Bytes homed in each tier (device, host, nvme)."""
    peak_rss_bytes: int
    device_peak_bytes: int
    read_bytes: int
    """nvme bytes read per step."""
    write_bytes: int
    compute_s: float
    optimizer_s: float
    io_s: float
    step_s: float
    host_budget: int
    schedule: str | None = None
    """How a step's micro-batches run with gradient accumulation (zero_tiering.accumulation, stage 3)."""
    fits: bool = True
    why_not: list[str] = field(default_factory=list)

    @property
    def bytes_per_step(self) -> int:
        return self.read_bytes + self.write_bytes

    def to_json(self) -> dict:
        return {"placement": self.placement.name, "predicted_peak_rss_bytes": self.peak_rss_bytes,
                "predicted_device_peak_bytes": self.device_peak_bytes, "predicted_step_s": self.step_s,
                "predicted_bytes_per_step": self.bytes_per_step, "predicted_read_bytes": self.read_bytes,
                "predicted_write_bytes": self.write_bytes, "compute_s": self.compute_s,
                "optimizer_s": self.optimizer_s, "io_s": self.io_s, "tier_bytes": self.tier_bytes,
                "host_budget": self.host_budget, "schedule": self.schedule, "fits": self.fits, "why_not": self.why_not,
                "config": self.config}


def activation_bytes(shape: ModelShape, tokens: int, p: int, checkpointing: bool, offload: str,
                     slices: int = 1) -> tuple[int, int]:
    """(kept where autograd made them at the backward's start, offloaded) bytes of a micro-batch's activations
    saved in the blocks: ACTIVATION_FACTOR x hidden x P a token and layer without checkpointing; with it each
    block's input (hidden x P a token) and one block's recomputation; offloaded (cpu or nvme), the inputs leave the
    device but for the two the backward reads next. `slices`: the micro-batches run unit-major (their blocks'
    inputs all kept, a block recomputed one micro-batch at a time)."""
    per_layer = tokens * shape.hidden * p
    if not checkpointing:
        return ACTIVATION_FACTOR * per_layer * shape.layers, 0
    inputs = per_layer * shape.layers * slices
    per_layer *= slices if offload in ("cpu", "nvme") else 1  # the two inputs the backward reads next: whole
    if offload in ("cpu", "nvme"):
        return ACTIVATION_FACTOR * per_layer + 2 * per_layer, inputs
    return ACTIVATION_FACTOR * per_layer + inputs, 0


def predict(shape: ModelShape, machine: Machine, config: dict, base_rss: int, nvme_free: int | None,
            checkpointing: bool = False) -> Prediction:
    """The costs of training `shape` with `config` (one rank) on `machine`; `checkpointing`: each block
    recomputed in the backward (the config's activation offload then moves their inputs)."""
    cfg = load_config(json.loads(json.dumps(config)), hidden_size=shape.hidden)
    zo = cfg.zero_optimization
    placement = placement_of(config)
    dtype = PRECISIONS[placement.precision]
    p = dtype.itemsize
    groups = param_groups_from(shape.model, None, None, cfg)
    plan = plan_units(shape.model, groups, DataParallel(), frozen=frozen_units(cfg))
    every = [flat for flat, _ in plan]
    flats = [flat for flat in every if not flat.frozen]  # trained: gradients and optimizer state
    budgets = swap_config(cfg, every, dtype)
    derived = swap_config(load_config(working_window_config(config), hidden_size=shape.hidden), every, dtype)
    n = sum(flat.padded_numel for flat in flats)
    # The unit the forward uses first (the root, with the embedding; plan_units lists it first) has its gradient
    # final only when the backward ends: a speculated step runs its sub-groups after the backward, not beside it.
    first = flats[0].name.split("#")[0]
    tail = sum(flat.padded_numel for flat in flats if flat.name.split("#")[0] == first) / n
    # Frozen parameters (an adapter's base; stage 3): stored and gathered as parameters, never written.
    frozen = p * sum(flat.padded_numel for flat in every if flat.frozen)

    shared = masters_are_params(cfg, dtype)
    # The moments, and the master unless the parameter shard is it, as the state format stores them.
    state = state_bytes(cfg, flats, master=not shared)
    grads, params = grad_dtype(cfg, dtype).itemsize * n, p * n
    state_home = HOMES[zo.offload_optimizer.device]
    grad_home = "nvme" if state_home == "nvme" else "device" if state_home == "device" else "host"
    param_home = HOMES[zo.offload_param.device] if zo.stage == 3 else "device"
    tiers = {"device": 0, "host": 0, "nvme": 0}
    for home, nbytes in ((state_home, state), (grad_home, grads), (param_home, params + frozen)):
        tiers[home] += nbytes

    # The device tier: what is homed there, and what the engine's least device budget adds to it (stage 3: the
    # root unit and a block gathered, their gradients until reduced; the reduction's scratch).
    device = torch.device("cuda" if machine.gpu_bytes else "cpu")
    working = device_minimum(cfg, plan, shape.model, dtype, charge=lambda nbytes: device_charge(nbytes, device))
    device_peak = tiers["device"] + sum(nbytes for part, nbytes in working.items() if part != "segments")
    # The host tier: its homed bytes, and nvme-homed bytes cached up to its budget.
    window = max(0, derived.host_budget - tiers["host"])
    host_budget = budgets.host_budget
    host_peak = min(host_budget, tiers["host"] + tiers["nvme"] + window) if tiers["nvme"] else tiers["host"]
    cached = max(0, host_budget - tiers["host"] - window)
    kept_share = min(1.0, cached / tiers["nvme"]) if tiers["nvme"] else 1.0

    # What no budget holds.
    micro, seq = cfg.train_micro_batch_size_per_gpu, shape.seq_len
    tokens = micro * seq
    autograd = 0 if zo.stage == 3 else p * n  # resident leaves' .grad until reduced (stage 3: counted above)
    accumulation = cfg.gradient_accumulation_steps
    # Unit-major (train_batch): a step's micro-batches through each block at once, every block recomputed a
    # micro-batch at a time (checkpointed whether or not the model asks), the head on the whole step's batch.
    unit_major = zo.stage == 3 and accumulation > 1 and cfg.zero_tiering.accumulation == "unit-major"
    passes = 1 if unit_major else accumulation  # gathers of each unit, round trips of its accumulated gradient
    kept, offloaded = activation_bytes(shape, tokens, p, checkpointing or unit_major, cfg.activation_offload,
                                       slices=accumulation if unit_major else 1)
    head_tokens = tokens * (accumulation if unit_major else 1)
    rows = head_tokens if shape.loss_rows is None or head_tokens <= shape.loss_rows else shape.loss_rows
    activations = kept + rows * shape.vocab * (2 * p + 8)  # the head's logits, their fp32 copy and gradient
    device_peak += activations  # where the device is host memory, counted in the RSS with the device tier
    # Offloaded to nvme, what the host's room for activations cannot hold goes through the disk.
    spilled = max(0, offloaded - cfg.zero_tiering.activation_host_bytes) if cfg.activation_offload == "nvme" else 0
    host_peak += offloaded - spilled
    resident_grads = autograd if machine.gpu_bytes else 0  # on a GPU autograd leaves them in its memory
    device_peak += resident_grads
    unbudgeted = autograd - resident_grads
    on_host = host_peak + (device_peak if machine.gpu_bytes == 0 else 0)
    peak_rss = int(base_rss + ALLOCATOR_SLACK * (on_host + unbudgeted))

    # Time.
    passes_forward = 4 if unit_major and not checkpointing else 3  # forward, backward (2x), a recomputation
    flops = passes_forward * (2 * shape.matmul_params * tokens + 4 * shape.layers * micro * seq * seq * shape.hidden)
    # Per element and micro-batch: the gradient is read from autograd's leaves, written to the reduction's
    # scratch, cast to fp32 where the dtype is lower, added to the sub-group's gradient and read for its norm;
    # per gather (stage 3, forward and backward) the shard is copied into the full buffer.
    copied = 2 * p + (p + 4 if p != 4 else 0) + 12
    gathered = 4 * p if zo.stage == 3 else 0
    fresh = p * n + kept  # new gradients and saved activations
    memory = ((accumulation * copied * n + passes * gathered * (n + frozen // p)) / machine.copy_bytes
              + accumulation * fresh / machine.fresh_bytes)
    compute = accumulation * flops / machine.matmul_flops * COMPUTE_OVERHEAD + memory
    adam = n / machine.adam_rate(cfg.state_format)
    speculative = speculates(cfg, "host" if state_home != "device" else "device", flats, dtype, budgets.host_budget)
    read_fb = 2 * passes * (params + frozen) if param_home == "nvme" else 0
    write_opt = (state if state_home == "nvme" else 0) + (params if param_home == "nvme" else 0)
    share = speculated_share(cfg, tiers["nvme"], write_opt, nvme_free) if speculative else 0.0
    # Speculating, the boundary's gradient is stepped while still in host memory: no write, no read back.
    write_bwd = (passes - share) * grads if grad_home == "nvme" else 0
    read_fb += (passes - 1) * grads if grad_home == "nvme" else 0  # the accumulated gradient, read to add to
    read_opt = ((state + (1 - share) * grads if state_home == "nvme" else 0)
                + (params if shared and param_home == "nvme" else 0))
    moved = 1.0 - kept_share
    # Activations spilled to nvme: written in the forward, read back ahead of the backward.
    reads = int(moved * (read_fb + read_opt)) + accumulation * spilled
    writes = int(moved * (write_bwd + write_opt)) + accumulation * spilled
    io_rate = IO_EFFICIENCY * machine.disk.mixed_gbps * 1e9 if reads or writes else 1.0
    fb_io = (moved * (read_fb + write_bwd) + 2 * accumulation * spilled) / io_rate
    opt_io = moved * (read_opt + write_opt) / io_rate
    # Behind compute: the parameter reads prefetch covers (a unit's shard within the prefetch budget), and the
    # backward's gradient writes (write-behind starts them as each unit's gradient is released).
    ahead = sum(2 * p * flat.shard_numel for flat in every if p * flat.shard_numel <= budgets.prefetch_bytes)
    behind = moved * ((passes * ahead if param_home == "nvme" else 0) + write_bwd) + 2 * accumulation * spilled
    hidden = min(compute, behind / io_rate)
    optimizer = max(adam, opt_io)
    step = compute + fb_io - hidden + optimizer
    if speculative:  # the optimizer phase inside the backward (a third of the compute is the forward)
        early = share * (1 - tail)  # the share of the state stepped beside the backward
        if machine.gpu_bytes:  # the backward on the GPU, CPU-Adam and the I/O's copies beside it on the host
            beside = 0.0
        else:  # one set of cores: the early steps' CPU-Adam, the I/O's copies and checksums (a pass over each byte)
            hashed = (reads + writes) / machine.checksum_bytes if cfg.zero_tiering.checksums else 0.0
            beside = early * adam + (reads + writes) / machine.copy_bytes + hashed
        step = max(compute + beside, compute / 3 + fb_io + early * opt_io) + (1 - early) * optimizer

    prediction = Prediction(placement, config, tiers, peak_rss, device_peak, reads, writes, compute, optimizer,
                            fb_io + opt_io, step, host_budget,
                            schedule=None if accumulation == 1 else "unit-major" if unit_major else "micro-batch")
    if peak_rss > RAM_HEADROOM * machine.ram_bytes:
        prediction.why_not.append(f"peak RSS {peak_rss / 2**30:.1f} GiB > {RAM_HEADROOM:.0%} of "
                                  f"{machine.ram_bytes / 2**30:.1f} GiB RAM")
    if machine.gpu_bytes and device_peak > machine.gpu_bytes:
        prediction.why_not.append(f"device peak {device_peak / 2**30:.1f} GiB > "
                                  f"{machine.gpu_bytes / 2**30:.1f} GiB GPU memory")
    # The device budget counts activations only where activation_offload hands them to the swap manager.
    counted = device_peak - resident_grads - (activations if cfg.activation_offload == "none" else 0)
    if budgets.device_budget is not None and counted > budgets.device_budget:
        prediction.why_not.append(f"device peak {counted / 2**30:.2f} GiB > device budget "
                                  f"{budgets.device_budget / 2**30:.2f} GiB")
    heads = tied_head_bytes(plan, shape.model, dtype) if zo.stage == 3 else []
    least_host = sum(host_minimum(cfg, every, dtype, heads=heads).values())
    if host_budget < least_host:
        prediction.why_not.append(f"host budget {host_budget / 2**30:.2f} GiB < the {least_host / 2**30:.2f} GiB "
                                  "the engine needs at least (initialize refuses it)")
    if tiers["host"] > host_budget:
        prediction.why_not.append(f"{tiers['host'] / 2**30:.1f} GiB homed on host > host budget "
                                  f"{host_budget / 2**30:.1f} GiB")
    if tiers["nvme"] and nvme_free is not None and tiers["nvme"] > nvme_free:
        prediction.why_not.append(f"{tiers['nvme'] / 2**30:.1f} GiB on nvme > {nvme_free / 2**30:.1f} GiB free")
    prediction.fits = not prediction.why_not
    return prediction


def speculated_share(cfg, on_nvme: int, kept: float, nvme_free: int | None) -> float:
    """The share of a step's sub-groups that can step early: those whose previous state (`kept` bytes a step, the
    nvme writes of the optimizer phase) fits beside the `on_nvme` bytes stored, within the nvme budget, or
    without one within the disk's free space less the store's reserve (tiering/nvme_store.py; the filesystem's
    size taken as its free space)."""
    if not kept:
        return 1.0
    budget = cfg.zero_tiering.nvme_budget
    if budget is not None:
        room = budget - on_nvme
    elif nvme_free is not None:
        room = nvme_free - on_nvme - min(RESERVE_MAX, RESERVE_SHARE * nvme_free)
    else:
        return 1.0
    return min(1.0, max(0.0, room / kept))


def state_bytes(cfg, flats: list, *, master: bool) -> int:
    """Bytes of optimizer state (moments, and the masters where `master`) over every sub-group of `flats`."""
    return sum(cfg.state_format.state_bytes(n, master=master, index=index, extents=flat.extents)
               for flat in flats for index, n in sub_groups(cfg, flat))


def working_window_config(config: dict) -> dict:
    """`config` with the host budget left to the engine's rule and no parameter cache (max_in_cpu 0): the
    budget it derives is what is homed on host plus the working window."""
    config = json.loads(json.dumps(config))
    offload = config.pop("zero_tiering", {}).get("activation_offload")
    if offload is not None:  # the room it sets aside is part of the derived budget
        config["zero_tiering"] = {"activation_offload": offload}
    offload_param = config.get("zero_optimization", {}).get("offload_param")
    if offload_param is not None:
        offload_param["max_in_cpu"] = 0
    return config


def host_budget_for(shape: ModelShape, machine: Machine, config: dict, base_rss: int,
                    checkpointing: bool = False) -> int | None:
    """For a placement with state on nvme: the host budget that keeps the predicted peak RSS within RAM (more
    host budget caches more and moves fewer bytes), or None where the derived budget already fits."""
    probe = predict(shape, machine, config, base_rss, None, checkpointing)
    if not probe.tier_bytes["nvme"] or probe.peak_rss_bytes <= RAM_HEADROOM * machine.ram_bytes:
        return None
    over = probe.peak_rss_bytes - RAM_HEADROOM * machine.ram_bytes
    budget = int(probe.host_budget - over / ALLOCATOR_SLACK) // (1 << 20) << 20
    return max(budget, 1 << 28)
