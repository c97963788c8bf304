"""A small convolutional classifier: learns the synthetic data in seconds on a CPU."""

from __future__ import annotations

from torch import nn

from sdnet_trainer.models.init import InitStep, construction_resets


class SimpleCNN(nn.Module):
    """conv-relu-pool x 3, global average pool, linear. No BatchNorm, so data-parallel runs match
    a single process on the concatenated batch exactly (BatchNorm statistics are per rank)."""

    def __init__(self, num_classes: int = 10, *, in_channels: int = 3, width: int = 32) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        for out in (width, 2 * width, 4 * width):
            layers += [
                nn.Conv2d(channels, out, 3, padding=1),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            ]
            channels = out
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x):
        return self.fc(self.pool(self.features(x)).flatten(1))

    def init_steps(self) -> list[InitStep]:
        """Its init, as the layers' defaults drawn in construction order (see models/init.py)."""
        return construction_resets(self.modules())
