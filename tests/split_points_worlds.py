"""A model that is not an nn.Sequential but declares its pipeline split points."""

from __future__ import annotations

import torch

from helpers import regression_data, train


class Regressor(torch.nn.Module):
    pipeline_layers = ("embed", "body", "head")

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Linear(8, 32)
        self.body = torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh())
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)))


def split_points_run() -> dict:
    return train("pipeline", model=Regressor(), data=regression_data())
