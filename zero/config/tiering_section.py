"""The `zero_tiering` section: our own settings, namespaced so a DeepSpeed file never collides with them.
DeepSpeed rejects this section, so users add it knowingly, only to files zero-tiering reads."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .schema import Section, setting
from .sizes import parse_size


@dataclass(frozen=True, kw_only=True)
class ZeroTieringSection(Section):
    """Tier budgets, the NVMe I/O engine, integrity checks and tracing. Sizes are bytes, or strings such as
    "2GiB" / "512MB" parsed exactly (see sizes.py)."""

    engine: Literal["auto", "libaio", "threads"] = "auto"
    """NVMe I/O engine. "libaio": Linux kernel AIO with O_DIRECT; "threads": pread/pwrite from a thread
    pool; "auto": libaio where the library loads and O_DIRECT works on the path, else threads (the store
    reports which it chose and why)."""

    device_budget: int | None = setting(None, convert=parse_size)
    """Bytes of device memory the swap manager may hold; null: what the device has."""

    host_budget: int | None = setting(None, convert=parse_size)
    """Bytes of host memory the swap manager may hold; null: what is homed on the host plus a working window
    (see zero.services.budgets.swap_config)."""

    nvme_budget: int | None = setting(None, convert=parse_size)
    """Bytes the nvme store file may grow to; null: what the filesystem gives."""

    checksums: bool = True
    """Verify a checksum of every segment read back from nvme; a mismatch raises and names the segment."""

    trace_path: str | None = None
    """Write every move and compute span as Chrome trace JSON (Perfetto) to this file; null: no trace."""

    overlap_step: bool = False
    """Stage 3 with offload_optimizer: run the optimizer step on a background thread while the next forward
    runs, each unit's forward waiting for that unit's update (results are unchanged, bit for bit). The host
    budget must then hold the step's working set and the forward's at once."""

    accumulation: Literal["unit-major", "micro-batch"] = "unit-major"
    """How engine.train_batch (and the main job, and ZeroTrainer, with gradient_accumulation_steps above 1) runs a
    step's micro-batches. unit-major: as one batch through each unit a micro-batch slice at a time, each unit
    gathered once a step each way (stage 3; equal to micro-batch within rounding, but dropout draws its masks in
    another order); micro-batch: one after another, forward, backward and step each, as a loop over them would."""

    speculative_step: bool | None = None
    """Step each sub-group during the backward, as soon as its gradient is final, betting that the step will not
    clip or overflow; validated at the accumulation boundary and rolled back (then stepped with the clipped
    gradient, or skipped) where the bet failed, so results are those of the serial step, bit for bit. After a
    step that clipped or overflowed the next one does not bet. Served with stage 3, offload_optimizer and
    offload_param cpu or nvme (below stage 3 gradients are reduced after the backward: nothing to overlap; a
    shard resting on the device would need a second copy there); null: on where served; false: every sub-group
    steps after the backward."""

    moments: Literal["fp32", "bf16", "int8"] | None = None
    """How the Adam moments are stored: "fp32" (exact, torch AdamW bit for bit), "bf16", or "int8" (block-wise: 256
    elements share an fp32 absmax; each parameter on its own, those under 4096 elements fp32); null: bf16 with
    DeepSpeed's bf16.bf16_optimizer_states, else fp32. Compact moments move fewer bytes a step at a measured price in loss
    (bench/RESULTS.md)."""

    master: Literal["fp32", "bf16", "bf16-sr", "bf16-kahan"] | None = None
    """How the master weights are stored: "fp32" (exact), "bf16" (rounded to nearest after each step, as DeepSpeed's
    bf16.bf16_master_weights_and_grads), "bf16-sr" (rounded stochastically: small updates survive on average), or
    "bf16-kahan" (bf16 weights and a bf16 compensation holding what their rounding dropped: 4 bytes, not 6);
    a bf16 master needs bf16 compute, and at stage 3 with parameters in the optimizer's tier it is the parameter
    shard itself, not a copy. null: bf16 with bf16_master_weights_and_grads, else fp32."""

    nonfinite: Literal["error", "skip"] = "error"
    """What a step whose gradient norm is nan or inf does where no fp16 loss scaler handles it (bf16, fp32):
    "error" raises NonFiniteLossError naming the step (nothing of it applied), "skip" drops its gradients and
    counts it in skipped_steps, as an fp16 overflow is."""

    activation_offload: Literal["none", "device", "cpu", "nvme"] | None = None
    """Where the activations autograd saves outside recomputed regions rest between the forward and the backward
    (with activation checkpointing: each checkpointed block's inputs, and what the layers outside the blocks
    save). "cpu" or "nvme": each becomes a segment, copied off the device on the copy stream as the forward goes
    and read back ahead of the backward along the trace (nvme needs an nvme_path in offload_param or
    offload_optimizer); "device": kept where autograd made them, counted against the device budget (the yardstick
    the offloads are measured against); "none": autograd keeps them, uncounted; null: "cpu" with
    activation_checkpointing.cpu_checkpointing, else "none"."""

    activation_host_bytes: int = setting(1 << 30, convert=parse_size, ge=0)
    """What a derived host budget (host_budget null) sets aside for offloaded activations ("cpu": all of them
    must fit; "nvme": the rest spill to nvme). An explicit host_budget must hold them itself."""

    prefetch: bool = True
    """Prefetch segments along the recorded trace; false fetches each on demand (for debugging)."""

    frozen_units: Literal["layer", "block"] = "layer"
    """Stage 3: how frozen parameters (an adapter's base) make units. "layer": one per submodule holding only frozen
    weights, gathered where that layer runs (as DeepSpeed fetches a submodule's parameters): the next layer's are
    read while this one computes. "block": one per block, gathered with it, for a model whose block reads a layer's
    frozen weight outside that layer's forward (where "layer" would find it released)."""

    park_root: bool | None = None
    """Stage 3: give the root unit's device bytes (the embeddings and head, what no block holds) back while the blocks
    run, gathering it again for the head and where a module before the blocks reads its weight in its backward
    (zero/params/root_uses.py). It lowers the least device budget by up to the root's size, at the price
    of one more gather of the root a step (a read from nvme where the host budget does not keep its shard). null:
    where the device budget is below what holding the root takes; true, false: always, never (a model whose forward
    reads root parameters outside the modules holding them is never parked)."""

    collective_timeout: float = setting(600.0, gt=0)
    """Seconds a collective waits for the other ranks before this rank gives up with RankLostError (a rank that
    died closes its connections and is noticed at once; this bounds the wait for one that hangs or whose host
    vanished). Handed to torch.distributed.init_process_group where zero joins the group; a group the caller
    initialized keeps its own timeout. With NCCL, torch's watchdog ends the process once it passes. 600 s, not
    torch's 30 min (DeepSpeed's JSON has no such key): a lost rank frees the job's machines sooner, while the
    longest wait a healthy rank sees (a peer saving a large checkpoint or reading its weights from disk) still
    fits; raise it where those take longer."""
