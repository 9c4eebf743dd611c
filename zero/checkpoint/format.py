"""The on-disk format of a zero-tiering checkpoint: file names, typed errors, atomic writes, the manifest and
its verification. save.py and load.py (the engine's save and load) and zero/export/ (the consolidated fp32
export, which runs without an engine) both build on this file.

A checkpoint, for `engine.save_checkpoint(save_dir, tag)` with N ranks:

    save_dir/
      latest                            the tag of the newest complete checkpoint; replaced after its manifest
      <tag>/
        rank00000-of-0000N.<id>.data    this rank's tensors, raw bytes, one record after another (see below)
        rank00000-of-0000N.<id>.state.pt this rank's small state (torch.save): engine counters, optimizer step
                                        and hyperparameters, loss scaler, LR scheduler, RNG states, client_state
        ...                             the same two files for every rank
        model_config.json               the model's `config.to_dict()` (transformers models), when it has one
        manifest.json                   written last: format, library version, world size, stage, dtype, the
                                        unit layout, every record, and each file's size and xxh3-64 checksum

Records. A unit's flat buffer (its parameters, flattened and padded; see FlatUnit) has four "parts": `param`
(the compute dtype), `master`, `exp_avg`, `exp_avg_sq` (fp32: the values, whatever state format stored them, so a
checkpoint loads into a run of any format; the manifest names the format it was saved from). A record is a run [start, start + numel) of
one part of one unit, in the unit's flat coordinates, as one rank held it: its param shard, or one
sub-group's optimizer state. Together the records of all ranks cover every element of every unit below its
`numel` (padding may be missing: it is zero). `extra` records hold what is not in a unit: frozen parameters and
persistent buffers, by name. Because records are in flat coordinates, a reader can assemble any range of any
unit from any number of ranks: that is how the export consolidates, and how a checkpoint saved with N ranks
loads into M.

Atomicity. Every file is written under a temporary name (`.<name>.tmp-<host>-<pid>-<random>`) in its final
directory, fsynced, renamed, and the directory fsynced. The manifest is written only after every rank's files
are in place, and `latest` only after the manifest: a tag directory without `manifest.json` is incomplete
and never loads; `latest` never names one. Each save's rank files carry an id of their own
(`rank00000-of-0000N.<id>.data`), so saving again under a tag writes beside the files its manifest names: until
the new manifest replaces the old in one rename, the old checkpoint is whole; then the files no manifest names
(and, under every tag, temporary files whose writers are gone: an interrupted save's) are removed (cleanup.py).
A writer holds its temporary file's lock until it renames it, so a file whose lock can be taken is a dead one's.
"""
from __future__ import annotations

import errno as errno_codes
import fcntl
import importlib.metadata
import json
import os
import re
import secrets
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import torch
import xxhash

from tiering.stale import this_host

from ..optim.driver import STATE_PARTS

FORMAT = "zero-tiering-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
MODEL_CONFIG = "model_config.json"
PARTS = ("param", *STATE_PARTS)
CHUNK = 16 << 20
"""Bytes moved per read/write call and per host staging copy of a device tensor."""


def data_file(rank: int, world_size: int, save: str = "") -> str:
    return f"rank{rank:05d}-of-{world_size:05d}{save}.data"


def state_file(rank: int, world_size: int, save: str = "") -> str:
    return f"rank{rank:05d}-of-{world_size:05d}{save}.state.pt"


def save_id() -> str:
    """What tells one save's rank files from another's under the same tag (`.` and 8 hex digits)."""
    return f".{secrets.token_hex(4)}"  # secrets: never the `random` module's state


RANK_FILE = re.compile(r"rank\d{5}-of-\d{5}(\.[0-9a-f]{8})?\.(data|state\.pt)")
TEMP_FILE = re.compile(r"\..+\.tmp-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}")


def check_tag_name(tag: str) -> None:
    """A tag is one plain directory name: no separator, not hidden, no surrounding blanks or control characters
    (`latest` is read stripped)."""
    if (not tag or tag in (".", "..", LATEST) or "/" in tag or "\\" in tag or tag.startswith(".")
            or tag != tag.strip() or not tag.isprintable()):
        raise CheckpointError(f"checkpoint tag {tag!r} is not a plain directory name")


