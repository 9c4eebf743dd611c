"""The checkpoint format without an engine: atomic files, the sealed manifest, verification, and the record
reader that reassembles any range of a unit from any number of ranks (what resharding and the export use).

- Round trip (hypothesis): a unit of any size, saved as N ranks would save it (each rank's shard of the padded
  flat buffer, cut into sub-groups), reads back as M ranks would want it (any ranges, any cut): the same
  elements, zeros in the padding, whatever N, M and the sub-group sizes.
- An AtomicFile that fails or is abandoned leaves nothing under either name; one that commits holds exactly
  what was written, with the size and xxh3-64 the manifest records.
- The manifest carries its own checksum: an edited manifest is refused, naming it; a file that is missing, of
  the wrong size or with a changed byte is refused, naming it.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from zero.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    AtomicFile,
    CheckpointCorruptError,
    CheckpointIOError,
    Record,
    RecordReader,
    data_file,
    manifest_bytes,
    read_latest,
    read_manifest,
    verify_files,
    write_atomic,
)

PAD = 1024  # FlatUnit.PAD_ELEMENTS


def padded(numel: int, world: int) -> int:
    quantum = world * PAD
    return max(quantum, -(-numel // quantum) * quantum)


def write_checkpoint(tag_dir: str, values: torch.Tensor, world: int, chunk: int) -> dict:
    """Save one unit's `master` (values, unpadded) as `world` ranks would, sub-groups of `chunk` elements."""
    total = padded(values.numel(), world)
    flat = torch.zeros(total)
    flat[: values.numel()] = values
    shard = total // world
    ranks, files = [], {}
    for rank in range(world):
        records = []
        with AtomicFile(tag_dir, data_file(rank, world)) as f:
            for offset in range(0, shard, chunk):
                start = rank * shard + offset
                piece = flat[start:start + min(chunk, shard - offset)]
                where, nbytes, digest = f.write_tensor(piece)
                records.append(Record(rank, "unit", where, nbytes, "float32", digest, unit=0, part="master",
                                      start=start, numel=piece.numel()).to_json())
            files[f.name] = f.commit()
        ranks.append({"rank": rank, "data": data_file(rank, world), "state": "", "records": records})
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "world_size": world,
                "units": [{"name": "u", "numel": values.numel(), "padded_numel": total, "group": 0, "slots": []}],
                "ranks": ranks, "files": files}
    write_atomic(tag_dir, "manifest.json", manifest_bytes(manifest))
    return manifest


@settings(max_examples=25, deadline=None)
@given(numel=st.integers(1, 5000), saved_world=st.integers(1, 4), loaded_world=st.integers(1, 4),
       saved_chunk=st.integers(1, 3000), loaded_chunk=st.integers(1, 3000), seed=st.integers(0, 2**16))
def test_any_range_reads_back_across_ranks_and_sub_groups(tmp_path_factory, numel, saved_world, loaded_world,
                                                         saved_chunk, loaded_chunk, seed):
    tag_dir = str(tmp_path_factory.mktemp("fmt"))
    values = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    write_checkpoint(tag_dir, values, saved_world, saved_chunk)
    manifest = read_manifest(tag_dir)
    total = padded(numel, loaded_world)
    truth = torch.zeros(max(total, padded(numel, saved_world)))
    truth[:numel] = values
    shard = total // loaded_world
    with RecordReader(tag_dir, manifest) as reader:
        verify_files(tag_dir, manifest, manifest["files"])
        for rank in range(loaded_world):  # every sub-group of every rank of the new layout
            for offset in range(0, shard, loaded_chunk):
                start = rank * shard + offset
                out = torch.full((min(loaded_chunk, shard - offset),), float("nan"))
                reader.read(0, "master", start, out)
                assert torch.equal(out, truth[start:start + out.numel()]), (rank, offset)
        whole = reader.read(0, "master", 0, torch.empty(numel))  # what the export reads
        assert torch.equal(whole, values)


def test_atomic_file_commits_or_leaves_nothing(tmp_path):
    with AtomicFile(str(tmp_path), "a.bin") as f:
        f.write(b"hello ")
        f.write_tensor(torch.arange(4, dtype=torch.bfloat16))
        assert os.listdir(tmp_path) == [os.path.basename(f.temp_path)]  # only the temporary name, until commit
        entry = f.commit()
    data = (tmp_path / "a.bin").read_bytes()
    assert data[:6] == b"hello " and len(data) == 14
    assert entry == {"size": 14, "xxh3_64": xxhash.xxh3_64_hexdigest(data)}
    assert os.listdir(tmp_path) == ["a.bin"]

    with pytest.raises(RuntimeError, match="boom"):
        with AtomicFile(str(tmp_path), "b.bin") as f:
            f.write(b"partial")
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == ["a.bin"]  # the failed one left nothing


def test_atomic_file_write_errors_name_the_file_and_bytes(tmp_path, monkeypatch):
    f = AtomicFile(str(tmp_path), "c.bin")
    f.write(b"x" * 100)

    def full(data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(f._file, "write", full)
    with pytest.raises(CheckpointIOError) as info:
        f.write(b"y" * 50)
    err = info.value
    assert (err.errno, err.path, err.offset, err.nbytes) == (28, str(tmp_path / "c.bin"), 100, 50)
    assert "50 bytes at offset 100" in str(err) and str(tmp_path / "c.bin") in str(err)
    f.abort()
    assert os.listdir(tmp_path) == []


def test_verification_names_the_file(tmp_path):
    manifest = write_checkpoint(str(tmp_path), torch.randn(3000), 2, 1000)
    name = data_file(1, 2)
    path = tmp_path / name
    data = bytearray(path.read_bytes())
    data[4001] ^= 0xFF  # inside rank 1's second record
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError) as info:
        verify_files(str(tmp_path), manifest, manifest["files"])
    assert info.value.path == str(path) and "fails its checksum" in str(info.value)
    assert "unit 0 master [3048, 4048)" in str(info.value)  # the damaged record: rank 1, second sub-group
    path.write_bytes(bytes(data[:-4]))
    with pytest.raises(CheckpointCorruptError, match=f"{name}' has {len(data) - 4} bytes, the manifest says"):
        verify_files(str(tmp_path), manifest, [name])
    path.unlink()
    with pytest.raises(CheckpointCorruptError, match="is missing"):
        verify_files(str(tmp_path), manifest, [name])


def test_an_edited_manifest_is_refused(tmp_path):
    write_checkpoint(str(tmp_path), torch.randn(100), 1, 100)
    manifest_path = tmp_path / "manifest.json"
    sealed = json.loads(manifest_path.read_text())
    sealed["world_size"] = 2  # valid JSON, a plausible value, but not what was saved
    manifest_path.write_text(json.dumps(sealed))
    with pytest.raises(CheckpointCorruptError, match="fails its own checksum") as info:
        read_manifest(str(tmp_path))
    assert info.value.path == str(manifest_path)
    manifest_path.write_text("{not json")
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        read_manifest(str(tmp_path))


@pytest.mark.parametrize("latest", ["bytes", "directory"])
def test_a_latest_that_holds_no_text_is_a_corrupt_checkpoint_naming_it(tmp_path, latest):
    """Binary bytes in `latest`, or a directory by that name: the typed error naming the file (it was a
    UnicodeDecodeError traceback from zero.export, an IsADirectoryError naming nothing of ours)."""
    path = tmp_path / "latest"
    if latest == "bytes":
        path.write_bytes(b"\xff\xfe")
    else:
        path.mkdir()
    with pytest.raises(CheckpointCorruptError, match=r"latest.*(not text|is a directory)"):
        read_latest(str(tmp_path))
