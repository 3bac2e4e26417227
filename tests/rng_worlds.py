"""A Dropout model trained with the Trainer's default plugins on and off, and resumed in a new process
(importable by spawned ranks: each call of ``spawn`` is a fresh process, as a restarted job is)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import TensorDataset

import unison

STEPS, HALF = 12, 6


def dropout_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 8, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def train(
    strategy: str, defaults: bool, max_steps: int = STEPS, ckpt_path: str | None = None, **options: Any
) -> dict[str, torch.Tensor]:
    """Train with the default callbacks, loggers and progress (``defaults``) or with all of them off."""
    quiet = {} if defaults else {"throughput": False, "loggers": False, "progress": "off"}
    trainer = unison.Trainer(
        strategy=strategy,
        global_batch_size=16,
        accumulate_grad_batches=2,
        max_steps=max_steps,
        seed=0,
        **quiet,
        **options,
    )
    trainer.fit(
        dropout_mlp,
        data(),
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        ckpt_path=ckpt_path,
    )
    return trainer.full_state_dict()


def resume(strategy: str, checkpoint_dir: str) -> dict[str, torch.Tensor]:
    """Continue the run saved in ``checkpoint_dir`` to :data:`STEPS`, with the default plugins on."""
    return train(strategy, True, ckpt_path="last", checkpoint_dir=checkpoint_dir)
