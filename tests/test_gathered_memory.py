"""GatheredParameters never frees storage a caller may still hold: tensors taken inside the block (`p.data`,
`p.data.cpu()`, a view, a clone) read the block's values after it, once the engine has reused its buffers for
other units, and save to a file that loads. Run in a fresh process each, so a crash fails the test instead of
taking pytest down."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys, torch
    from torch import nn
    import zero as deepspeed

    class Blocks(nn.Module):
        def __init__(self, dim=64, layers=3):
            super().__init__()
            self.embed = nn.Embedding(32, dim)
            self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

        def forward(self, ids, labels):
            x = self.embed(ids)
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return nn.functional.cross_entropy((x @ self.embed.weight.t()).flatten(0, 1), labels.flatten())

    device, where, path = sys.argv[1], sys.argv[2], sys.argv[3]
    offload = {"device": device, **({"nvme_path": path} if device == "nvme" else {})}
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "offload_param": dict(offload), "offload_optimizer": dict(offload),
                                    "stage3_param_persistence_threshold": 0}}
    torch.manual_seed(0)
    if where == "init":
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = Blocks()
    else:
        model = Blocks()
    engine = None
    if where == "engine":
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    kept = {}
    weight = model.layers[1].weight
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        expected = weight.detach().clone()
        kept = {"data": weight.data, "cpu": weight.data.cpu(), "view": weight.data[3:7, 5:],
                "clone": weight.data.clone(), "detached": weight.detach()}
        expected_view = expected[3:7, 5:]
    if engine is not None:  # the units' buffers go to other units, and the step rewrites the shards
        ids = torch.randint(0, 32, (2, 8))
        for _ in range(2):
            engine.backward(engine(ids, ids))
            engine.step()
    for name, tensor in kept.items():
        want = expected_view if name == "view" else expected
        assert torch.equal(tensor, want), name
    torch.save(kept, path + "/kept.pt")
    again = torch.load(path + "/kept.pt")
    assert all(torch.equal(again[name], kept[name]) for name in kept)
    if engine is not None:
        engine.close()
    print("OK")
""")


@pytest.mark.parametrize("device,where", [("cpu", "engine"), ("nvme", "engine"), ("nvme", "init")])
def test_tensors_taken_inside_the_block_stay_valid_after_it(tmp_path, device, where):
    run = subprocess.run([sys.executable, "-c", SCRIPT, device, where, str(tmp_path)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), (run.returncode, run.stdout, run.stderr[-3000:])


def test_what_the_parameters_hold_on_exit_is_adopted_assigned_or_written_in_place(tmp_path):
    import torch
    from torch import nn

    import zero as deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                    "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    first, second = model[0].weight, model[1].weight
    with deepspeed.zero.GatheredParameters([first, second], modifier_rank=0):
        first.data = torch.full((8, 8), 2.0)  # assigned
        second.data.fill_(3.0)  # written in place
    assert torch.equal(deepspeed.utils.safe_get_full_fp32_param(first), torch.full((8, 8), 2.0))
    assert torch.equal(deepspeed.utils.safe_get_full_fp32_param(second), torch.full((8, 8), 3.0))
    with deepspeed.zero.GatheredParameters([first]):
        assert torch.equal(first, torch.full((8, 8), 2.0))
    engine.close()


@pytest.mark.parametrize("stage,persistence", [(2, 0), (3, 10**6), (3, 0)])
def test_an_assigned_or_nested_write_is_adopted_at_every_stage_and_trained(stage, persistence):
    """Whether or not the block lends the unit a private copy (stages 0-2 and persistent units never do), and in a
    block nested in a read-only one: the write reaches the masters, and the forward computes with what the step
    trains, not with a tensor the block left the parameter bound to."""
    import torch
    from torch import nn

    import zero as deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": persistence}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    first, second = model[0].weight, model[2].weight
    shapes = {first: (8, 8), second: (1, 8)}
    with deepspeed.zero.GatheredParameters([first], modifier_rank=0):
        first.data = torch.full((8, 8), 0.5)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):  # read-only, around a modifying one
        with deepspeed.zero.GatheredParameters([second], modifier_rank=0):
            second.data.fill_(0.25)
        assert torch.equal(second, torch.full((1, 8), 0.25))
    for param, value in ((first, 0.5), (second, 0.25)):
        assert torch.equal(deepspeed.utils.safe_get_full_fp32_param(param), torch.full(shapes[param], value))
    x = torch.randn(2, 8)
    engine.backward(engine(x).square().mean())
    engine.step()
    with deepspeed.zero.GatheredParameters([first, second]):
        for param in (first, second):
            assert torch.equal(param, deepspeed.utils.safe_get_full_fp32_param(param)), "trained a master nobody reads"
            assert not torch.equal(param, torch.full(shapes[param], 0.5 if param is first else 0.25))
    engine.close()


