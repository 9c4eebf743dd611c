"""The fp32 export: `python -m zero.export` writes model.safetensors that plain PyTorch (`load_state_dict`,
strict) and transformers (`from_pretrained`) load, with tied weights written once, equal to the fp32 masters; a
checkpoint without its frozen parameters is refused, with nothing written."""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import zero

from checkpoint_models import GAS, batch, ds_config, full_units, gpt2, train, unit_pieces
from conftest import REPO_ROOT, child_env


def masters_by_name(engine) -> dict[str, torch.Tensor]:
    """The fp32 master of every trained parameter, from the engine's sub-groups (one rank)."""
    full = full_units(unit_pieces(engine, "master"), engine.units)
    return {slot.name: full[i][slot.offset:slot.offset + slot.numel].view(slot.shape)
            for i, unit in enumerate(engine.units) for slot in unit.flat.slots}


def test_export_loads_in_plain_pytorch_and_transformers(tmp_path):
    import safetensors.torch
    from transformers import GPT2LMHeadModel

    from zero.export import load_state_dict, main as export_main

    engine = zero.initialize(model=gpt2(), config=ds_config(3, "bf16", "nvme", str(tmp_path)))[0]
    train(engine, 2)
    engine.save_checkpoint(tmp_path / "ckpt")
    masters = masters_by_name(engine)
    engine.close()
    with open(tmp_path / "ckpt" / "global_step2" / "model_config.json") as f:
        assert json.load(f)["model_type"] == "gpt2"  # saved with the checkpoint, for the export
    out = tmp_path / "export"
    export_main([str(tmp_path / "ckpt"), str(out)])  # the command's code, in this process (the other test runs it)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]

    written = safetensors.torch.load_file(out / "model.safetensors")
    assert "lm_head.weight" not in written, "a tied weight is written once"
    with safetensors.safe_open(out / "model.safetensors", framework="pt") as f:
        aliases = json.loads(f.metadata()["zero_tiering_aliases"])
    assert aliases == {"lm_head.weight": "transformer.wte.weight"} and set(aliases.values()) <= written.keys()
    assert written.keys() == masters.keys()
    for name, value in masters.items():
        assert written[name].dtype == torch.float32 and torch.equal(written[name], value), name

    model = gpt2(seed=7)
    assert str(model.load_state_dict(load_state_dict(out / "model.safetensors"))) == "<All keys matched successfully>"
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    assert torch.equal(model.transformer.wte.weight, masters["transformer.wte.weight"])
    plain = gpt2(seed=8)
    missing, unexpected = safetensors.torch.load_model(plain, out / "model.safetensors")
    assert (missing, unexpected) == (set(), []) or (not missing and not unexpected)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = GPT2LMHeadModel.from_pretrained(out)
    assert hf.dtype == torch.float32
    for name, p in hf.named_parameters():
        assert torch.equal(p, masters[name]), name
    assert torch.equal(hf.lm_head.weight, masters["transformer.wte.weight"])


