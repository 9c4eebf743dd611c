"""A training script written the way DeepSpeed's examples are, run unchanged but for its import line
(`import zero as deepspeed`): arguments from add_config_arguments, the model built under zero.Init, its embedding
resized and the new rows initialized under GatheredParameters(modifier_rank=0), a LoRA-style adapter sized from
`ds_shape`, initialize with training data, the loop of engine(batch) / backward / step, a checkpoint, and the
final weights gathered. tests/test_deepspeed_scripts.py runs it (one rank, and two over `python -m zero.launch`)
against the same steps in plain PyTorch; `model_and_data` is what both build."""
import argparse
import json
import os

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, NEW_VOCAB, DIM, LAYERS, RANK, SEQ, SAMPLES = 64, 72, 32, 3, 4, 8, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, NEW_VOCAB)

    def forward(self, batch):
        ids, labels = batch
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


class LoRA(nn.Module):
    """A low-rank adapter on a frozen linear layer, sized as PEFT sizes one: from `ds_shape` where the weight is
    partitioned."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        out_features, in_features = getattr(base.weight, "ds_shape", base.weight.shape)
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(RANK, in_features) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(out_features, RANK) * 0.01)

    def forward(self, x):
        return self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()


def dataset():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, NEW_VOCAB, (SAMPLES, SEQ), generator=g)
    return torch.utils.data.TensorDataset(ids, torch.roll(ids, -1, 1))


def resize(model, deepspeed=None):
    """A larger embedding, the old rows copied and the new ones drawn (under GatheredParameters when given)."""
    old = model.embed
    with deepspeed.zero.Init() if deepspeed else contextlib_null():
        new = nn.Embedding(NEW_VOCAB, DIM)
    gathered = deepspeed.zero.GatheredParameters([old.weight, new.weight], modifier_rank=0) if deepspeed else contextlib_null()
    with gathered:
        with torch.no_grad():
            new.weight[:VOCAB] = old.weight
            new.weight[VOCAB:].normal_(0.0, 0.02)
    model.embed = new


def contextlib_null():
    import contextlib
    return contextlib.nullcontext()


def adapt(model):
    torch.manual_seed(3)
    for block in model.blocks:
        block.fc1 = LoRA(block.fc1)


def main():
    import zero as deepspeed

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config):
        model = Net()
    resize(model, deepspeed)
    adapt(model)
    engine, optimizer, loader, _ = deepspeed.initialize(args=args, model=model, training_data=dataset(),
                                                        model_parameters=[p for p in model.parameters() if p.requires_grad])
    losses = []
    for epoch in range(2):
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        for batch in loader:
            loss = engine([t.to(engine.device) for t in batch])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.save_checkpoint(os.path.join(args.out, "ckpt"), client_state={"epoch": epoch})
    named = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(named.values())):
        weights = {name: p.detach().clone() for name, p in named.items()}
    masters = {name: deepspeed.utils.safe_get_full_fp32_param(p) for name, p in named.items()}
    shapes = {name: list(getattr(p, "ds_shape", p.shape)) for name, p in named.items()}
    result = dict(losses=losses, world=engine.dp.world_size, steps=engine.global_steps,
                  samples=engine.global_samples, train_batch=engine.train_batch_size(),
                  micro=engine.train_micro_batch_size_per_gpu(), accum=engine.gradient_accumulation_steps(),
                  stage=engine.zero_optimization_stage(), shapes=shapes)
    if engine.dp.rank == 0:
        torch.save(dict(weights=weights, masters=masters), os.path.join(args.out, "weights.pt"))
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)
    engine.close()


if __name__ == "__main__":
    main()
