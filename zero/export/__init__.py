"""Export a checkpoint as one consolidated fp32 state_dict that plain PyTorch and transformers load, without
building an engine (DeepSpeed's zero_to_fp32.py, for zero-tiering checkpoints):

    python -m zero.export CKPT_DIR OUT_DIR [--tag TAG]

CKPT_DIR is a save_dir (the tag `latest` names, or --tag) or a tag directory. OUT_DIR receives
`model.safetensors`: every parameter under its name, in fp32 from the fp32 master weights (consolidated
across all the ranks that saved), frozen parameters and persistent buffers as saved (floating ones in fp32).
A tensor the model reaches under several names (tied embeddings) is written once, under its first name, as
safetensors and transformers expect; the other names are listed in the header's metadata
(`zero_tiering_aliases`, JSON {alias: name}) and restored by `load_state_dict` below. When the model came
from transformers, OUT_DIR also receives `config.json`, so `AutoModel...from_pretrained(OUT_DIR)` works.

Loading the result in plain PyTorch:
    safetensors.torch.load_model(model, "OUT_DIR/model.safetensors")     # re-ties shared names itself
    model.load_state_dict(zero.export.load_state_dict("OUT_DIR/model.safetensors"))   # every name

Streamed: the safetensors header is computed from the manifest's unit layout first, then one unit at a time
is assembled from the records of every rank, written, and dropped. Peak memory is the largest unit in fp32.
Every file read is verified against the manifest first (sizes and xxh3-64).

A checkpoint saved with `exclude_frozen_parameters=True` (ZeroTrainer's checkpoint-N of a PEFT model) lacks the
frozen base, so no whole model can be exported from it: the export refuses it (ExcludedParametersError) and writes
nothing, rather than a file missing the base that loaders fill with random initial values.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from ..checkpoint.st_format import ALIASES_KEY, SAFETENSORS, header_bytes
from ..cli import add_common_flags
from ..checkpoint.format import (
    AtomicFile,
    CheckpointCorruptError,
    CheckpointError,
    MANIFEST,
    RecordReader,
    dtype_of,
    read_manifest,
    resolve,
    verify_files,
    write_atomic,
)

SHOWN = 3
"""Names an error lists of the parameters it is about (then a count of the rest)."""


class ExcludedParametersError(CheckpointError, ValueError):
    """The checkpoint was saved without its frozen parameters (`exclude_frozen_parameters=True`): exporting it would
    give a model without its base. `excluded` names them."""

    def __init__(self, path: str, excluded: list[str]):
        self.path, self.excluded = path, list(excluded)
        super().__init__(
            f"checkpoint {path!r} was saved with exclude_frozen_parameters=True: {len(excluded)} frozen parameter(s) "
            f"are not in it ({_listed(excluded)}), so it holds no whole model to export. Export a checkpoint saved "
            "without exclude_frozen_parameters, or save the adapters alone with PEFT (model.save_pretrained, or "
            "ZeroTrainer.save_model) and load them onto the base model")


def _listed(names: list[str]) -> str:
    more = len(names) - SHOWN
    return ", ".join(names[:SHOWN]) + (f" and {more} more" if more > 0 else "")


def export_plan(manifest: dict, reader: RecordReader) -> list[tuple[str, torch.dtype, list[int], tuple]]:
    """(name, dtype, shape, source) of every tensor written, in file order: unit slots (source ("unit", unit
    index, offset, numel)), then extras (source ("extra", name))."""
    plan = []
    for index, unit in enumerate(manifest["units"]):
        for slot in unit["slots"]:
            plan.append((slot["name"], torch.float32, slot["shape"], ("unit", index, slot["offset"], slot["numel"])))
    for name, record in reader.extras.items():
        dtype = dtype_of(record.dtype)
        out = torch.float32 if dtype.is_floating_point else dtype
        plan.append((name, out, list(record.shape), ("extra", name)))
    return plan


def export_fp32(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, tag: str | None = None,
                verify: bool = True) -> str:
    """Write OUT_DIR/model.safetensors (and config.json for a transformers model); returns the safetensors
    path. See the module docstring."""
    out_dir = os.fspath(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):  # refused before any checkpoint byte is read
        raise NotADirectoryError(f"OUT_DIR {out_dir!r} is a file: give a directory, where model.safetensors (and "
                                 "config.json) will be written; the file is left as it is")
    tag_dir = resolve(os.fspath(ckpt_dir), tag)
    manifest = read_manifest(tag_dir)
    if manifest.get("excluded"):
        raise ExcludedParametersError(tag_dir, manifest["excluded"])
    with RecordReader(tag_dir, manifest) as reader:
        if verify:
            ranks = {r for index, unit in enumerate(manifest["units"])
                     for r in reader.ranks_for(index, "master", 0, unit["numel"])}
            ranks |= {record.rank for record in reader.extras.values()}
            data = {entry["rank"]: entry["data"] for entry in manifest["ranks"]}
            names = [data[r] for r in sorted(ranks)]
            if manifest.get("model_config"):
                names.append(manifest["model_config"])
            verify_files(tag_dir, manifest, names)
        plan = export_plan(manifest, reader)
        aliases = manifest.get("aliases", {})
        written = {name for name, *_ in plan}
        dangling = sorted(f"{alias} -> {name}" for alias, name in aliases.items() if name not in written)
        if dangling:  # the header would name tensors the file does not hold
            raise CheckpointCorruptError(os.path.join(tag_dir, MANIFEST), f"ties {len(dangling)} name(s) to tensors "
                                         f"the checkpoint does not hold ({_listed(dangling)})")
        metadata = {"format": "pt", ALIASES_KEY: json.dumps(aliases, sort_keys=True),
                    "zero_tiering_checkpoint": os.path.abspath(tag_dir)}
        os.makedirs(out_dir, exist_ok=True)
        with AtomicFile(out_dir, SAFETENSORS) as f:
            f.write(header_bytes(plan, metadata))
            current, buffer = -1, None
            for name, dtype, shape, source in plan:
                if source[0] == "unit":
                    _, index, offset, numel = source
                    if index != current:  # one unit's fp32 masters at a time
                        buffer = reader.read(index, "master", 0, torch.empty(manifest["units"][index]["numel"]))
                        current = index
                    f.write_tensor(buffer.narrow(0, offset, numel))
                else:
                    buffer, current = None, -1
                    f.write_tensor(reader.read_extra(source[1]).to(dtype))
            f.commit()
    if manifest.get("model_config"):
        with open(os.path.join(tag_dir, manifest["model_config"])) as cf:
            config = json.load(cf)
        if not config.get("architectures"):
            config["architectures"] = [manifest["model_class"].rsplit(".", 1)[-1]]
        config["dtype"] = "float32"
        if "torch_dtype" in config:
            config["torch_dtype"] = "float32"
        write_atomic(out_dir, "config.json", json.dumps(config, indent=2, sort_keys=True).encode())
    return os.path.join(out_dir, SAFETENSORS)


def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """An exported model.safetensors as a state_dict with every name, tied ones included (sharing storage)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    state = load_file(os.fspath(path))
    with safe_open(os.fspath(path), framework="pt") as f:
        aliases = json.loads((f.metadata() or {}).get(ALIASES_KEY, "{}"))
    for alias, name in aliases.items():
        state[alias] = state[name]
    return state


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m zero.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt_dir", help="a save_dir (uses `latest` unless --tag) or a tag directory")
    parser.add_argument("out_dir", help="where model.safetensors (and config.json) are written")
    parser.add_argument("--tag", help="the checkpoint's tag (default: the one `latest` names)")
    parser.add_argument("--skip-verify", action="store_true",
                        help="do not check the files' checksums against the manifest first")
    add_common_flags(parser)
    args = parser.parse_args(argv)
    path = export_fp32(args.ckpt_dir, args.out_dir, tag=args.tag, verify=not args.skip_verify)
    extra = " and config.json" if os.path.exists(os.path.join(args.out_dir, "config.json")) else ""
    print(f"wrote {path} ({os.path.getsize(path)} bytes){extra}")
    return path
