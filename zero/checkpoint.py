"""Saving and loading a ZeroEngine's whole training state (engine.save_checkpoint / engine.load_checkpoint).

Every piece of state is saved, per rank, streamed one segment at a time (acquire, write, release: the model
is never whole in memory): the parameters in the compute dtype (stages 0-2: this rank's part of each unit's
flat buffer; stage 3: its parameter shard, wherever it rests), the fp32 master weights and both Adam moments
of every sub-group (wherever they rest: device, host or nvme), frozen parameters and persistent buffers,
the loss scaler, the LR scheduler, the optimizer's step count and param-group hyperparameters, the engine's
counters, the RNG states (python, numpy, torch, CUDA) and the caller's client_state. The layout on disk,
the manifest and the atomicity rules are in checkpoint_manifest.py.

Saving happens only at a gradient accumulation boundary (no gradient is half accumulated), so a resumed
run continues bitwise where the saved one stood. Loading verifies every file it reads against the manifest
before it changes anything in the engine. A checkpoint saved with N ranks loads into M ranks (and into
another stage): records are in unit coordinates, so each rank reads the ranges it now owns.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import warnings
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint_manifest import (
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    MODEL_CONFIG,
    AtomicFile,
    CheckpointBoundaryError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    Record,
    RecordReader,
    data_file,
    dtype_name,
    fsync_dir,
    library_version,
    manifest_bytes,
    read_latest,
    read_manifest,
    state_file,
    verify_files,
    write_atomic,
)

if TYPE_CHECKING:
    from .engine import ZeroEngine

STATE_PARTS = ("master", "exp_avg", "exp_avg_sq")


# -- what the engine holds, in unit coordinates ---------------------------------------------------------------


def param_range(engine: ZeroEngine, index: int) -> tuple[int, int]:
    """(start, numel) of unit `index`'s flat buffer this rank keeps in the compute dtype: its shard from stage
    1 on, all of it for stage 0."""
    unit = engine.units[index]
    return (unit.shard_start, unit.shard_numel) if engine.stage >= 1 else (0, unit.padded_numel)


def sub_group_range(engine: ZeroEngine, sg) -> tuple[int, int, int]:
    """(unit index, start, numel) of a sub-group's optimizer state in its unit's flat coordinates."""
    index, offset = sg.owner
    return index, param_range(engine, index)[0] + offset, sg.numel


def unit_layout(engine: ZeroEngine) -> list[dict]:
    return [{"name": unit.name, "numel": unit.numel, "padded_numel": unit.padded_numel, "group": unit.group,
             "slots": [{"name": s.name, "offset": s.offset, "numel": s.numel, "shape": list(s.shape)}
                       for s in unit.slots]}
            for unit in engine.units]


def extras(engine: ZeroEngine) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is_param) of what the units do not hold: parameters not trained (frozen, or outside
    every param group) and persistent buffers, each once, under its first name."""
    in_units = {id(slot.param) for unit in engine.units for slot in unit.slots}
    out = [(name, p, True) for name, p in engine.module.named_parameters() if id(p) not in in_units]
    seen: set[int] = set()
    for module_name, module in engine.module.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is None or name in module._non_persistent_buffers_set or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            out.append((f"{module_name}.{name}" if module_name else name, buffer, False))
    return out


def aliases(engine: ZeroEngine) -> dict[str, str]:
    """{other name: saved name} for tensors the model reaches under several names (tied weights): the saved
    name of a trained parameter is its unit slot's, of anything else its first name."""
    canonical = {id(slot.param): slot.name for unit in engine.units for slot in unit.slots}
    out = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        first = canonical.setdefault(id(p), name)
        if name != first:
            out[name] = first
    for module_name, module in engine.module.named_modules(remove_duplicate=False):
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is None or name in module._non_persistent_buffers_set:
                continue
            full = f"{module_name}.{name}" if module_name else name
            first = canonical.setdefault(id(buffer), full)
            if full != first:
                out[full] = first
    return out


def model_config(module: nn.Module) -> dict | None:
    """The model's config as a dict, for a transformers model (anything with `config.to_dict()`)."""
    config = getattr(module, "config", None)
    if config is None or not callable(getattr(config, "to_dict", None)):
        return None
    try:
        return json.loads(config.to_json_string(use_diff=False))
    except (AttributeError, TypeError):
        return json.loads(json.dumps(config.to_dict(), default=str))


# -- moving bytes between the engine and files ------------------------------------------------------------------


