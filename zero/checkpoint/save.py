"""Saving a ZeroEngine's whole training state (engine.save_checkpoint).

Every piece of state is saved, per rank, streamed one tensor at a time (held, written, released: the model is
never whole in memory): what `engine.state_tensors()` gives (this rank's compute-dtype range of each unit,
wherever the placement keeps it, and the fp32 master and both Adam moments of every sub-group, wherever they
rest), frozen parameters (unless excluded) and persistent buffers, the loss scaler, the LR scheduler, the
optimizer's step count and param-group hyperparameters, the engine's counters, the RNG states (python, numpy,
torch, CUDA) and the caller's client_state. The layout on disk, the manifest and the atomicity rules are in format.py.

Saving happens only at a gradient accumulation boundary (no gradient is half accumulated), so a resumed run
continues bitwise where the saved one stood.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import random
import warnings
from typing import TYPE_CHECKING, Any

import torch

from .cleanup import remove_dead_temps, remove_replaced
from .format import (
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    MODEL_CONFIG,
    AtomicFile,
    CheckpointBoundaryError,
    CheckpointError,
    Record,
    check_tag_name,
    data_file,
    dtype_name,
    fsync_dir,
    library_version,
    manifest_bytes,
    save_id,
    state_file,
    write_atomic,
)
from .layout import aliases, extras, frozen_names, frozen_units, model_config, unit_layout
from .ranks import agree

if TYPE_CHECKING:
    from ..engine import ZeroEngine


def check_boundary(engine: ZeroEngine) -> None:
    """A checkpoint holds no gradients: refuse one inside an accumulation window, or while sub-groups hold
    gradients not yet applied (a backward without its step, or an optimizer step that failed part way)."""
    counters = engine.counters
    accum, micro = counters.gradient_accumulation_steps, counters.micro_steps
    pending = engine.unapplied_gradients()
    if counters.boundary is None and counters.in_step():  # (else: the gradients pending, below, say it)
        raise CheckpointBoundaryError(
            f"save_checkpoint at micro step {micro} is inside a gradient accumulation window "
            f"(gradient_accumulation_steps {accum}): the gradients of {counters.in_step()} micro-batches "
            f"are accumulated and a checkpoint does not hold them. Save right after the engine.step() that "
            f"completes an optimizer step.")
    if pending:
        raise CheckpointBoundaryError(
            f"save_checkpoint at micro step {micro}: {len(pending)} sub-groups "
            f"({', '.join(pending[:3])}{', ...' if len(pending) > 3 else ''}) "
            f"hold gradients not yet applied: a backward without its engine.step(), or an optimizer step that "
            f"failed part way. A checkpoint now would hold a half-applied step.")


def check_tag(engine: ZeroEngine, tag: str) -> str:
    """The tag every rank saves under: rank 0's. Ranks that passed others are an error with
    `checkpoint.tag_validation` Fail, a warning with Warn (one checkpoint's parts must share its directory)."""
    tags = engine.dp.all_gather_object(tag)  # first, so a bad tag on one rank is every rank's error
    check_tag_name(tags[0])
    if len(set(tags)) > 1:
        mode = str(engine.config.checkpoint.tag_validation).lower()
        message = f"ranks save under different tags: {tags}"
        if mode == "fail":
            raise CheckpointError(message + " (checkpoint.tag_validation is Fail)")
        if mode == "warn":
            warnings.warn(message + f"; saving under rank 0's, {tags[0]!r}", stacklevel=3)
    return tags[0]


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def small_state(engine: ZeroEngine, client_state: Any) -> dict:
    scheduler = engine.lr_scheduler
    return {
        "rank": engine.dp.rank,
        "world_size": engine.dp.world_size,
        "engine": engine.counters.state_dict(),
        "optimizer": {"step_count": engine.optimizer.step_count,
                      "param_groups": [{k: v for k, v in group.items() if k != "params"}
                                       for group in engine.optimizer.param_groups]},
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "lr_scheduler": scheduler.state_dict() if callable(getattr(scheduler, "state_dict", None)) else None,
        "rng": rng_state(),
        "client_state": client_state,
    }


def write_rank(engine: ZeroEngine, tag_dir: str, client_state: Any, exclude_frozen_parameters: bool) -> dict:
    """This rank's data file (streamed, one segment held at a time) and state file. Returns its manifest entry."""
    rank, world, save = engine.dp.rank, engine.dp.world_size, save_id()
    records: list[Record] = []

    def extra(name: str, tensor: torch.Tensor, is_param: bool) -> None:
        if tensor.is_meta:
            raise CheckpointError(f"cannot save {name!r}: it is on the meta device (never materialized)")
        offset, nbytes, digest = f.write_tensor(tensor)
        records.append(Record(rank, "extra", offset, nbytes, dtype_name(tensor.dtype), digest, name=name,
                              shape=tuple(tensor.shape), is_param=is_param))

    with AtomicFile(tag_dir, data_file(rank, world, save)) as f:
        for piece in engine.state_tensors():
            with piece.held(False) as tensor:
                offset, nbytes, digest = f.write_tensor(tensor)
            records.append(Record(rank, "unit", offset, nbytes, dtype_name(tensor.dtype), digest, unit=piece.unit,
                                  part=piece.part, start=piece.start, numel=piece.numel))
        for name, tensor, is_param in extras(engine):
            if not (exclude_frozen_parameters and is_param and not tensor.requires_grad):
                extra(name, tensor, is_param)
        if not exclude_frozen_parameters:
            for unit in frozen_units(engine):  # gathered on every rank (a collective), written by the first
                with engine.gathered_parameters([slot.param for slot in unit.flat.slots]):
                    if rank == 0:
                        for slot in unit.flat.slots:
                            extra(slot.name, slot.param.detach(), True)
        files = {f.name: f.commit()}
    buffer = io.BytesIO()
    torch.save(small_state(engine, client_state), buffer)
    files[state_file(rank, world, save)] = write_atomic(tag_dir, state_file(rank, world, save), buffer.getvalue())
    return {"rank": rank, "data": data_file(rank, world, save), "state": state_file(rank, world, save),
            "records": [r.to_json() for r in records], "files": files}


def save_checkpoint(engine: ZeroEngine, save_dir: str | os.PathLike, tag: Any = None, client_state: Any = None,
                    save_latest: bool = True, exclude_frozen_parameters: bool = False) -> str:
    """Save the engine's whole training state under `save_dir/tag` (default tag `global_step<N>`); every
    rank must call it. Returns the tag directory. `exclude_frozen_parameters`: frozen parameters are not written
    (the manifest names them: a load keeps the engine's). See the module docstring and format.py."""
    error: BaseException | None = None
    try:
        check_boundary(engine)
    except CheckpointBoundaryError as exc:  # (a step that failed part way may have failed on one rank only)
        error = exc
    agree(engine.dp, error, "saving a checkpoint at this step")
    tag = check_tag(engine, f"global_step{engine.counters.global_steps}" if tag is None else str(tag))
    save_dir = os.fspath(save_dir)
    tag_dir = os.path.join(save_dir, tag)
    try:  # (a tag saved before keeps its manifest and files until the new manifest replaces them: format.py)
        os.makedirs(tag_dir, exist_ok=True)
        fsync_dir(save_dir)  # the tag directory's entry survives a power loss, `latest` or not
    except OSError as exc:
        error = exc
    agree(engine.dp, error, f"creating checkpoint directory {tag_dir!r}")
    entry = None
    try:
        entry = write_rank(engine, tag_dir, client_state, exclude_frozen_parameters)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it before raising
        error = exc
    agree(engine.dp, error, f"saving checkpoint {tag_dir!r}")
    entries = engine.dp.all_gather_object(entry)
    if engine.dp.rank == 0:
        try:
            write_manifest(engine, save_dir, tag, tag_dir, entries, save_latest, exclude_frozen_parameters)
        except Exception as exc:  # noqa: BLE001
            error = exc
    agree(engine.dp, error, f"writing the manifest of {tag_dir!r}")
    return tag_dir


def write_manifest(engine: ZeroEngine, save_dir: str, tag: str, tag_dir: str, entries: list[dict],
                   save_latest: bool, exclude_frozen_parameters: bool) -> None:
    files: dict[str, dict] = {}
    for entry in entries:
        files.update(entry.pop("files"))
    config = model_config(engine.module)
    if config is not None:
        files[MODEL_CONFIG] = write_atomic(tag_dir, MODEL_CONFIG, json.dumps(config, indent=1).encode())
    module = engine.module
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "library_version": library_version(), "tag": tag,
        "world_size": engine.dp.world_size, "stage": engine.stage,
        "compute_dtype": dtype_name(engine.compute_dtype),
        "state_format": dataclasses.asdict(engine.driver.state_format),
        "gradient_accumulation_steps": engine.counters.gradient_accumulation_steps,
        **engine.counters.state_dict(),
        "model_class": f"{type(module).__module__}.{type(module).__qualname__}",
        "model_config": MODEL_CONFIG if config is not None else None,
        "units": unit_layout(engine), "aliases": aliases(engine),
        "excluded": frozen_names(engine) if exclude_frozen_parameters else [],
        "ranks": sorted(entries, key=lambda e: e["rank"]), "files": files,
    }
    write_atomic(tag_dir, MANIFEST, manifest_bytes(manifest))
    if save_latest:
        write_atomic(save_dir, LATEST, tag.encode())
    remove_replaced(tag_dir, [MANIFEST, *files])
    remove_dead_temps(save_dir)