def library_version() -> str:
    try:
        return importlib.metadata.version("zero-tiering")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointCorruptError("", f"unknown dtype {name!r} in the manifest")
    return dtype


# -- errors --------------------------------------------------------------------------------------------------


class CheckpointError(Exception):
    """Base class of every checkpoint error."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint directory or tag does not exist."""

    def __init__(self, path: str, what: str):
        self.path = path
        FileNotFoundError.__init__(self, errno_codes.ENOENT, f"{what}: {path!r}")

    def __str__(self) -> str:
        return self.strerror


class CheckpointIncompleteError(CheckpointError, ValueError):
    """The tag directory has no manifest: a save was interrupted (or is still running)."""

    def __init__(self, path: str, present: list[str]):
        self.path = path
        listing = ", ".join(present[:8]) + (", ..." if len(present) > 8 else "") if present else "nothing"
        super().__init__(f"checkpoint {path!r} is incomplete: it has no {MANIFEST} (a save was interrupted or is "
                         f"still running); it holds {listing}")


class CheckpointCorruptError(CheckpointError, ValueError):
    """A file of the checkpoint does not match its manifest (size or checksum), or the manifest is unreadable.
    `path` names the file."""

    def __init__(self, path: str, problem: str):
        self.path = path
        super().__init__(f"checkpoint file {path!r} {problem}" if path else problem)


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit the engine loading it (another model, unit layout, dtype, world size)."""


class CheckpointBoundaryError(CheckpointError, RuntimeError):
    """save_checkpoint was called inside a gradient accumulation window."""


class CheckpointIOError(CheckpointError, OSError):
    """Writing or reading a checkpoint's file (or an export's) failed (a full disk, a file size limit, an I/O
    error). Names the file and the bytes; the checkpoint is not marked complete and the engine's state is untouched."""

    def __init__(self, path: str, op: str, offset: int, nbytes: int, err: OSError, temp_path: str = ""):
        self.path, self.op, self.offset, self.nbytes, self.temp_path = path, op, offset, nbytes, temp_path
        via = f" (temporary file {temp_path!r})" if temp_path else ""
        OSError.__init__(self, err.errno, f"{op} of {nbytes} bytes at offset {offset} of {path!r}"
                                          f"{via} failed: {err.strerror or err}")
        self.filename = path

    def __str__(self) -> str:
        return self.strerror


# -- atomic files --------------------------------------------------------------------------------------------


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(name: str) -> str:
    return f".{name}.tmp-{this_host()}-{os.getpid()}-{secrets.token_hex(4)}"  # secrets: never the `random` module's state


def as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous host tensor, without a copy (any dtype, bf16 included)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