@contextlib.contextmanager
def held(engine: ZeroEngine, name: str, tier: str, dirty: bool = False) -> Iterator[torch.Tensor]:
    """A segment's tensor in `tier`, released afterwards (dirty when written, even part way)."""
    tensor = engine.swap.acquire(name, tier)
    try:
        yield tensor
    finally:
        engine.swap.release(name, dirty=dirty)


@contextlib.contextmanager
def param_tensor(engine: ZeroEngine, index: int, write: bool = False) -> Iterator[torch.Tensor]:
    """This rank's compute-dtype part of unit `index` (param_range): a slice of the flat buffer (stages 0-2)
    or the unit's parameter shard segment (stage 3)."""
    if engine.partitioner is not None:
        with held(engine, engine.partitioner.units[index].segment, engine.partitioner.shard_tier, write) as t:
            yield t
        return
    start, numel = param_range(engine, index)
    yield engine.flats[index].narrow(0, start, numel)


def fill(reader: RecordReader, index: int, part: str, start: int, target: torch.Tensor) -> None:
    """Read [start, start + numel) of a unit's part into `target` (host: in place; device: via host chunks)."""
    flat = target.view(-1)
    if flat.device.type == "cpu":
        reader.read(index, part, start, flat)
        return
    per = max(1, (16 << 20) // flat.element_size())
    staging = torch.empty(min(per, flat.numel()), dtype=flat.dtype)
    for offset in range(0, flat.numel(), per):
        n = min(per, flat.numel() - offset)
        flat[offset:offset + n].copy_(reader.read(index, part, start + offset, staging[:n]))


# -- agreement among ranks --------------------------------------------------------------------------------------


def all_gather_object(engine: ZeroEngine, obj: Any) -> list[Any]:
    if engine.dp.world_size == 1:
        return [obj]
    out: list[Any] = [None] * engine.dp.world_size
    dist.all_gather_object(out, obj, group=engine.dp.group)
    return out


def agree(engine: ZeroEngine, error: BaseException | None, what: str) -> None:
    """Every rank raises if any rank failed (its own error, or one naming the ranks that failed), so no rank
    waits forever in a later collective for a rank that gave up."""
    failures = all_gather_object(engine, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(rank, text) for rank, text in enumerate(failures) if text is not None]
    if failed:
        detail = "; ".join(f"rank {rank}: {text}" for rank, text in failed)
        raise CheckpointError(f"{what} failed on {len(failed)} rank(s): {detail}")


# -- save -----------------------------------------------------------------------------------------------------


def check_boundary(engine: ZeroEngine) -> None:
    """A checkpoint holds no gradients: refuse one inside an accumulation window, or while sub-groups hold
    gradients not yet applied (a backward without its step, or an optimizer step that failed part way)."""
    accum = engine.gradient_accumulation_steps
    pending = [sg.name for sg in engine.driver.sub_groups if not sg.grad_fresh]
    if engine.micro_steps % accum:
        raise CheckpointBoundaryError(
            f"save_checkpoint at micro step {engine.micro_steps} is inside a gradient accumulation window "
            f"(gradient_accumulation_steps {accum}): the gradients of {engine.micro_steps % accum} micro-batches "
            f"are accumulated and a checkpoint does not hold them. Save right after the engine.step() that "
            f"completes an optimizer step (micro_steps a multiple of {accum}).")
    if pending:
        raise CheckpointBoundaryError(
            f"save_checkpoint at micro step {engine.micro_steps}: {len(pending)} of "
            f"{len(engine.driver.sub_groups)} sub-groups ({', '.join(pending[:3])}{', ...' if len(pending) > 3 else ''}) "
            f"hold gradients not yet applied: a backward without its engine.step(), or an optimizer step that "
            f"failed part way. A checkpoint now would hold a half-applied step.")


def check_tag(engine: ZeroEngine, tag: str) -> None:
    if not tag or tag in (".", "..", LATEST) or "/" in tag or "\\" in tag or tag.startswith("."):
        raise CheckpointError(f"checkpoint tag {tag!r} is not a plain directory name")
    tags = all_gather_object(engine, tag)
    if len(set(tags)) > 1:
        mode = str(engine.config.checkpoint.tag_validation).lower()
        message = f"ranks save under different tags: {tags}"
        if mode == "fail":
            raise CheckpointError(message + " (checkpoint.tag_validation is Fail)")
        if mode == "warn":
            warnings.warn(message, stacklevel=3)


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


def small_state(engine: ZeroEngine, client_state: Any) -> dict:
    scheduler = engine.lr_scheduler
    return {
        "rank": engine.dp.rank,
        "world_size": engine.dp.world_size,
        "engine": {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                   "skipped_steps": engine.skipped_steps},
        "optimizer": {"step_count": engine.optimizer.step_count,
                      "param_groups": [{k: v for k, v in group.items() if k != "params"}
                                       for group in engine.optimizer.param_groups]},
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "lr_scheduler": scheduler.state_dict() if callable(getattr(scheduler, "state_dict", None)) else None,
        "rng": rng_state(),
        "client_state": client_state,
    }


def write_rank(engine: ZeroEngine, tag_dir: str, client_state: Any) -> dict:
    """This rank's data file (streamed, one segment held at a time) and state file. Returns its manifest entry."""
    rank, world = engine.dp.rank, engine.dp.world_size
    records: list[Record] = []

    def unit_record(f: AtomicFile, tensor: torch.Tensor, index: int, part: str, start: int) -> None:
        offset, nbytes, digest = f.write_tensor(tensor)
        records.append(Record(rank, "unit", offset, nbytes, dtype_name(tensor.dtype), digest, unit=index,
                              part=part, start=start, numel=tensor.numel()))

    with AtomicFile(tag_dir, data_file(rank, world)) as f:
        for index in range(len(engine.units)):
            with param_tensor(engine, index) as tensor:
                unit_record(f, tensor, index, "param", param_range(engine, index)[0])
        for sg in engine.driver.sub_groups:
            index, start, _ = sub_group_range(engine, sg)
            for part in STATE_PARTS:
                with engine.driver.held(sg, part) as tensor:
                    unit_record(f, tensor, index, part, start)
        for name, tensor, is_param in extras(engine):
            if tensor.is_meta:
                raise CheckpointError(f"cannot save {name!r}: it is on the meta device (never materialized)")
            offset, nbytes, digest = f.write_tensor(tensor)
            records.append(Record(rank, "extra", offset, nbytes, dtype_name(tensor.dtype), digest, name=name,
                                  shape=tuple(tensor.shape), is_param=is_param))
        files = {f.name: f.commit()}
    buffer = io.BytesIO()
    torch.save(small_state(engine, client_state), buffer)
    files[state_file(rank, world)] = write_atomic(tag_dir, state_file(rank, world), buffer.getvalue())
    return {"rank": rank, "data": data_file(rank, world), "state": state_file(rank, world),
            "records": [r.to_json() for r in records], "files": files}


def save_checkpoint(engine: ZeroEngine, save_dir: str | os.PathLike, tag: Any = None, client_state: Any = None,
                    save_latest: bool = True) -> str:
    """Save the engine's whole training state under `save_dir/tag` (default tag `global_step<N>`); every
    rank must call it. Returns the tag directory. See the module docstring and checkpoint_manifest.py."""
    check_boundary(engine)
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    check_tag(engine, tag)
    save_dir = os.fspath(save_dir)
    tag_dir = os.path.join(save_dir, tag)
    error: BaseException | None = None
    try:
        os.makedirs(tag_dir, exist_ok=True)
        if engine.dp.rank == 0 and os.path.exists(os.path.join(tag_dir, MANIFEST)):
            os.unlink(os.path.join(tag_dir, MANIFEST))  # this tag is incomplete until its new manifest lands
            fsync_dir(tag_dir)
    except OSError as exc:
        error = exc
    agree(engine, error, f"creating checkpoint directory {tag_dir!r}")
    entry = None
    try:
        entry = write_rank(engine, tag_dir, client_state)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it before raising
        error = exc
    agree(engine, error, f"saving checkpoint {tag_dir!r}")
    entries = all_gather_object(engine, entry)
    if engine.dp.rank == 0:
        try:
            write_manifest(engine, save_dir, tag, tag_dir, entries, save_latest)
        except Exception as exc:  # noqa: BLE001
            error = exc
    agree(engine, error, f"writing the manifest of {tag_dir!r}")
    return tag_dir


def write_manifest(engine: ZeroEngine, save_dir: str, tag: str, tag_dir: str, entries: list[dict],
                   save_latest: bool) -> None:
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
        "gradient_accumulation_steps": engine.gradient_accumulation_steps,
        "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "model_class": f"{type(module).__module__}.{type(module).__qualname__}",
        "model_config": MODEL_CONFIG if config is not None else None,
        "units": unit_layout(engine), "aliases": aliases(engine),
        "ranks": sorted(entries, key=lambda e: e["rank"]), "files": files,
    }
    write_atomic(tag_dir, MANIFEST, manifest_bytes(manifest))
    if save_latest:
        write_atomic(save_dir, LATEST, tag.encode())


