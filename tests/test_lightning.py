"""Lightning's Trainer and Fabric on our engine (zero.integrations.lightning), with the real `lightning` package.

A LightningModule trained with `strategy="zero3_offload_nvme"` (ZeRO-3, parameters and optimizer state on nvme;
accumulation 2, clipping through Lightning's argument) trains bit for bit as the same module under Lightning's
default strategy with torch AdamW (fused: what CPU-Adam matches). Two ranks through Lightning's own launcher match
Lightning's DDP, and a checkpoint Lightning saves resumes with `fit(ckpt_path=...)` in a fresh launch bit for bit;
Fabric's loop (setup, backward, step, save, load) matches plain Fabric's; a model built in configure_model never
stands whole in memory; the README's block runs as written.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402

from zero.config import ConfigError, load_config  # noqa: E402
from zero.integrations.lightning import (ZeroFabricStrategy, ZeroStrategy, strategy_config,  # noqa: E402
                                         with_run_settings)

from conftest import REPO_ROOT, child_env, readme_block  # noqa: E402
from lightning_models import ACCUM, CLIP, Regressor, fabric_loop, loader, trainer  # noqa: E402
from stage3_models import one_thread  # noqa: E402

TESTS = os.path.join(REPO_ROOT, "tests")


@pytest.fixture(autouse=True)
def lightning_leaves_no_trace(monkeypatch):
    """Lightning's DDP-based strategies set torch's threads to cores / processes unless OMP_NUM_THREADS is set (the
    same threads on both sides of a comparison: matmuls sum in another order with another count), and leave their
    process group and its address in this process: both undone after each test."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    environ = dict(os.environ)
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


