"""zero.utils' safe_set_* / safe_get_* and GatheredParameters(modifier_rank=0) on every stage, run by
tests/test_deepspeed_scripts.py on two ranks: what one call sets, every rank reads back whole; only rank 0's change
inside the block is kept; a gradient set on one parameter leaves the others without one (or zero). Prints one JSON line per
stage on rank 0."""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models import make_config, tied_blocks  # noqa: E402

import zero as deepspeed  # noqa: E402


def check(stage: int) -> dict:
    model = tied_blocks(0)
    engine, *_ = deepspeed.initialize(model=model, config=make_config(stage, "cpu"))
    params = [p for p in model.parameters() if p.requires_grad]
    wrong = []
    for i, p in enumerate(params):
        shape = getattr(p, "ds_shape", p.shape)
        value = torch.arange(shape.numel(), dtype=torch.float32).reshape(shape) * 0.001 + i
        deepspeed.utils.safe_set_full_fp32_param(p, value)
        if not torch.equal(deepspeed.utils.safe_get_full_fp32_param(p), value):
            wrong.append(f"master {i}")
        deepspeed.utils.safe_set_full_optimizer_state(p, value * 2, "exp_avg")
        if not torch.equal(deepspeed.utils.safe_get_full_optimizer_state(p, "exp_avg"), value * 2):
            wrong.append(f"exp_avg {i}")
        with deepspeed.zero.GatheredParameters([p]):
            if not torch.equal(p.detach(), value):
                wrong.append(f"parameter {i}")
    first = params[0]
    with deepspeed.zero.GatheredParameters([first], modifier_rank=0):
        first.data.fill_(0.5 if engine.dp.rank == 0 else -1.0)
    if not torch.equal(deepspeed.utils.safe_get_full_fp32_param(first), torch.full_like(first.detach(), 0.5)
                       if first.numel() else torch.full(first.ds_shape, 0.5)):
        wrong.append("modifier rank")
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(engine.dp.rank))
    engine.backward(engine(ids, ids).loss)
    engine.step()
    last = params[-1]
    deepspeed.utils.safe_set_full_grad(last, torch.ones(getattr(last, "ds_shape", last.shape)))
    grads = [deepspeed.utils.safe_get_full_grad(p) for p in params]
    if grads[-1] is None or not torch.equal(grads[-1], torch.ones_like(grads[-1])):
        wrong.append("set gradient")
    engine.close()
    # The others: None, or zeros where they share the set one's sub-group (its gradient is then live, theirs zero).
    return dict(stage=stage, wrong=wrong, params=len(params),
                without_gradient=sum(g is None or not g.any() for g in grads[:-1]))


if __name__ == "__main__":
    deepspeed.init_distributed()
    for stage in range(4):
        result = check(stage)
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
    dist.destroy_process_group()
