"""The least host budget a plan runs in (budgets.host_minimum): a budget below it is refused at `initialize`, naming
the minimum and its parts, before any byte is written; a budget of exactly the minimum trains. Beside what is homed
on the host and the largest shard a gather holds, the backward holds a tied embedding's head gradient and the
gradients' staging there, and a step one sub-group's state and gradient."""
from __future__ import annotations

import re

import pytest
import torch

import zero
from zero.config import ConfigError
from zero.train.gpt import GPT, GPTConfig

CONFIG = GPTConfig(n_layer=3, n_head=2, n_embd=64, vocab_size=256, seq_len=16)


def config(tmp_path, *, params: str = "nvme", state: str = "nvme", stage: int = 3, accum: int = 1,
           bf16: bool = False, budget: int | None = None) -> dict:
    place = lambda device: {"device": device, **({"nvme_path": str(tmp_path)} if device == "nvme" else {})}
    zo = {"stage": stage, "offload_optimizer": place(state), "sub_group_size": 20_000}
    if stage == 3:
        zo.update(offload_param=place(params), stage3_param_persistence_threshold=0)
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accum, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zo, "bf16": {"enabled": bf16},
            "zero_tiering": {} if budget is None else {"host_budget": budget}}


def minimum(tmp_path, **options) -> int:
    """The minimum initialize names when refusing a budget of one byte."""
    with pytest.raises(ConfigError, match="zero_tiering.host_budget") as refused:
        zero.initialize(model=GPT(CONFIG), config=config(tmp_path, budget=1, **options))
    return int(re.search(r"raise it to at least (\d+) bytes", str(refused.value)).group(1))


CASES = {
    "stage3-nvme": dict(),
    "stage3-nvme-accumulation": dict(accum=3),
    "stage3-params-nvme-state-cpu": dict(state="cpu"),
    "stage3-params-nvme-state-cpu-bf16": dict(state="cpu", bf16=True),
    "stage3-params-cpu-state-nvme": dict(params="cpu"),
    "stage3-cpu": dict(params="cpu", state="cpu"),
    "stage3-params-on-device-state-nvme": dict(params="none"),
    "stage2-nvme": dict(stage=2),
    "stage1-cpu": dict(stage=1, state="cpu"),
    # The host pool would lend a bf16 gradient an fp32 sub-group's old buffer, an fp32 master a larger shard's, and
    # count all of it: at the minimum its `spare` is 0, so it allocates the sizes asked.
    "stage3-nvme-bf16": dict(bf16=True),
}


@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_a_host_budget_of_exactly_the_minimum_trains_and_one_byte_less_is_refused(tmp_path, options):
    need = minimum(tmp_path, **options)
    with pytest.raises(ConfigError, match=rf"zero_tiering.host_budget.*raise it to at least {need} bytes"):
        zero.initialize(model=GPT(CONFIG), config=config(tmp_path, budget=need - 1, **options))
    torch.manual_seed(0)
    engine, *_ = zero.initialize(model=GPT(CONFIG), config=config(tmp_path, budget=need, **options))
    try:
        torch.manual_seed(1)
        for _ in range(3 * options.get("accum", 1)):
            ids = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len))
            engine.backward(engine(ids, ids))
            engine.step()
        assert engine.swap.pool.peak_in_use <= need
    finally:
        engine.close()


def test_the_minimum_names_the_tied_head_gradient(tmp_path):
    """The root unit's tied embedding sends its head gradient to the host for the whole backward: the refusal says
    so, with the gradients' staging beside it."""
    with pytest.raises(ConfigError, match=r"head gradients and gradient staging"):
        zero.initialize(model=GPT(CONFIG), config=config(tmp_path, state="cpu", budget=1))
