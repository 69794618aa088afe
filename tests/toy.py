"""Small models and data shared by the tests: a LightningModule whose network has repeated blocks."""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class FunctionalDropoutBlock(Block):
    """Dropout as HF's OPT and BART layers write it: ``F.dropout`` in the forward, no ``nn.Dropout`` layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.dropout(self.mlp(self.norm(x)), p=0.3, training=self.training)


class NumpyMaskBlock(Block):
    """A training-time mask drawn with NumPy, as HF's Wav2Vec2 and HuBERT draw their SpecAugment masks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            x = x * torch.from_numpy(np.random.rand(*x.shape[:-1]) > 0.3).to(x)[..., None]
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    """An input layer, ``depth`` repeated blocks (``block(width)``), a head."""

    def __init__(self, width: int = 16, depth: int = 3, classes: int = 4, inputs: int = 8, block=Block) -> None:
        super().__init__()
        self.embed = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ToyTask(pl.LightningModule):
    """A classifier over random features; ``self.model`` holds the network, as FuseCallback expects."""

    def __init__(self, width: int = 16, depth: int = 3, samples: int = 70, batch_size: int = 16) -> None:
        super().__init__()
        self.model = Net(width, depth)
        self.samples = samples
        self.batch_size = batch_size

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.model(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def _loader(self, seed: int) -> DataLoader:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(self.samples, 8, generator=g)
        y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size)

    def train_dataloader(self) -> DataLoader:
        return self._loader(0)

    def val_dataloader(self) -> DataLoader:
        return self._loader(1)


def trainer(callbacks=(), **kwargs) -> pl.Trainer:
    """A quiet CPU trainer for tests."""
    defaults = dict(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
    )
    defaults.update(kwargs)
    return pl.Trainer(callbacks=list(callbacks), **defaults)


def end_ranks() -> None:
    """A DDP script's last line: the process group destroyed before the interpreter exits. Left to the exit, gloo's
    threads once aborted a rank after both fits had ended ("terminate called without an active exception")."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def param_sum(module: nn.Module) -> float:
    """The sum of every parameter, in float64: equal on ranks that updated alike."""
    return sum(p.detach().double().sum().item() for p in module.parameters())


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    """The greatest difference between the two modules' parameters, element by element."""
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters(), strict=True))


class RecordingTask(ToyTask):
    """ToyTask that records every training loss, and can raise ``fail_with`` at training step ``fail_at``.

    ``fail_at`` counts the steps run by this instance (``len(self.losses)``), so a resumed run counts from 0 too.
    """

    def __init__(self, *args, fail_at: int | None = None, fail_with: BaseException | None = None, lr: float = 0.05,
                 **kwargs) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self.losses: list[float] = []
        self.fail_at = fail_at
        self.fail_with = fail_with
        self.lr = lr

    def training_step(self, batch, batch_idx):
        if self.fail_at is not None and len(self.losses) == self.fail_at:
            raise self.fail_with
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)