# -- load -----------------------------------------------------------------------------------------------------


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
                    load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True) -> tuple[str | None, Any]:
    """Load a checkpoint saved by save_checkpoint (any world size, any stage, same model and dtype) into the
    engine; every rank must call it. Returns (tag directory, client_state), or (None, None) with a warning
    when no tag is given and `load_dir` has no `latest` (as DeepSpeed does).

    Verifies every file this rank reads against the manifest before changing anything. The state file is
    unpickled (client_state may hold any object, as in DeepSpeed): load only checkpoints you trust.
    `load_optimizer_states=False` loads the weights (parameters and fp32 masters) and starts the optimizer
    afresh (zero moments, step 0, the engine's own hyperparameters and loss scale)."""
    load_dir = os.fspath(load_dir)
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            warnings.warn(f"no `latest` file in {load_dir!r}: nothing loaded (pass tag= to load a given "
                          "checkpoint)", stacklevel=3)
            return None, None
    tag_dir = os.path.join(load_dir, str(tag))
    error: BaseException | None = None
    try:  # nothing in the engine changes until every rank has verified what it will read
        if not os.path.isdir(tag_dir):
            raise CheckpointNotFoundError(tag_dir, f"no checkpoint with tag {tag!r}")
        manifest = read_manifest(tag_dir)
        check_fits(engine, manifest, tag_dir)
        rank, world, saved_world = engine.dp.rank, engine.dp.world_size, manifest["world_size"]
        same_world = saved_world == world
        reader = RecordReader(tag_dir, manifest, prefer_rank=rank if same_world else 0)
        parts = STATE_PARTS if load_optimizer_states else ("master",)
        wanted = [("param", index, *param_range(engine, index)) for index in range(len(engine.units))]
        wanted += [(part, *sub_group_range(engine, sg)[:2], sg.numel)
                   for sg in engine.driver.sub_groups for part in parts]
        ranks = set()
        for part, index, start, numel in wanted:
            ranks |= reader.ranks_for(index, part, start, numel)
        for name, _, _ in extras(engine):
            if name not in reader.extras:
                raise CheckpointMismatchError(f"checkpoint {tag_dir!r} has no {name!r}")
            ranks.add(reader.extras[name].rank)
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
    agree(engine, error, f"verifying checkpoint {tag_dir!r}")
    try:
        with reader:
            load_tensors(engine, reader, parts)
    except Exception as exc:
        raise CheckpointError(f"loading {tag_dir!r} failed part way, after verification: the engine's state is "
                              f"partly loaded; load again or rebuild the engine ({exc})") from exc
    apply_state(engine, state, load_optimizer_states, load_lr_scheduler_states, same_world, saved_world)
    return tag_dir, state["client_state"]


