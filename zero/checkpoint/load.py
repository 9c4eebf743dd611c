"""Loading a checkpoint into a ZeroEngine (engine.load_checkpoint).

Loading verifies every file it reads against the manifest before it changes anything in the engine. A
checkpoint saved with N ranks loads into M ranks (and into another stage): records are in unit coordinates,
so each rank reads the ranges `engine.state_tensors()` says it now holds.
"""
from __future__ import annotations

import os
import random
import warnings
from typing import TYPE_CHECKING, Any

import torch

from ..optim.driver import STATE_PARTS
from ..optim.state_format import StateFormat
from .format import (
    CHUNK,
    LATEST,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    RecordReader,
    check_tag_name,
    dtype_name,
    read_latest,
    read_manifest,
    verify_files,
)
from .layout import extras, frozen_units, unit_layout
from .ranks import agree

if TYPE_CHECKING:
    from ..engine import ZeroEngine


def check_fits(engine: ZeroEngine, manifest: dict, tag_dir: str) -> None:
    """The checkpoint's model (unit layout) and compute dtype must be the engine's."""
    saved, ours = manifest["units"], unit_layout(engine)
    where = f"checkpoint {tag_dir!r}"
    if len(saved) != len(ours):
        raise CheckpointMismatchError(f"{where} has {len(saved)} units, the engine {len(ours)}: another model or "
                                      "wrap policy")
    for index, (a, b) in enumerate(zip(saved, ours)):
        for key in ("name", "numel", "group"):
            if a[key] != b[key]:
                raise CheckpointMismatchError(f"{where}: unit {index} {key} is {a[key]!r} there, {b[key]!r} here")
        if a["slots"] != b["slots"]:
            diff = next(((x, y) for x, y in zip(a["slots"], b["slots"]) if x != y), (a["slots"], b["slots"]))
            raise CheckpointMismatchError(f"{where}: unit {index} ({a['name']!r}) holds {diff[0]} there, "
                                          f"{diff[1]} here")
    if manifest["compute_dtype"] != dtype_name(engine.compute_dtype):
        raise CheckpointMismatchError(f"{where} holds {manifest['compute_dtype']} parameters; the engine computes "
                                      f"in {dtype_name(engine.compute_dtype)}")