def host_chunks(tensor: torch.Tensor, chunk: int = CHUNK) -> Iterable[np.ndarray]:
    """The bytes of `tensor` in order, as host arrays: a view for a host tensor, staged copies of at most
    `chunk` bytes for a device tensor (so saving an optimizer state kept on the GPU never stages it whole)."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type == "cpu":
        if not flat.is_contiguous():
            flat = flat.contiguous()
        yield as_bytes(flat)
        return
    per = max(1, chunk // flat.element_size())
    for start in range(0, flat.numel(), per):
        yield as_bytes(flat[start:start + per].cpu())


class AtomicFile:
    """A file created under a temporary name in `directory` and renamed to `name` by `commit()` (after fsync),
    or removed by `abort()`. Writes are unbuffered and checked: a failure raises CheckpointIOError naming the
    file, the offset and the bytes. Keeps the size and the xxh3-64 of what was written."""

    def __init__(self, directory: str, name: str):
        self.directory, self.name = directory, name
        self.path = os.path.join(directory, name)
        self.temp_path = os.path.join(directory, temp_name(name))
        try:
            self._file = open(self.temp_path, "xb", buffering=0)
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)  # while it writes: its file is not a dead writer's
        except OSError as exc:
            raise CheckpointIOError(self.path, "create", 0, 0, exc, self.temp_path) from exc
        self.size = 0
        self._hash = xxhash.xxh3_64()
        self._done = False

    def write(self, data: np.ndarray | bytes | memoryview) -> int:
        """Write all of `data`; returns the offset it starts at."""
        view = memoryview(data).cast("B")
        start = self.size
        done = 0
        while done < len(view):
            try:
                n = self._file.write(view[done:done + CHUNK])
            except OSError as exc:
                raise CheckpointIOError(self.path, "write", self.size, len(view) - done, exc, self.temp_path) from exc
            if not n:
                raise CheckpointIOError(self.path, "write", self.size, len(view) - done,
                                        OSError(errno_codes.EIO, "no bytes written"), self.temp_path)
            self._hash.update(view[done:done + n])
            done += n
            self.size += n
        return start

    def write_tensor(self, tensor: torch.Tensor) -> tuple[int, int, str]:
        """Write a tensor's bytes; returns (offset, nbytes, xxh3-64 hex of those bytes)."""
        start = self.size
        record_hash = xxhash.xxh3_64()
        for chunk in host_chunks(tensor):
            self.write(chunk)
            record_hash.update(chunk)
        return start, self.size - start, record_hash.hexdigest()

    @property
    def checksum(self) -> str:
        return self._hash.hexdigest()

    def commit(self) -> dict:
        """fsync, rename to the final name, fsync the directory. Returns the manifest entry {size, xxh3_64}."""
        try:
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self.temp_path, self.path)
            fsync_dir(self.directory)
        except OSError as exc:
            self.abort()
            raise CheckpointIOError(self.path, "commit", self.size, self.size, exc, self.temp_path) from exc
        self._done = True
        return {"size": self.size, "xxh3_64": self.checksum}

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._file.close()
        except OSError:
            pass
        try:
            os.unlink(self.temp_path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is not None:
            self.abort()


def write_atomic(directory: str, name: str, data: bytes) -> dict:
    with AtomicFile(directory, name) as f:
        f.write(data)
        return f.commit()


# -- the manifest -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """One run of bytes in a rank's data file (see the module docstring)."""

    rank: int
    kind: str  # "unit" or "extra"
    offset: int
    nbytes: int
    dtype: str
    xxh3_64: str
    unit: int = -1
    part: str = ""
    start: int = 0
    numel: int = 0
    name: str = ""
    shape: tuple[int, ...] = ()
    is_param: bool = False

    def to_json(self) -> dict:
        out = {"kind": self.kind, "offset": self.offset, "nbytes": self.nbytes, "dtype": self.dtype,
               "xxh3_64": self.xxh3_64}
        if self.kind == "unit":
            out.update(unit=self.unit, part=self.part, start=self.start, numel=self.numel)
        else:
            out.update(name=self.name, shape=list(self.shape), is_param=self.is_param)
        return out

    @classmethod
    def from_json(cls, rank: int, data: dict) -> Record:
        fields = dict(data)
        if "shape" in fields:
            fields["shape"] = tuple(fields["shape"])
        return cls(rank=rank, **fields)

    def describe(self) -> str:
        if self.kind == "unit":
            return f"unit {self.unit} {self.part} [{self.start}, {self.start + self.numel})"
        return f"{'parameter' if self.is_param else 'buffer'} {self.name!r}"


def read_latest(save_dir: str) -> str | None:
    path = os.path.join(save_dir, LATEST)
    try:
        with open(path, encoding="utf-8") as f:
            tag = f.read().strip()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise CheckpointCorruptError(path, "is a directory (it should be a file holding a tag)") from None
    except UnicodeDecodeError:
        raise CheckpointCorruptError(path, "is not text (it should hold a tag)") from None
    if not tag:
        raise CheckpointCorruptError(path, "is empty (it should hold a tag)")
    return tag


def resolve(path: str, tag: str | None) -> str:
    """The tag directory for (save_dir, tag): `tag`, else the one `latest` names, else `path` itself when it
    is a tag directory (holds a manifest). Raises CheckpointNotFoundError."""
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(path, "no checkpoint directory")
    if tag is None:
        tag = read_latest(path)
        if tag is None:
            if os.path.exists(os.path.join(path, MANIFEST)):
                return path
            raise CheckpointNotFoundError(os.path.join(path, LATEST), "no tag given and no `latest` file")
    check_tag_name(str(tag))
    tag_dir = os.path.join(path, str(tag))
    if not os.path.isdir(tag_dir):
        raise CheckpointNotFoundError(tag_dir, f"no checkpoint with tag {tag!r}")
    return tag_dir


def read_manifest(tag_dir: str) -> dict:
    """The manifest of a complete checkpoint. CheckpointIncompleteError without one; CheckpointCorruptError
    if it cannot be parsed or is not ours."""
    path = os.path.join(tag_dir, MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        present = sorted(os.listdir(tag_dir)) if os.path.isdir(tag_dir) else []
        raise CheckpointIncompleteError(tag_dir, present) from None
    try:
        manifest = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointCorruptError(path, f"is not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointCorruptError(path, f"is not a {FORMAT} manifest")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointMismatchError(f"{path!r} has format version {manifest['format_version']}; this "
                                      f"zero-tiering ({library_version()}) reads up to {FORMAT_VERSION}")
    expected = manifest.get("manifest_xxh3_64")
    body = dict(manifest)
    body.pop("manifest_xxh3_64", None)
    if expected != xxhash.xxh3_64_hexdigest(canonical_json(body)):
        raise CheckpointCorruptError(path, "fails its own checksum (the manifest was changed or damaged)")
    return manifest


def canonical_json(data: dict) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def manifest_bytes(manifest: dict) -> bytes:
    """The manifest as written: readable JSON carrying an xxh3-64 of its own canonical form."""
    sealed = dict(manifest, manifest_xxh3_64=xxhash.xxh3_64_hexdigest(canonical_json(manifest)))
    return json.dumps(sealed, indent=1, sort_keys=True).encode()


def records_of(manifest: dict) -> list[Record]:
    return [Record.from_json(entry["rank"], record) for entry in manifest["ranks"] for record in entry["records"]]


def file_hash(path: str, size: int) -> str:
    hasher = xxhash.xxh3_64()
    buffer = bytearray(min(CHUNK, max(size, 1)))
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            hasher.update(view[:n])
    return hasher.hexdigest()


def verify_files(tag_dir: str, manifest: dict, names: Iterable[str]) -> None:
    """Check each named file's size and xxh3-64 against the manifest. Raises CheckpointCorruptError naming
    the first file that fails (and, for a data file, the records whose bytes changed)."""
    files = manifest["files"]
    for name in names:
        entry = files.get(name)
        path = os.path.join(tag_dir, name)
        if entry is None:
            raise CheckpointCorruptError(path, "is not listed in the manifest")
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise CheckpointCorruptError(path, "is missing") from None
        if size != entry["size"]:
            raise CheckpointCorruptError(path, f"has {size} bytes, the manifest says {entry['size']}")
        actual = file_hash(path, size)
        if actual != entry["xxh3_64"]:
            where = _damaged_records(tag_dir, manifest, name)
            raise CheckpointCorruptError(path, f"fails its checksum: xxh3-64 {actual}, the manifest says "
                                               f"{entry['xxh3_64']}{where}")


def _damaged_records(tag_dir: str, manifest: dict, name: str) -> str:
    """Which records of data file `name` changed, for the error message."""
    damaged = []
    for entry in manifest["ranks"]:
        if entry["data"] != name:
            continue
        with open(os.path.join(tag_dir, name), "rb", buffering=0) as f:
            for raw in entry["records"]:
                record = Record.from_json(entry["rank"], raw)
                data = os.pread(f.fileno(), record.nbytes, record.offset)
                if xxhash.xxh3_64_hexdigest(data) != record.xxh3_64:
                    damaged.append(record.describe())
    return f" (damaged: {', '.join(damaged[:4])}{', ...' if len(damaged) > 4 else ''})" if damaged else ""


# -- reading records ------------------------------------------------------------------------------------------


def pread_into(fd: int, out: np.ndarray, offset: int, path: str) -> None:
    view = memoryview(out).cast("B")
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:done + CHUNK]], offset + done)
        except OSError as exc:
            raise CheckpointIOError(path, "read", offset + done, len(view) - done, exc) from exc
        if n == 0:
            raise CheckpointCorruptError(path, f"ends before offset {offset + len(view)}")
        done += n


