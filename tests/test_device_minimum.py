"""The least device budget a plan runs in (budgets.device_minimum): a budget below it is refused at `initialize`,
naming the minimum and its parts, before any byte is written; a budget of exactly the minimum trains. With the root
unit held (park_root false) and parked (true: root_uses.py)."""
from __future__ import annotations

import pytest
import torch

import zero
from stage3_models import CheckpointedGPT
from zero.config import ConfigError
from zero.train.gpt import GPTConfig

CONFIG = GPTConfig(n_layer=3, n_head=2, n_embd=64, vocab_size=256, seq_len=16)


def model(seed: int = 0, checkpointing: str | None = None) -> CheckpointedGPT:
    torch.manual_seed(seed)
    return CheckpointedGPT(CONFIG, checkpointing)


def config(tmp_path, *, stage: int = 3, offload: str = "nvme", budget: int | None = None, accum: int = 1,
           persistence: int = 0, model_persistence: int | None = None, prefetch: bool = True, bf16: bool = False,
           park: bool = False) -> dict:
    place = {"device": offload, **({"nvme_path": str(tmp_path)} if offload == "nvme" else {})}
    zo = {"stage": stage, "offload_optimizer": dict(place), "sub_group_size": 20_000}
    if stage == 3:
        zo.update(offload_param=dict(place), stage3_param_persistence_threshold=persistence)
        if model_persistence is not None:
            zo.update(stage3_model_persistence_threshold=model_persistence)
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accum, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zo, "bf16": {"enabled": bf16},
            "zero_tiering": {"prefetch": prefetch, "park_root": park,
                             **({"device_budget": budget} if budget is not None else {})}}


def minimum(tmp_path, checkpointing: str | None = None, **options) -> int:
    engine, *_ = zero.initialize(model=model(0, checkpointing), config=config(tmp_path, **options))
    try:
        return sum(engine.device_minimum.values())
    finally:
        engine.close()


CASES = {
    "stage3-nvme": dict(),
    "stage3-nvme-root-parked": dict(park=True),
    "stage3-cpu-accumulation-root-parked": dict(offload="cpu", accum=3, park=True),
    "stage3-cpu-accumulation": dict(offload="cpu", accum=3),
    "stage3-persistent-blocks": dict(offload="cpu", persistence=60_000),
    # The cap holds the root and block 0; unprefetched, the peak tells whether the minimum counts the others persistent.
    "stage3-persistent-blocks-capped": dict(offload="cpu", persistence=60_000, model_persistence=100_000,
                                            prefetch=False),
    "stage3-bf16": dict(bf16=True),
    "stage3-no-prefetch": dict(prefetch=False),
    # The recomputation's gather prefetches inside the backward: the block's gradients are counted before it.
    "stage3-cpu-reentrant-checkpointing": dict(offload="cpu", checkpointing="reentrant"),
    "stage3-cpu-nonreentrant-checkpointing": dict(offload="cpu", checkpointing="nonreentrant"),
    "stage3-state-on-device": dict(offload="none"),
    "stage2-cpu": dict(stage=2, offload="cpu"),
    "stage2-state-on-device": dict(stage=2, offload="none"),
    "stage1-state-on-device-bf16": dict(stage=1, offload="none", bf16=True),
}


@pytest.mark.parametrize("case", CASES)
def test_a_budget_of_exactly_the_minimum_trains_and_one_byte_less_is_refused(tmp_path, case):
    options = dict(CASES[case])
    checkpointing = options.pop("checkpointing", None)
    need = minimum(tmp_path, checkpointing, **options)
    assert need > 0
    with pytest.raises(ConfigError, match=rf"zero_tiering.device_budget.*raise it to at least {need} bytes"):
        zero.initialize(model=model(0, checkpointing), config=config(tmp_path, budget=need - 1, **options))
    engine, *_ = zero.initialize(model=model(0, checkpointing), config=config(tmp_path, budget=need, **options))
    try:
        torch.manual_seed(1)
        for _ in range(2 * options.get("accum", 1)):
            ids = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len))
            engine.backward(engine(ids, ids))
            engine.step()
        assert engine.swap.device_tier.peak == need  # the minimum is what the engine's peak holds
    finally:
        engine.close()