def load_checkpoint(engine: ZeroEngine, load_dir: str | os.PathLike, tag: Any = None,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_rng_states: bool = False) -> tuple[str | None, Any]:
    """Load a checkpoint saved by save_checkpoint (any world size, any stage, same model and dtype) into the
    engine; every rank must call it. Returns (tag directory, client_state), or (None, None) with a warning
    when no tag is given and `load_dir` has no `latest` (as DeepSpeed does).

    Verifies every file this rank reads against the manifest before changing anything. The state file is
    unpickled (client_state may hold any object, as in DeepSpeed): load only checkpoints you trust.
    `load_optimizer_states=False` loads the weights (parameters and fp32 masters) and starts the optimizer
    afresh (zero moments, step 0, the engine's own hyperparameters and loss scale). `load_rng_states`: put the
    random streams (Python, numpy, torch, CUDA) back where they were at the save, for a resume that draws as the
    uninterrupted run (the main job's); off by default, as DeepSpeed's load leaves them as the script set them."""
    load_dir = os.fspath(load_dir)
    if tag is None:
        tag = latest_tag(engine, load_dir)
        if tag is None:
            warnings.warn(f"no `latest` file in {load_dir!r}: nothing loaded (pass tag= to load a given "
                          "checkpoint)", stacklevel=3)
            return None, None
    tag_dir = os.path.join(load_dir, str(tag))
    error: BaseException | None = None
    try:  # nothing in the engine changes until every rank has verified what it will read
        check_tag_name(str(tag))  # never a path out of load_dir
        if not os.path.isdir(tag_dir):
            raise CheckpointNotFoundError(tag_dir, f"no checkpoint with tag {tag!r}")
        manifest = read_manifest(tag_dir)
        check_fits(engine, manifest, tag_dir)
        rank, world, saved_world = engine.dp.rank, engine.dp.world_size, manifest["world_size"]
        same_world = saved_world == world
        reader = RecordReader(tag_dir, manifest, prefer_rank=rank if same_world else 0)
        parts = ("param", *STATE_PARTS) if load_optimizer_states else ("param", "master")
        ranks = set()
        for piece in engine.state_tensors():
            if piece.part in parts:
                ranks |= reader.ranks_for(piece.unit, piece.part, piece.start, piece.numel)
        excluded = set(manifest.get("excluded", ()))
        for name, shape in extra_shapes(engine, excluded).items():
            record = reader.extras.get(name)
            if record is None:
                raise CheckpointMismatchError(f"checkpoint {tag_dir!r} has no {name!r}")
            if tuple(record.shape) != shape:  # (a copy would broadcast a smaller one: silently wrong)
                raise CheckpointMismatchError(f"checkpoint {tag_dir!r} holds {name!r} as {list(record.shape)}, the "
                                              f"engine as {list(shape)}")
            ranks.add(record.rank)
        entries = {entry["rank"]: entry for entry in manifest["ranks"]}
        state_entry = entries[rank if same_world else 0]
        verify_files(tag_dir, manifest, [entries[r]["data"] for r in sorted(ranks)] + [state_entry["state"]])
        # The state file is unpickled (client_state may hold any object): load only checkpoints you trust.
        state = torch.load(os.path.join(tag_dir, state_entry["state"]), map_location="cpu", weights_only=False)
        if load_optimizer_states and len(state["optimizer"]["param_groups"]) != len(engine.optimizer.param_groups):
            raise CheckpointMismatchError(f"checkpoint {tag_dir!r} has {len(state['optimizer']['param_groups'])} "
                                          f"param groups, the engine {len(engine.optimizer.param_groups)}")
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it before raising
        error = exc
    agree(engine.dp, error, f"verifying checkpoint {tag_dir!r}")
    try:
        with reader:
            load_tensors(engine, reader, parts, excluded)
        apply_state(engine, state, load_optimizer_states, load_lr_scheduler_states, same_world, saved_world,
                    load_rng_states)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it before raising
        error = CheckpointError(f"loading {tag_dir!r} failed part way, after verification: the engine's state is "
                                f"partly loaded; load again or rebuild the engine ({type(exc).__name__}: {exc})")
        error.__cause__ = exc
    agree(engine.dp, error, f"loading checkpoint {tag_dir!r}")
    engine.state_loaded()  # collectives (gathered units refilled): every rank, once every rank has loaded
    saved_format = StateFormat(**manifest.get("state_format", {}))
    if saved_format != engine.driver.state_format:
        warnings.warn(f"checkpoint {tag_dir!r} holds {saved_format.describe()} optimizer state; this run stores "
                      f"{engine.driver.state_format.describe()}: converted on load", stacklevel=3)
    return tag_dir, state["client_state"]


def latest_tag(engine: ZeroEngine, load_dir: str) -> str | None:
    """The tag `latest` names, the same on every rank: each reads its own `latest` (directories may be each
    node's own), and a rank that fails to, or reads another tag, is every rank's error, not a rank waiting
    forever in the load's first collective."""
    error, tag = None, None
    try:
        tag = read_latest(load_dir)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it before raising
        error = exc
    agree(engine.dp, error, f"reading {os.path.join(load_dir, LATEST)!r}")
    tags = engine.dp.all_gather_object(tag)
    if len(set(tags)) > 1:
        raise CheckpointMismatchError(f"the ranks' `latest` in {load_dir!r} name different checkpoints: "
                                      + ", ".join(f"rank {rank}: {t!r}" for rank, t in enumerate(tags)))
    return tag