def test_a_modifying_block_leaves_the_fp32_masters_of_what_it_did_not_change():
    """The full values are in the compute dtype (bf16): adopting an unchanged element would round its master."""
    import torch
    from torch import nn

    import zero as deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.backward(engine(torch.randn(2, 16, dtype=torch.bfloat16)).float().square().mean())
    engine.step()
    masters = {name: deepspeed.utils.safe_get_full_fp32_param(p) for name, p in model.named_parameters()}
    assert not torch.equal(masters["0.weight"], masters["0.weight"].bfloat16().float())  # fp32 bits to lose
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        model[2].bias.data.zero_()
        model[0].weight.data[0, 0] = 1.0
    after = {name: deepspeed.utils.safe_get_full_fp32_param(p) for name, p in model.named_parameters()}
    assert torch.equal(after["2.bias"], torch.zeros(1))
    assert after["0.weight"][0, 0] == 1.0
    masters["0.weight"][0, 0] = 1.0
    for name in ("0.weight", "0.bias", "2.weight"):
        assert torch.equal(after[name], masters[name]), name
    engine.close()


def _budgeted_engine():
    """A stage-3 engine whose device budget is its minimum (budgets.device_minimum), after one step: the gathered
    units, the unit gradients and the reduction's scratch (kept from the first backward)."""
    import torch
    from torch import nn

    import zero as deepspeed

    class Layers(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(16, 64)
            self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))

        def forward(self, ids):
            x = self.embed(ids)
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x.square().mean()

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                    "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=Layers(), config=config)
    need = sum(engine.device_minimum.values())
    engine.close()
    config["zero_tiering"] = {"device_budget": need}
    torch.manual_seed(0)
    model = Layers()
    engine, *_ = deepspeed.initialize(model=model, config=config)
    ids = torch.randint(0, 16, (2, 8))
    engine.backward(engine(ids))
    engine.step()
    return engine, model, ids


def test_the_private_copies_count_against_the_device_budget_while_the_block_holds_them():
    """A block gathering one block's unit: its full buffer (gathered units) and the copy the parameters are lent
    (GatheredParameters' copies) both count, within the budget; both go at the block's end."""
    import zero as deepspeed

    engine, model, ids = _budgeted_engine()
    tier = engine.swap.device_tier
    unit = next(u for u in engine.units if u.name == "layers.0")
    before = tier.in_use
    with deepspeed.zero.GatheredParameters(list(model.layers[0].parameters())):
        assert tier.in_use == before + 2 * tier.charge(unit.nbytes) <= tier.budget, tier.parts()
        assert tier.parts()["GatheredParameters' copies"] == tier.charge(unit.nbytes)
    assert tier.parts()["GatheredParameters' copies"] == 0 and tier.in_use == before
    engine.backward(engine(ids))
    engine.step()
    engine.close()


def test_a_block_whose_copies_pass_the_device_budget_raises_naming_the_numbers():
    """Every unit gathered at once with a copy of each: 2 x (4 + 20 + 20) KiB beside the 40 KiB scratch is past the
    88 KiB budget. The error names the budget, what is in use by part (the copies among them) and the request; the
    block leaves nothing held, and training goes on."""
    import pytest

    import zero as deepspeed
    from tiering import BudgetExceededError

    engine, model, ids = _budgeted_engine()
    tier = engine.swap.device_tier
    assert [u.nbytes for u in engine.units] == [4096, 20480, 20480] and tier.budget == 90112
    before = tier.in_use
    with pytest.raises(BudgetExceededError, match=r"device budget 88\.0 KiB exhausted: 88\.0 KiB in use \(gathered "
                       r"units 24\.0 KiB, reduction scratch 40\.0 KiB, GatheredParameters' copies 24\.0 KiB\), 20\.0 "
                       r"KiB requested for 'layers\.1'"):
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            pass
    assert tier.in_use == before and not engine._lent
    engine.backward(engine(ids))
    engine.step()
    engine.close()
