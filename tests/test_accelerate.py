"""The Accelerate route (README "From Accelerate"): Accelerate prepares the data, `zero.initialize` the model and
optimizer. The README's block runs as written on two ranks (torchrun, gloo); on one process, ZeRO-3 on nvme, fp32,
the loop gives plain PyTorch's losses and weights with the same prepared loader, bit for bit. Each run is a child
process: Accelerate's state is one per process and would leak into the other tests' Trainers."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("accelerate")

from conftest import child_env, readme_block  # noqa: E402
from stage3_models import free_port  # noqa: E402


def test_readme_block_runs_on_two_ranks(tmp_path):
    script = tmp_path / "accelerate_route.py"
    script.write_text(readme_block("### From Accelerate"))
    env = child_env() | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(re.findall(r"^loss \d+\.\d+$", done.stdout, re.M)) == 1  # accelerator.print: the main process's


PARITY = textwrap.dedent("""
    import json, sys, tempfile
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset
    import zero

    ACCUM, LR = 2, 1e-3
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))

    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(96, 32, generator=generator), torch.randn(96, 1, generator=generator))
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(data, batch_size=8, shuffle=True))
    mse = torch.nn.functional.mse_loss

    nvme = tempfile.mkdtemp()
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": ACCUM, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                        "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                                    "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}}
    engine, _, _, _ = zero.initialize(model=build(), config=config)
    torch.manual_seed(2)  # the prepared loader's shuffle: the same order for both
    ours = []
    for x, y in loader:
        loss = mse(engine(x), y)
        engine.backward(loss)
        engine.step()
        ours.append(loss.item())
    ours_weights = {k: v.tolist() for k, v in engine.module_state_dict().items()}
    engine.close()

    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                                  fused=True)
    torch.manual_seed(2)
    plain = []
    for i, (x, y) in enumerate(loader):
        loss = mse(model(x), y)
        (loss / ACCUM).backward()
        if (i + 1) % ACCUM == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        plain.append(loss.item())
    plain_weights = {k: v.tolist() for k, v in model.state_dict().items()}
    json.dump({"ours": ours, "plain": plain, "ours_weights": ours_weights, "plain_weights": plain_weights},
              open(sys.argv[1], "w"))
""")


def test_accelerate_loader_trains_as_plain_pytorch(tmp_path):
    script, record = tmp_path / "parity.py", tmp_path / "record.json"
    script.write_text(PARITY)
    env = child_env() | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), str(record)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(record.read_text())
    assert len(result["ours"]) == 12
    assert result["ours"] == result["plain"]
    assert result["ours_weights"] == result["plain_weights"]


def test_accelerates_engine_wrapper_steps_where_it_sets_the_boundary():
    """Accelerate's DeepSpeedEngineWrapper (what `accelerator.backward` runs under DeepSpeed) sets the boundary
    before each backward and calls step() at a boundary only: the same losses and weights, bit for bit, as the
    engine's own loop calling step() after every micro-batch."""
    import torch
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

    import zero

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3, "gradient_clipping": 0.5,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                    "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 0}}
    data = [(torch.randn(4, 8, generator=torch.Generator().manual_seed(i)), torch.randn(4, 1)) for i in range(12)]
    results = []
    for wrapped in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        engine, *_ = zero.initialize(model=model, config=config)
        wrapper = DeepSpeedEngineWrapper(engine)
        losses, steps = [], []
        for i, (x, y) in enumerate(data):
            loss = torch.nn.functional.mse_loss(engine(x), y)
            if wrapped:
                wrapper.backward(loss, sync_gradients=i % 3 == 2)
            else:
                engine.backward(loss)
                engine.step()
            losses.append(loss.item())
            steps.append(engine.global_steps)
        results.append((losses, steps, [p.detach().clone() for p in engine.module_state_dict().values()]))
        engine.close()
    (losses, steps, weights), (wrapped_losses, wrapped_steps, wrapped_weights) = results
    assert wrapped_losses == losses and wrapped_steps == steps == [0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4]
    assert all(torch.equal(a, b) for a, b in zip(weights, wrapped_weights))
