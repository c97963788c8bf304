"""A custom model trained by subclassing ``sdnet_trainer.Trainer``.

The subclass says *what* to train (model, data, loss); the Trainer does the rest (DDP, batch
split, precision, accumulation, clipping, schedule, evaluation, logging). Two ways to launch it:

    # as its own script
    torchrun --standalone --nproc_per_node=2 recipes/custom_model.py +recipe=custom_spirals
    # through the package CLI, naming the class in config (recipes/custom_spirals.yaml does)
    torchrun --standalone --nproc_per_node=2 -m sdnet_trainer +recipe=custom_spirals

The task: K interleaved 2-D spirals, one class each; a straight line cannot separate them, a small
MLP can. Expect val/top1 to climb from 1/K towards 100% within a few hundred steps.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import TensorDataset

import sdnet_trainer


def spirals(n: int, *, classes: int, seed: int, noise: float = 0.03) -> TensorDataset:
    """``n`` points on ``classes`` spiral arms, with Gaussian jitter."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % classes
    radius = 0.1 + 0.9 * torch.rand(n, generator=g)  # the arms meet at the centre: keep off it
    angle = 3 * math.pi * radius + 2 * math.pi * labels / classes
    points = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    return TensorDataset(points + noise * torch.randn(n, 2, generator=g), labels)


class SpiralTrainer(sdnet_trainer.Trainer):
    def build_model(self) -> nn.Module:
        width = self.cfg.model.kwargs.get("width", 128)
        # Taken from the data (or the config) before the model is built.
        num_classes = self.cfg.model.num_classes
        assert num_classes is not None
        return nn.Sequential(
            nn.Linear(2, width),
            nn.GELU(),
            nn.Linear(width, width),
            nn.GELU(),
            nn.Linear(width, num_classes),
        )

    def build_datasets(self):
        data = self.cfg.data
        return (
            spirals(data.train_size, classes=data.num_classes, seed=data.synthetic_seed),
            spirals(data.val_size, classes=data.num_classes, seed=data.synthetic_seed + 1),
        )

    def compute_loss(self, batch) -> torch.Tensor:
        points, labels = batch
        return nn.functional.cross_entropy(self.model(points), labels)


if __name__ == "__main__":
    sdnet_trainer.launch(SpiralTrainer)
