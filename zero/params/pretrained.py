"""PretrainedWeights: the tensors of a safetensors checkpoint (Hugging Face's layout: one `model.safetensors`,
or shards named by `model.safetensors.index.json`; our own `python -m zero.export` output too), read by name
straight into the caller's tensor.

Each tensor is read with pread from its file into memory the caller owns (a unit's parameters while it is
materialized), so loading a model holds one unit at a time: nothing is memory-mapped (mapped pages would count
in the process's RSS) and nothing is read twice. The headers are read and checked up front: a missing shard, a
truncated file, a name or shape that does not match the model is an error naming the file and the tensor.
"""
from __future__ import annotations

import json
import os
import struct
from typing import NamedTuple

import torch

from ..checkpoint.st_format import ALIASES_KEY, SAFETENSORS, ST_DTYPES

INDEX = "model.safetensors.index.json"
DTYPES = {name: dtype for dtype, name in ST_DTYPES.items()}
CHUNK = 64 << 20
"""Bytes per pread call."""


class PretrainedWeightsError(ValueError):
    """A checkpoint that cannot fill the model: missing or truncated file, unknown dtype, or a tensor whose
    name or shape does not match the model. The message names the file and the tensor."""


class Entry(NamedTuple):
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Absolute offset of the tensor's bytes in `file`."""


class PretrainedWeights:
    def __init__(self, path: str | os.PathLike):
        """`path`: a directory holding model.safetensors or model.safetensors.index.json (and its shards), or
        one .safetensors file."""
        path = os.fspath(path)
        if os.path.isdir(path):
            index = os.path.join(path, INDEX)
            if os.path.exists(index):
                files = self._shards(index)
            elif os.path.exists(os.path.join(path, SAFETENSORS)):
                files = [os.path.join(path, SAFETENSORS)]
            else:
                raise PretrainedWeightsError(f"{path!r} holds neither {SAFETENSORS} nor {INDEX}")
        elif os.path.isfile(path):
            files = [path]
        else:
            raise PretrainedWeightsError(f"pretrained weights {path!r}: no such file or directory")
        self.path = path
        self.entries: dict[str, Entry] = {}
        self.aliases: dict[str, str] = {}
        for file in files:
            self._read_header(file)
        self.used: set[str] = set()

    @staticmethod
    def _shards(index: str) -> list[str]:
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise PretrainedWeightsError(f"index {index!r} is not a safetensors index: {exc!r}") from exc
        directory = os.path.dirname(index)
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.exists(os.path.join(directory, name)):
                held = sorted(n for n, f in weight_map.items() if f == name)
                raise PretrainedWeightsError(f"shard {os.path.join(directory, name)!r} is missing: it holds "
                                             f"{len(held)} tensors ({', '.join(held[:3])}...), per {index!r}")
        return [os.path.join(directory, name) for name in files]

    def _read_header(self, file: str) -> None:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise PretrainedWeightsError(f"{file!r} ({size} bytes) is truncated: no safetensors header")
            length = struct.unpack("<Q", raw)[0]
            if 8 + length > size:
                raise PretrainedWeightsError(f"{file!r} is truncated: its header says {length} bytes, the file "
                                             f"has {size - 8} after the length")
            try:
                header = json.loads(f.read(length))
            except ValueError as exc:
                raise PretrainedWeightsError(f"{file!r}: the safetensors header is not JSON ({exc})") from exc
        self.aliases.update(json.loads((header.pop("__metadata__", None) or {}).get(ALIASES_KEY, "{}")))
        for name, info in header.items():
            begin, end = info["data_offsets"]
            if info["dtype"] not in DTYPES:
                raise PretrainedWeightsError(f"{file!r}: tensor {name!r} has dtype {info['dtype']}, not one of "
                                             f"{sorted(DTYPES)}")
            if 8 + length + end > size:
                raise PretrainedWeightsError(f"{file!r} is truncated: tensor {name!r} ends at byte "
                                             f"{8 + length + end}, the file has {size}")
            self.entries[name] = Entry(file, DTYPES[info["dtype"]], tuple(info["shape"]), 8 + length + begin)

    def find(self, names: list[str]) -> str | None:
        """The first of `names` (a tensor's names in the model: tied ones have several) the checkpoint holds."""
        for name in names:
            name = self.aliases.get(name, name)
            if name in self.entries:
                return name
        return None

    def mark_used(self, names: list[str]) -> None:
        """A tied tensor's other names count as loaded too: a full state_dict (GPT-2's) writes it under each."""
        self.used.update(name for name in (self.aliases.get(n, n) for n in names) if name in self.entries)

    def read_into(self, name: str, out: torch.Tensor, what: str) -> None:
        """Fill `out` (a contiguous CPU tensor; `what` is its name in the model) with tensor `name`, cast to
        out's dtype."""
        entry = self.entries[name]
        if tuple(out.shape) != entry.shape:
            raise PretrainedWeightsError(f"{entry.file!r}: tensor {name!r} has shape {list(entry.shape)}, the "
                                         f"model's {what!r} {list(out.shape)}")
        target = out if entry.dtype == out.dtype else torch.empty(entry.shape, dtype=entry.dtype)
        view = memoryview(target.view(-1).view(torch.uint8).numpy())
        with open(entry.file, "rb", buffering=0) as f:
            done = 0
            while done < len(view):
                n = os.preadv(f.fileno(), [view[done:done + CHUNK]], entry.offset + done)
                if n <= 0:
                    raise PretrainedWeightsError(f"{entry.file!r}: tensor {name!r} ended after {done} bytes")
                done += n
        if target is not out:
            out.copy_(target)
        self.used.add(name)

    def check_all_used(self, known: set[str]) -> None:
        """Every tensor of the checkpoint was loaded or names a non-persistent part of the model (`known`):
        a tensor the model has no place for means another model."""
        extra = sorted(set(self.entries) - self.used - known)
        if extra:
            raise PretrainedWeightsError(f"{self.path!r} holds {len(extra)} tensors the model has no parameter or "
                                         f"buffer for: {', '.join(extra[:5])}{', ...' if len(extra) > 5 else ''}")