def extra_shapes(engine: ZeroEngine, excluded: set[str]) -> dict[str, tuple[int, ...]]:
    """What the checkpoint must hold whole, by name, with the engine's shape: what no unit holds, and frozen units'
    parameters, less those it left out (`exclude_frozen_parameters`: the engine keeps its own)."""
    shapes = {name: tuple(tensor.shape) for name, tensor, _ in extras(engine)}
    shapes.update((slot.name, tuple(slot.shape)) for unit in frozen_units(engine) for slot in unit.flat.slots)
    return {name: shape for name, shape in shapes.items() if name not in excluded}


def load_tensors(engine: ZeroEngine, reader: RecordReader, parts: tuple[str, ...], excluded: set[str]) -> None:
    """Every state tensor in `parts` read from the checkpoint (the others, optimizer moments not loaded, start
    afresh at zero), then frozen parameters and buffers (but those the save excluded)."""
    for piece in engine.state_tensors():
        with piece.held(True) as tensor:
            if piece.part in parts:
                fill(reader, piece.unit, piece.part, piece.start, tensor)
            else:
                tensor.zero_()
    for name, tensor, _ in extras(engine):
        if name not in excluded:
            with torch.no_grad():
                tensor.copy_(reader.read_extra(name))
    for unit in frozen_units(engine):
        if not any(slot.name in excluded for slot in unit.flat.slots):
            load_frozen(engine, reader, unit)


def load_frozen(engine: ZeroEngine, reader: RecordReader, unit) -> None:
    """A frozen unit's parameters, recorded whole by name, into this rank's shard of it (one unit in host memory)."""
    flat = unit.flat
    full = torch.zeros(flat.padded_numel, dtype=engine.compute_dtype)
    for slot in flat.slots:
        full.narrow(0, slot.offset, slot.numel).copy_(reader.read_extra(slot.name).reshape(-1))
    with engine.placement.shard(unit, write=True, overwrite=True) as shard:
        shard.copy_(full.narrow(0, *engine.placement.rank_range(unit)))


def apply_state(engine: ZeroEngine, state: dict, load_optimizer_states: bool, load_lr_scheduler_states: bool,
                same_world: bool, saved_world: int, load_rng_states: bool) -> None:
    engine.counters.load_state_dict(state["engine"])
    if load_optimizer_states:
        for group, saved in zip(engine.optimizer.param_groups, state["optimizer"]["param_groups"]):
            group.update(saved)
        engine.optimizer.step_count = state["optimizer"]["step_count"]
        if engine.loss_scaler is not None and state["loss_scaler"] is not None:
            engine.loss_scaler.load_state_dict(state["loss_scaler"])
    else:
        engine.optimizer.step_count = 0
    scheduler = engine.lr_scheduler
    if load_lr_scheduler_states and scheduler is not None and state["lr_scheduler"] is not None:
        scheduler.load_state_dict(state["lr_scheduler"])
    if not load_rng_states:
        return
    if same_world:
        set_rng_state(state["rng"])
    else:
        warnings.warn(f"checkpoint saved with {saved_world} ranks, loaded into {engine.dp.world_size}: the "
                      "model and optimizer state are resharded, RNG states are not restored", stacklevel=3)


def fill(reader: RecordReader, index: int, part: str, start: int, target: torch.Tensor) -> None:
    """Read [start, start + numel) of a unit's part into `target` (host: in place; device: via host chunks)."""
    flat = target.view(-1)
    if flat.device.type == "cpu":
        reader.read(index, part, start, flat)
        return
    per = max(1, CHUNK // flat.element_size())
    staging = torch.empty(min(per, flat.numel()), dtype=flat.dtype)
    for offset in range(0, flat.numel(), per):
        n = min(per, flat.numel() - offset)
        flat[offset:offset + n].copy_(reader.read(index, part, start + offset, staging[:n]))


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        try:
            import numpy as np

            np.random.set_state(state["numpy"])
        except ImportError:
            pass
    if "cuda" in state and torch.cuda.is_available():
        if len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            warnings.warn(f"CUDA RNG states of {len(state['cuda'])} devices saved, {torch.cuda.device_count()} "
                          "here: not restored", stacklevel=3)
