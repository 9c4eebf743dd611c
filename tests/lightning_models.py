"""A small LightningModule and a Fabric loop for the Lightning strategy tests, in a file of its own so the scripts
the tests run in fresh processes (a resume, two ranks through Lightning's and Fabric's launchers) import the same
ones."""
from __future__ import annotations

import lightning as L
import torch
from torch import nn

STEPS_PER_EPOCH = 4
"""Optimizer steps an epoch: 16 batches of 4 rows, accumulation 2... per rank, at one rank."""
ACCUM, CLIP, LR = 2, 0.5, 1e-2


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Regressor(L.LightningModule):
    """Three residual blocks (the engine's units) between an input and an output layer; AdamW; every training loss
    kept in `losses`, the weights at the end of fit in `final`."""

    def __init__(self, width: int = 32, seed: int = 0, in_configure_model: bool = False):
        super().__init__()
        self.width, self.seed = width, seed
        self.losses: list[float] = []
        self.final: dict[str, torch.Tensor] = {}
        self.built_partitioned: bool | None = None
        if not in_configure_model:
            self.build()

    def build(self) -> None:
        torch.manual_seed(self.seed)
        self.inp = nn.Linear(8, self.width)
        self.blocks = nn.ModuleList(Block(self.width) for _ in range(3))
        self.out = nn.Linear(self.width, 1)

    def configure_model(self) -> None:
        if not hasattr(self, "blocks"):
            self.build()
            self.built_partitioned = all(p.is_meta for p in self.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)

    def training_step(self, batch, index):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        return loss

    def on_train_end(self) -> None:
        self.final = {k: v.detach().clone() for k, v in self.state_dict().items()}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01, fused=True)  # what CPU-Adam matches


def loader(rows: int = 64, batch: int = 4) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 8, generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch)


def trainer(strategy, **overrides) -> L.Trainer:
    options = dict(strategy=strategy, accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=ACCUM,
                   gradient_clip_val=CLIP, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, use_distributed_sampler=False)
    options.update(overrides)
    return L.Trainer(**options)


def fabric_loop(fabric: L.Fabric, steps: int, model=None, optimizer=None,
                start: int = 0) -> tuple[list[float], object, object]:
    """`steps` micro-batches of the loop as Fabric's docs write it (each rank every world_size-th batch); our
    strategy accumulates and clips by its config, plain Fabric by hand."""
    from zero.integrations.lightning import ZeroFabricStrategy

    ours = isinstance(fabric.strategy, ZeroFabricStrategy)
    if model is None:
        with fabric.init_module():
            module = Regressor()
        model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.01,
                                                                  fused=True))
    batches = list(loader())
    losses = []
    for index in range(start, start + steps):
        x, y = batches[(index * fabric.world_size + fabric.global_rank) % len(batches)]
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss if ours else loss / ACCUM)
        losses.append(loss.item())
        if ours:
            optimizer.step()  # the engine applies it at the accumulation boundary
        elif (index + 1) % ACCUM == 0:
            fabric.clip_gradients(model, optimizer, max_norm=CLIP)
            optimizer.step()
            optimizer.zero_grad()
    return losses, model, optimizer
