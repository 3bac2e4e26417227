"""A third-party plugin that knows one block type and registers its tensor-parallel plan.

Used by tests/test_tp_plan_hooks.py, registered by name through ``UNISON_PLUGINS=tp_plan_plugin`` (the
path an installed plugin takes through its entry point), so every rank's plugin manager loads it.
:class:`MyBlock` declares no ``tp_plan``; the plugin plans every ``MyBlock`` wherever it sits.
"""

from __future__ import annotations

import torch

import unison

#: The plan of one :class:`MyBlock`, relative to the block (Megatron's MLP pairing).
MY_BLOCK_PLAN = {"mlp.up": "colwise", "mlp.down": "rowwise"}


class MLP(torch.nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class MyBlock(torch.nn.Module):
    """A residual MLP block: the type this plugin knows."""

    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.mlp = MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class OtherBlock(MyBlock):
    """The same layers under a type no plugin knows (a subclass: the plugin matches the class exactly)."""


class Stack(torch.nn.Module):
    """``head(blocks(embed(x)))`` with the blocks in ``layers``; no ``tp_plan`` of its own."""

    def __init__(self, block: type[torch.nn.Module] = MyBlock, n: int = 2, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleList(block() for _ in range(n))
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


@unison.hookimpl
def unison_tensor_parallel_plan(module: torch.nn.Module) -> dict[str, str] | None:
    return dict(MY_BLOCK_PLAN) if type(module) is MyBlock else None
