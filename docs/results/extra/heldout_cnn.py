"""A held-out model (not in the repository): a small CNN with a wide MLP head, ~5.2M parameters."""
import torch.nn as nn


def build():
    def block(cin, cout, stride):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())
    return nn.Sequential(
        block(3, 64, 1), block(64, 128, 2), block(128, 256, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