class RecordReader:
    """Reads any range of any unit's part, and extra tensors by name, from the records of every rank.

    `prefer_rank`: where ranks saved the same range (stage 0 saves every unit whole on every rank), read that
    rank's copy if it has one (a rank's own file), else the lowest rank's."""

    def __init__(self, tag_dir: str, manifest: dict, prefer_rank: int = 0):
        self.tag_dir, self.manifest = tag_dir, manifest
        self.units = manifest["units"]
        self._files = {entry["rank"]: entry["data"] for entry in manifest["ranks"]}
        self._fds: dict[int, int] = {}
        by_range: dict[tuple[int, str, int, int], Record] = {}
        self.extras: dict[str, Record] = {}
        for record in sorted(records_of(manifest), key=lambda r: (r.rank != prefer_rank, r.rank)):
            if record.kind == "unit":
                by_range.setdefault((record.unit, record.part, record.start, record.numel), record)
            else:
                self.extras.setdefault(record.name, record)
        self._runs: dict[tuple[int, str], list[Record]] = {}
        for (unit, part, _, _), record in by_range.items():
            self._runs.setdefault((unit, part), []).append(record)
        for key, runs in self._runs.items():
            runs.sort(key=lambda r: r.start)
            for a, b in zip(runs, runs[1:]):
                if b.start < a.start + a.numel:
                    raise CheckpointCorruptError(os.path.join(tag_dir, MANIFEST),
                                                 f"has overlapping records: {a.describe()} and {b.describe()}")

    def parts(self, unit: int) -> set[str]:
        return {part for (u, part) in self._runs if u == unit}

    def pieces(self, unit: int, part: str, start: int, numel: int) -> list[tuple[Record, int, int]]:
        """(record, first element within the record, element count) covering [start, start + numel), in
        order; elements no record covers must be padding (at or past the unit's numel), else it raises."""
        out = []
        position, end = start, start + numel
        for record in self._runs.get((unit, part), ()):
            lo, hi = max(position, record.start), min(end, record.start + record.numel)
            if lo >= hi:
                continue
            if lo > position:
                self._check_padding(unit, part, position, lo)
            out.append((record, lo - record.start, hi - lo))
            position = hi
        if position < end:
            self._check_padding(unit, part, position, end)
        return out

    def _check_padding(self, unit: int, part: str, lo: int, hi: int) -> None:
        if lo < self.units[unit]["numel"]:
            raise CheckpointCorruptError(os.path.join(self.tag_dir, MANIFEST),
                                         f"has no record for elements [{lo}, {min(hi, self.units[unit]['numel'])}) "
                                         f"of unit {unit} ({self.units[unit]['name']!r}) part {part!r}")

    def ranks_for(self, unit: int, part: str, start: int, numel: int) -> set[int]:
        return {record.rank for record, _, _ in self.pieces(unit, part, start, numel)}

    def read(self, unit: int, part: str, start: int, out: torch.Tensor) -> torch.Tensor:
        """Fill host tensor `out` (the part's dtype) with elements [start, start + out.numel()); zeros where
        no record reaches (padding)."""
        flat = out.view(-1)
        pieces = self.pieces(unit, part, start, flat.numel())
        if sum(count for _, _, count in pieces) < flat.numel():
            flat.zero_()
        for record, first, count in pieces:
            if dtype_of(record.dtype) != out.dtype:
                raise CheckpointMismatchError(f"{record.describe()} is {record.dtype}; reading it as "
                                              f"{dtype_name(out.dtype)}")
            size = out.element_size()
            target = flat.narrow(0, record.start + first - start, count)
            pread_into(self._fd(record.rank), as_bytes(target), record.offset + first * size, self.path(record.rank))
        return out

    def read_extra(self, name: str) -> torch.Tensor:
        record = self.extras[name]
        out = torch.empty(record.shape, dtype=dtype_of(record.dtype))
        pread_into(self._fd(record.rank), as_bytes(out), record.offset, self.path(record.rank))
        return out

    def path(self, rank: int) -> str:
        return os.path.join(self.tag_dir, self._files[rank])

    def _fd(self, rank: int) -> int:
        if rank not in self._fds:
            self._fds[rank] = os.open(self.path(rank), os.O_RDONLY)
        return self._fds[rank]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> RecordReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