def test_export_of_a_model_with_cross_unit_ties_and_frozen_parameters(tmp_path):
    from models import tied_blocks

    from zero.export import export_fp32, load_state_dict

    config = ds_config(2, "fp32", "cpu", str(tmp_path))  # stage 2: the partitioner is not yet at ease with
    config.pop("scheduler")                                # a parameter two units use (blocks.2.up is blocks.0.up)
    engine = zero.initialize(model=tied_blocks(), config=config)[0]
    for step in range(2 * GAS):
        ids = batch(step) % 96
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    masters = masters_by_name(engine)
    reference = engine.module_state_dict()
    engine.close()
    # The command, in a process of its own that builds no engine; a tag directory works as well as a save_dir.
    proc = subprocess.run([sys.executable, "-m", "zero.export", str(tmp_path / "ckpt" / "t"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, env=child_env(), cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = tmp_path / "out" / "model.safetensors"
    assert str(path) in proc.stdout
    assert os.listdir(tmp_path / "out") == ["model.safetensors"]  # not a transformers model: no config.json
    again = export_fp32(tmp_path / "ckpt", tmp_path / "out2", tag="t")
    assert Path(again).read_bytes() == path.read_bytes()
    state = load_state_dict(path)
    assert state.keys() == reference.keys()
    assert torch.equal(state["frozen"], torch.ones(32))
    assert state["blocks.2.up.weight"].data_ptr() == state["blocks.0.up.weight"].data_ptr()
    for name, value in masters.items():
        assert torch.equal(state[name], value), name
    model = tied_blocks(seed=3)
    model.load_state_dict(state)
    for name, value in reference.items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_checkpoint_saved_without_its_frozen_parameters_is_refused_and_nothing_written(tmp_path):
    """exclude_frozen_parameters=True leaves the base out (here GPT-2's tied embedding, frozen by hand): no whole
    model can come of it, so the export says which parameters are missing and what to do, rather than write a file
    whose loaders initialize the base at random."""
    from zero.checkpoint.format import MANIFEST, CheckpointCorruptError, manifest_bytes
    from zero.export import ExcludedParametersError, export_fp32

    model = gpt2()
    model.transformer.wte.weight.requires_grad_(False)
    engine = zero.initialize(model=model, config=ds_config(3, "fp32", "cpu", str(tmp_path)),
                             model_parameters=[p for p in model.parameters() if p.requires_grad])[0]
    train(engine, 1)
    engine.save_checkpoint(tmp_path / "ckpt", tag="adapters", exclude_frozen_parameters=True)
    engine.save_checkpoint(tmp_path / "ckpt", tag="whole")
    engine.close()

    with pytest.raises(ExcludedParametersError) as info:
        export_fp32(tmp_path / "ckpt", tmp_path / "out", tag="adapters")
    assert info.value.excluded == ["transformer.wte.weight"]
    assert "1 frozen parameter(s)" in str(info.value) and "transformer.wte.weight" in str(info.value)
    proc = subprocess.run([sys.executable, "-m", "zero.export", str(tmp_path / "ckpt"), str(tmp_path / "out"),
                           "--tag", "adapters"], capture_output=True, text=True, timeout=120, env=child_env(),
                          cwd=REPO_ROOT)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("zero.export: ExcludedParametersError: checkpoint ") and "wte" in proc.stderr
    assert not (tmp_path / "out").exists()

    # The whole checkpoint exports; one whose aliases name a tensor it does not hold is refused as corrupt.
    assert "transformer.wte.weight" in zero.export.load_state_dict(export_fp32(tmp_path / "ckpt", tmp_path / "out",
                                                                               tag="whole"))
    # An OUT_DIR that is a file (DeepSpeed's zero_to_fp32.py took an output file) is one line, the file untouched.
    (tmp_path / "model.bin").write_bytes(b"kept")
    proc = subprocess.run([sys.executable, "-m", "zero.export", str(tmp_path / "ckpt"), str(tmp_path / "model.bin")],
                          capture_output=True, text=True, timeout=120, env=child_env(), cwd=REPO_ROOT)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("zero.export: NotADirectoryError: OUT_DIR ") and "is a file" in proc.stderr
    assert (tmp_path / "model.bin").read_bytes() == b"kept"
    # Out of room (a file size limit): one line naming the export's file, its temporary file gone.
    proc = subprocess.run([sys.executable, "-m", "zero.export", str(tmp_path / "ckpt"), str(tmp_path / "small")],
                          capture_output=True, text=True, timeout=120, env=child_env(), cwd=REPO_ROOT,
                          preexec_fn=lambda: (signal.signal(signal.SIGXFSZ, signal.SIG_IGN),
                                              resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))))
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("zero.export: CheckpointIOError: write of ") and "model.safetensors" in proc.stderr
    assert "checkpoint file" not in proc.stderr and os.listdir(tmp_path / "small") == []
    tag_dir = tmp_path / "ckpt" / "whole"
    manifest = json.loads((tag_dir / MANIFEST).read_bytes())
    manifest.pop("manifest_xxh3_64")
    manifest["aliases"]["lm_head.weight"] = "transformer.absent.weight"
    (tag_dir / MANIFEST).write_bytes(manifest_bytes(manifest))
    with pytest.raises(CheckpointCorruptError, match=r"\(lm_head\.weight -> transformer\.absent\.weight\)"):
        export_fp32(tmp_path / "ckpt", tmp_path / "out2", tag="whole")
    assert not (tmp_path / "out2").exists()