def close(a: dict, b: dict, tolerance: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for name, value in b.items():
        assert torch.allclose(a[name], value, rtol=tolerance, atol=tolerance), name


def test_the_trainer_on_our_strategy_trains_as_lightnings_default(tmp_path):
    with one_thread():
        reference = Regressor()
        trainer("auto").fit(reference, loader())
        ours = Regressor()
        fit = trainer(ZeroStrategy(offload="nvme", nvme_path=str(tmp_path)))
        fit.fit(ours, loader())
    engine = fit.strategy.engine
    try:
        assert engine.zero_optimization_stage() == 3 and engine.gradient_accumulation_steps() == ACCUM
        assert engine.config.gradient_clipping == CLIP
        assert all(s.home == "nvme" for n, s in engine.swap.segments.items() if n.endswith("/param"))
        assert len(ours.losses) == len(reference.losses) == 16
        assert ours.losses == reference.losses
        assert all(torch.equal(ours.final[k], v) for k, v in reference.final.items())
    finally:
        engine.close()


def test_a_registered_name_is_the_strategy_and_its_summary_counts_partitioned_parameters(tmp_path, monkeypatch):
    monkeypatch.setenv("ZERO_TIERING_NVME_PATH", str(tmp_path))
    from lightning.pytorch.callbacks import ModelSummary

    summary = ModelSummary()
    with one_thread():
        model = Regressor()
        fit = trainer("zero3_offload_nvme", callbacks=[summary], enable_model_summary=True, max_steps=1)
        assert isinstance(fit.strategy, ZeroStrategy)
        fit.fit(model, loader())
    try:
        table = summary._summary(fit, model)
        assert table.total_parameters == sum(p.ds_numel for p in model.parameters()) > 0
        assert fit.strategy.engine.swap.store is not None
    finally:
        fit.strategy.engine.close()


def test_a_model_built_in_configure_model_is_partitioned_as_it_is_built(tmp_path):
    with one_thread():
        reference = Regressor()
        trainer("auto").fit(reference, loader())
        ours = Regressor(in_configure_model=True)
        fit = trainer(ZeroStrategy(offload="cpu"))
        fit.fit(ours, loader())
    try:
        assert ours.built_partitioned is True  # zero.Init: every parameter left on meta as its module was built
        assert ours.losses == reference.losses
    finally:
        fit.strategy.engine.close()


MEMORY = textwrap.dedent("""
    import json, sys, torch
    import lightning as L
    from torch import nn
    from zero.integrations.lightning import ZeroStrategy

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    class Wide(L.LightningModule):
        def configure_model(self):
            open("/proc/self/clear_refs", "w").write("5")  # the peak from here on
            before = rss("VmRSS")
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(1024, 4096), nn.Linear(4096, 1024))
                                        for _ in range(8))
            self.building = rss("VmHWM") - before

        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
            return x

        def training_step(self, batch, index):
            return self(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    torch.set_num_threads(1)
    model = Wide()
    config = {"train_micro_batch_size_per_gpu": 1, "zero_tiering": {"host_budget": "256MiB"},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": sys.argv[1]},
                                    "offload_optimizer": {"device": "nvme", "nvme_path": sys.argv[1]}}}
    fit = L.Trainer(strategy=ZeroStrategy(config), accelerator="cpu", devices=1, max_steps=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    use_distributed_sampler=False)
    data = torch.utils.data.TensorDataset(torch.randn(2, 1, 1024))
    fit.fit(model, torch.utils.data.DataLoader(data, batch_size=1))
    numel = sum(p.ds_numel for p in model.parameters())
    fit.strategy.engine.close()
    print(json.dumps({"building": model.building, "numel": numel}))
""")


def test_configure_model_never_holds_the_whole_model_in_memory(tmp_path):
    """8 blocks of 1024 x 4096 (67M parameters, 268 MB in fp32) built in configure_model under the strategy: the
    process's peak memory grows by less than half the weights while it builds (zero.Init partitions each module
    to nvme as it is made), and the model trains a step."""
    done = subprocess.run([sys.executable, "-c", MEMORY, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["numel"] == 8 * (2 * 1024 * 4096 + 4096 + 1024)
    assert result["building"] < 4 * result["numel"] / 2


TWO_RANKS = """
import sys, torch
import lightning as L
sys.path.insert(0, {tests!r})
from lightning_models import Regressor, loader, trainer
from zero.integrations.lightning import ZeroStrategy
torch.set_num_threads(1)


class SaveAfterFirstEpoch(L.Callback):
    def on_train_epoch_end(self, trainer, module):
        if {save!r} and trainer.current_epoch == 0:
            trainer.save_checkpoint({save!r})


model = Regressor()
strategy = ZeroStrategy(offload="nvme", nvme_path={nvme!r}) if {ours!r} else "ddp"
fit = trainer(strategy, devices=2, use_distributed_sampler=True, max_epochs=2, callbacks=[SaveAfterFirstEpoch()])
fit.fit(model, loader(), ckpt_path={ckpt!r})
state = fit.strategy.engine.module_state_dict() if {ours!r} else model.final
torch.save({{"losses": model.losses, "final": {{k: v.clone() for k, v in state.items()}}}},
           {out!r} + str(fit.global_rank) + ".pt")
"""


def launch(tmp_path, name: str, *, ours: bool = True, ckpt: str | None = None, save: str | None = None) -> list[dict]:
    """TWO_RANKS (two epochs) as a script Lightning launches on 2 ranks (its subprocess launcher, gloo); each rank's
    result."""
    script, nvme = tmp_path / f"{name}.py", tmp_path / f"nvme_{name}"
    nvme.mkdir()
    script.write_text(TWO_RANKS.format(tests=TESTS, nvme=str(nvme), ours=ours, ckpt=ckpt, save=save,
                                       out=str(tmp_path / f"{name}_")))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env=child_env(), cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    return [torch.load(tmp_path / f"{name}_{rank}.pt") for rank in range(2)]


def test_two_ranks_train_as_lightnings_ddp_and_a_checkpoint_resumes_bitwise(tmp_path):
    """`devices=2` on the CPU: Lightning launches the second rank for our strategy as for its DDP; each rank's
    losses and the weights agree within 1e-6 over two epochs. trainer.save_checkpoint after the first epoch (from a
    callback, as Lightning's ModelCheckpoint saves), and `fit(ckpt_path=...)` in a fresh launch: the second epoch's
    losses and the final weights are the bits of the two epochs at once, on each rank."""
    checkpoint = str(tmp_path / "epoch1.ckpt")
    whole, ddp = launch(tmp_path, "whole", save=checkpoint), launch(tmp_path, "ddp", ours=False)
    assert os.path.isdir(checkpoint)  # the engine's checkpoint: a directory, every rank's part in it
    resumed = launch(tmp_path, "resumed", ckpt=checkpoint)
    for rank in range(2):
        assert len(whole[rank]["losses"]) == 16
        assert whole[rank]["losses"] == pytest.approx(ddp[rank]["losses"], rel=1e-6)
        close(whole[rank]["final"], ddp[rank]["final"])
        assert resumed[rank]["losses"] == whole[rank]["losses"][8:]
        assert all(torch.equal(resumed[rank]["final"][k], v) for k, v in whole[rank]["final"].items())


# -- Fabric -----------------------------------------------------------------------------------------------------


FABRIC_RANKS = """
import sys, torch
sys.path.insert(0, {tests!r})
import lightning as L
from lightning_models import fabric_loop
from zero.integrations.lightning import ZeroFabricStrategy
torch.set_num_threads(1)
nvme = {nvme!r}
config = {{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
          "zero_optimization": {{"stage": 3, "offload_param": {{"device": "nvme", "nvme_path": nvme}},
                                "offload_optimizer": {{"device": "nvme", "nvme_path": nvme}}}}}}
fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ZeroFabricStrategy(config) if {ours!r} else "ddp")
fabric.launch()
losses, model, optimizer = fabric_loop(fabric, 8)
if {ours!r}:
    fabric.save(nvme + "/ckpt", {{"model": model, "optimizer": optimizer, "step": 8}})
    state = {{"model": model, "optimizer": optimizer, "step": 0}}
    assert fabric.load(nvme + "/ckpt", state) == {{}} and state["step"] == 8
more, model, _ = fabric_loop(fabric, 8, model, optimizer, start=8)
final = fabric.strategy.engine.module_state_dict() if {ours!r} else model.state_dict()
torch.save({{"losses": losses + more, "final": {{k: v.detach().clone() for k, v in final.items()}}}},
           {out!r} + str(fabric.global_rank) + ".pt")
"""


def test_fabric_on_two_ranks_trains_saves_and_loads_as_fabrics_ddp(tmp_path):
    """`L.Fabric(devices=2)`: Fabric launches the second rank for our strategy as for its DDP (each rank its own
    batches); through a save and a load on both ranks, each rank's losses and weights agree within 1e-6."""
    results = {}
    for ours in (True, False):
        script, nvme = tmp_path / f"fabric_{ours}.py", tmp_path / f"nvme_{ours}"
        nvme.mkdir()
        script.write_text(FABRIC_RANKS.format(tests=TESTS, nvme=str(nvme), ours=ours, out=str(tmp_path / f"{ours}_")))
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                              env=child_env(), cwd=str(tmp_path))
        assert done.returncode == 0, done.stderr[-3000:]
        results[ours] = [torch.load(tmp_path / f"{ours}_{rank}.pt") for rank in range(2)]
    for ours, ddp in zip(results[True], results[False]):
        # within 1e-6 (absolute or relative): the two reductions sum the ranks' gradients in another order
        assert len(ours["losses"]) == 16 and ours["losses"] == pytest.approx(ddp["losses"], rel=1e-6, abs=1e-6)
        close(ours["final"], ddp["final"])
    assert results[True][0]["losses"] != results[True][1]["losses"]  # the ranks saw different batches


def test_fabric_on_our_strategy_trains_saves_and_loads_as_plain_fabric(tmp_path):
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ACCUM, "gradient_clipping": CLIP,
              "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
                                    "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    with one_thread():
        plain = L.Fabric(accelerator="cpu", devices=1)
        expected, plain_model, _ = fabric_loop(plain, 16)
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=ZeroFabricStrategy(config))
        fabric.launch()  # a data-parallel strategy's (one process here: it runs in this one)
        first, model, optimizer = fabric_loop(fabric, 8)
        fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer, "step": 8})
        state = {"model": model, "optimizer": optimizer, "step": 0}
        rest = fabric.load(tmp_path / "ckpt", state)
        assert state["step"] == 8 and rest == {}
        second, model, _ = fabric_loop(fabric, 8, model, optimizer, start=8)
        engine = fabric.strategy.engine
        try:
            assert first + second == expected
            assert all(torch.equal(engine.module_state_dict()[k], v) for k, v in plain_model.state_dict().items())
        finally:
            engine.close()


