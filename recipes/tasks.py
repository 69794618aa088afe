"""LightningModules of the recipes: image classification and byte-level language modelling.

Each holds its network as ``self.model``. ``FuseCallback`` compiles submodules of ``self.model`` in
place, never the LightningModule itself, so the loss, the metrics and ``self.log`` stay eager.
Neither sets ``flops_per_batch`` or ``example_input_array``: the callback counts FLOPs itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, cosine: bool = True) -> float:
    """Learning-rate factor at ``step``: linear warmup over ``warmup_steps``, then cosine decay to 10% at
    ``total_steps`` (or constant)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if not cosine:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


@dataclass
class AdamWSchedule:
    """AdamW whose learning rate warms up linearly, then decays along a cosine to 10% of ``lr`` (or stays at ``lr``).

    Args:
        lr: peak learning rate.
        weight_decay: weight decay of matrices and embeddings (biases and norms get none).
        warmup_steps: steps of linear warmup.
        cosine: decay to 10% over the run after warmup; False keeps the rate at ``lr``.

    Raises:
        ValueError: If ``lr`` is not positive, or ``weight_decay`` or ``warmup_steps`` is negative.

    Example::

        >>> schedule = AdamWSchedule(lr=1e-3, weight_decay=0.1, warmup_steps=10)
        >>> configured = schedule.configure(nn.Linear(4, 2), total_steps=100, fused=False)
        >>> [group["weight_decay"] for group in configured["optimizer"].param_groups]  # the bias gets none
        [0.1, 0.0]
    """

    lr: float
    weight_decay: float
    warmup_steps: int = 0
    cosine: bool = True

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.weight_decay < 0 or self.warmup_steps < 0:
            raise ValueError(
                f"AdamWSchedule needs lr > 0, weight_decay >= 0 and warmup_steps >= 0; got lr={self.lr}, "
                f"weight_decay={self.weight_decay}, warmup_steps={self.warmup_steps}. Fix model.optim.*."
            )

    def configure(self, net: nn.Module, total_steps: float, fused: bool) -> dict[str, Any]:
        """What ``configure_optimizers`` returns for ``net``'s trainable parameters over a run of ``total_steps``."""
        if self.cosine and math.isinf(total_steps):
            raise ValueError(
                "The cosine schedule needs a run of known length: set trainer.max_steps or trainer.max_epochs, "
                "or model.optim.cosine=false."
            )
        params = [p for p in net.parameters() if p.requires_grad]
        groups = [  # no weight decay on biases and norm weights
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": self.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.lr, fused=fused)
        total = int(total_steps) if self.cosine else 0
        schedule = partial(warmup_cosine, warmup_steps=self.warmup_steps, total_steps=total, cosine=self.cosine)
        scheduler = LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


IMAGE_SCHEDULE = AdamWSchedule(lr=2e-3, weight_decay=0.05)
TEXT_SCHEDULE = AdamWSchedule(lr=6e-4, weight_decay=0.1, warmup_steps=50)


class _Task(L.LightningModule):
    """Holds ``self.model`` and trains it with ``self.optim``, an :class:`AdamWSchedule`."""

    def __init__(self, net: nn.Module, optim: AdamWSchedule) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["net"])
        self.model = net
        self.optim = replace(optim)  # its own copy: the defaults are shared module constants

    def configure_optimizers(self) -> dict[str, Any]:
        fused = self.device.type == "cuda"
        return self.optim.configure(self.model, self.trainer.estimated_stepping_batches, fused=fused)


class ImageClassifier(_Task):
    """Classifies images with ``net``; logs cross-entropy loss and accuracy.

    Logged: ``train/loss``, ``train/acc`` each step; ``val/loss``, ``val/acc`` each validation.

    Args:
        net: a network mapping images ``(B, C, H, W)`` to logits ``(B, num_classes)``; stored as ``self.model``.
        num_classes: number of classes.
        optim: the optimizer and its learning-rate schedule.

    Example::

        >>> from recipes.models import resnet18_cifar
        >>> task = ImageClassifier(resnet18_cifar())
        >>> type(task.model).__name__
        'ResNet'
    """

    def __init__(self, net: nn.Module, num_classes: int = 10, optim: AdamWSchedule = IMAGE_SCHEDULE) -> None:
        super().__init__(net, optim)
        self.val_acc = MulticlassAccuracy(num_classes)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        logits = self.model(images)
        loss = F.cross_entropy(logits, labels)
        # a plain tensor mean: torchmetrics' accuracy validates labels with a host-device sync on every step
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", (logits.argmax(dim=-1) == labels).float().mean())
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self.model(images)
        self.val_acc(logits, labels)
        self.log("val/loss", F.cross_entropy(logits, labels), prog_bar=True, sync_dist=True)
        self.log("val/acc", self.val_acc, prog_bar=True)


class LanguageModel(_Task):
    """Next-token prediction with ``net``; logs cross-entropy loss and perplexity.

    Logged: ``train/loss`` each step; ``val/loss``, ``val/ppl`` each validation.

    Args:
        net: a network mapping token ids ``(B, T)`` to logits ``(B, T, V)``; stored as ``self.model``.
        optim: the optimizer and its learning-rate schedule.

    Raises:
        ValueError: In ``setup``, if the data module's ``vocab_size`` exceeds the network's.

    Example::

        >>> from recipes.models import GPT
        >>> task = LanguageModel(GPT(vocab_size=256, max_seq_len=16, n_layer=2, d_model=32, n_head=4))
        >>> len(task.model.blocks)
        2
    """

    def __init__(self, net: nn.Module, optim: AdamWSchedule = TEXT_SCHEDULE) -> None:
        super().__init__(net, optim)
        self.val_ppl = Perplexity()

    def setup(self, stage: str) -> None:
        data_vocab = getattr(self.trainer.datamodule, "vocab_size", None)
        net_vocab = getattr(self.model, "vocab_size", None)
        if data_vocab is not None and net_vocab is not None and data_vocab > net_vocab:
            raise ValueError(
                f"The data has {data_vocab} token ids but model.net.vocab_size={net_vocab}; "
                f"set model.net.vocab_size>={data_vocab}."
            )

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens, targets = batch  # (B, T) each: targets are tokens shifted by one
        logits = self.model(tokens)  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        logits = self.model(tokens)
        self.val_ppl(logits.float(), targets)  # float: perplexity of bf16 logits loses digits
        self.log("val/loss", F.cross_entropy(logits.flatten(0, 1), targets.flatten()), prog_bar=True, sync_dist=True)
        self.log("val/ppl", self.val_ppl, prog_bar=True)
