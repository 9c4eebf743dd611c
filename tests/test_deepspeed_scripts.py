"""A script written for DeepSpeed (tests/deepspeed_scripts/train_loop.py: add_config_arguments, init_distributed,
zero.Init, GatheredParameters(modifier_rank=0) to resize an embedding, a LoRA-style adapter sized from ds_shape,
initialize with training data, engine(batch) / backward / step, save_checkpoint, safe_get_full_fp32_param) runs
with `import zero as deepspeed`, on one rank and on two (gloo, started by `python -m zero.launch`), and ends where
the same steps in plain PyTorch end: losses and final weights within 1e-6 (fp32).

The plain run is the script's own model and data: the model built from the same seed, the embedding resized and
the adapters made the same way, AdamW with the config's hyperparameters, clip_grad_norm_ 1.0, accumulation 2;
each optimizer step sees the micro-batches every rank saw (the initialize loader's DistributedSampler order, as
DeepSpeed's, on one rank too), each rank's loss the mean over its micro-batch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "deepspeed_scripts"))
import train_loop  # noqa: E402

from stage3_models import free_port  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "deepspeed_scripts", "train_loop.py")
LR, WEIGHT_DECAY, MICRO, ACCUM, CLIP, EPOCHS = 1e-3, 0.01, 2, 2, 1.0, 2


def ds_config(nvme_path: str, device: str) -> dict:
    offload = {"device": device, **({"nvme_path": nvme_path} if device == "nvme" else {})}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
            "zero_optimization": {"stage": 3, "offload_param": dict(offload), "offload_optimizer": dict(offload)}}


def plain_run(world: int) -> tuple[list[float], dict[str, torch.Tensor], set[str]]:
    """The script's steps in plain PyTorch: rank 0's losses, the final weights and the trained parameters' names."""
    torch.manual_seed(0)
    model = train_loop.Net()
    train_loop.resize(model)
    train_loop.adapt(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    data = train_loop.dataset()
    losses = []
    for epoch in range(EPOCHS):
        orders = []
        for rank in range(world):  # DeepSpeed's loader: a DistributedSampler (seed 0), on one rank too
            sampler = torch.utils.data.distributed.DistributedSampler(data, world, rank)
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        for i, start in enumerate(range(0, len(orders[0]), MICRO)):
            per_rank = [model(data[order[start:start + MICRO]]) for order in orders]
            losses.append(per_rank[0].item())
            (torch.stack(per_rank).mean() / ACCUM).backward()
            if (i + 1) % ACCUM == 0:
                torch.nn.utils.clip_grad_norm_(params, CLIP)
                optimizer.step()
                optimizer.zero_grad()
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}, trained


def run_script(tmp_path, world: int, device: str) -> tuple[dict, dict]:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(ds_config(str(nvme), device)))
    script = [SCRIPT, "--out", str(tmp_path), "--deepspeed", "--deepspeed_config", str(config)]
    if world == 1:
        command = [sys.executable, *script]
    else:
        command = [sys.executable, "-m", "zero.launch", "--num_gpus", str(world), "--master_port", str(free_port()),
                   *script]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert os.listdir(nvme) == []  # the staging file and the engine's store are gone
    result = json.loads((tmp_path / "result.json").read_text())
    return result, torch.load(tmp_path / "weights.pt", map_location="cpu")


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL between them)")


@pytest.mark.parametrize("world,device", [(1, "nvme"), (1, "cpu"), (2, "nvme"),
                                          pytest.param(2, "cpu", marks=[pytest.mark.cuda, TWO_GPUS], id="2-cpu-nccl")])
def test_a_deepspeed_script_runs_unchanged_and_trains_as_plain_pytorch(tmp_path, world, device):
    """Where CUDA is present the script trains on the GPUs (NCCL between two) against plain PyTorch on the CPU:
    the same 1e-6, TF32 being off in torch by default."""
    result, saved = run_script(tmp_path, world, device)
    losses, weights, trained = plain_run(world)
    steps = EPOCHS * train_loop.SAMPLES // (MICRO * ACCUM * world)
    assert (result["world"], result["steps"], result["stage"]) == (world, steps, 3)
    assert (result["micro"], result["accum"], result["train_batch"]) == (MICRO, ACCUM, MICRO * ACCUM * world)
    assert result["samples"] == steps * MICRO * ACCUM * world
    assert result["shapes"] == {name: list(w.shape) for name, w in weights.items()}  # ds_shape where partitioned
    assert len(result["losses"]) == len(losses)
    assert max(abs(a - b) for a, b in zip(result["losses"], losses)) <= 1e-6
    for name, expected in weights.items():
        got = saved["weights"][name]
        assert got.shape == expected.shape, name
        assert (got - expected).abs().max().item() <= 1e-6, name
        master = saved["masters"][name]
        if name in trained:
            assert torch.equal(master, got), name  # fp32: the master is the weight
        else:
            assert master is None, name  # a frozen parameter has no optimizer state
    tags = sorted(os.listdir(tmp_path / "ckpt"))
    assert f"global_step{steps}" in tags and "latest" in tags


def test_one_parameters_state_is_read_and_set_whole_on_two_ranks_at_every_stage():
    """tests/deepspeed_scripts/state_access.py over `python -m zero.launch --num_gpus 2`: safe_set_* then safe_get_*
    give back the value on every rank (each rank holds a part of it from stage 1 on), GatheredParameters keeps the
    modifier rank's change, and after a step a gradient set on one parameter is the only one there (the ranks agree
    on which have none, or their collectives would not match)."""
    script = os.path.join(os.path.dirname(__file__), "deepspeed_scripts", "state_access.py")
    done = subprocess.run([sys.executable, "-m", "zero.launch", "--num_gpus", "2", "--master_port", str(free_port()),
                           "--no_local_rank", script], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["stage"] for r in results] == [0, 1, 2, 3]
    for r in results:
        assert r["wrong"] == [] and r["without_gradient"] == r["params"] - 1, r