# -- what it cannot serve ---------------------------------------------------------------------------------------


class Manual(Regressor):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


@pytest.mark.parametrize("model, options, match", [
    (Manual, {}, "manual optimization"),
    (Regressor, {"precision": "64-true"}, "precision '64-true'"),
    (Regressor, {"gradient_clip_algorithm": "value"}, "clips gradients by their global norm only"),
])
def test_what_the_strategy_cannot_serve_is_an_error_at_fit(model, options, match):
    fit = trainer(ZeroStrategy(offload="cpu"), **options)
    with pytest.raises(MisconfigurationException, match=match):
        fit.fit(model(), loader())


def test_a_config_that_contradicts_the_trainer_names_both(tmp_path):
    from zero.config import ConfigError

    fit = trainer(ZeroStrategy({"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 3}}))
    with pytest.raises(ConfigError, match="gradient_accumulation_steps.*accumulate_grad_batches 2"):
        fit.fit(Regressor(), loader())


def test_fabric_clips_as_deepspeed_and_the_trainer_as_lightning(tmp_path):
    """A config without gradient_clipping: under Fabric it clips at DeepSpeed's default (1.0), as zero.initialize
    does; the Trainer applies gradient_clip_val, none (0.0) when it is not given."""
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=ZeroFabricStrategy(config))
    fabric.launch()
    module = Regressor()
    fabric.setup(module, torch.optim.AdamW(module.parameters()))
    fabric.strategy.engine.close()
    assert fabric.strategy.engine.config.gradient_clipping == 1.0
    assert with_run_settings(config, accumulation=1, clip=0.0, clip_algorithm="norm",
                             precision="32-true")["gradient_clipping"] == 0.0


def test_bfloat16_is_bf16s_old_name_here_too(tmp_path):
    """DeepSpeed's old key `bfloat16` is bf16 for the precision check, and is the section bf16-mixed turns on."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"bfloat16": {"enabled": True}}))
    with pytest.raises(ConfigError, match=r"bfloat16.enabled.*computes in bf16, Lightning's precision is '32-true'"):
        with_run_settings(strategy_config(path, "cpu", None), accumulation=1, clip=None, clip_algorithm="norm",
                          precision="32-true")
    config = with_run_settings(strategy_config({"bfloat16": {"enabled": False}}, "cpu", None), accumulation=1,
                               clip=None, clip_algorithm="norm", precision="bf16-mixed")
    assert config["bfloat16"] == {"enabled": True} and "bf16" not in config
    load_config(config)
    path.write_text('{"bfloat16": {"enabled": true}, "bfloat16": {"enabled": false}}')
    with pytest.raises(ConfigError, match="appears twice"):
        strategy_config(path, "cpu", None)


def test_the_trainers_precision_is_the_engines():
    """`Trainer(precision="bf16-mixed")` with a strategy instance: Lightning would keep a plugin the strategy came
    with and drop the flag; ours takes the flag's, and the engine computes in bf16."""
    fit = trainer(ZeroStrategy(offload="cpu"), precision="bf16-mixed", max_steps=1)
    fit.fit(Regressor(), loader())
    try:
        assert fit.strategy.engine.bfloat16_enabled() and fit.strategy.engine.compute_dtype == torch.bfloat16
    finally:
        fit.strategy.engine.close()


def test_the_readmes_lightning_block_runs_as_written(tmp_path):
    """The README's "From Lightning" block, in a fresh process: the Trainer fits, saves, and a second Trainer resumes
    from the saved checkpoint; Fabric trains and saves."""
    script = tmp_path / "from_lightning.py"
    script.write_text(readme_block("### From Lightning"))
    env = child_env() | {"ZERO_TIERING_NVME_PATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Restored all states from the checkpoint at last.ckpt" in done.stdout + done.stderr
    assert (tmp_path / "last.ckpt").is_dir() and (tmp_path / "fabric.ckpt").is_dir()
    assert len(re.findall(r"^loss \d+\.\d+$", done.stdout, re.M)) == 1