def load_tensors(engine: ZeroEngine, reader: RecordReader, parts: tuple[str, ...]) -> None:
    for index in range(len(engine.units)):
        with param_tensor(engine, index, write=True) as tensor:
            fill(reader, index, "param", param_range(engine, index)[0], tensor)
    for sg in engine.driver.sub_groups:
        index, start, _ = sub_group_range(engine, sg)
        for part in STATE_PARTS:
            with engine.driver.held(sg, part, dirty=True) as tensor:
                if part in parts:
                    fill(reader, index, part, start, tensor)
                else:
                    tensor.zero_()
    for name, tensor, _ in extras(engine):
        with torch.no_grad():
            tensor.copy_(reader.read_extra(name))
    engine.driver.zero_grad()
    if engine.partitioner is not None:
        engine.partitioner.refresh()  # units that stay gathered (persistent ones) read the loaded shards
    elif engine.stage >= 1 and engine.dp.world_size > 1:
        for unit, flat in zip(engine.units, engine.flats):
            engine.dp.all_gather(flat.narrow(0, unit.shard_start, unit.shard_numel).clone(), flat)


def apply_state(engine: ZeroEngine, state: dict, load_optimizer_states: bool, load_lr_scheduler_states: bool,
                same_world: bool, saved_world: int) -> None:
    counters = state["engine"]
    engine.global_steps = counters["global_steps"]
    engine.micro_steps = counters["micro_steps"]
    engine.skipped_steps = counters["skipped_steps"]
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
    if same_world:
        set_rng_state(state["rng"])
    else:
        warnings.warn(f"checkpoint saved with {saved_world} ranks, loaded into {engine.dp.world_size}: the "
                      "model and optimizer state are resharded, RNG states are not restored", stacklevel=3)
