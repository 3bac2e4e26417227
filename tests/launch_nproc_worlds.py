"""A training script for tests/test_launch_nproc.py: ``python tests/launch_nproc_worlds.py OUT [NPROC]``.

With NPROC it passes ``Trainer(nproc=NPROC)``; rank 0 saves the final weights and the world size to OUT.
"""

from __future__ import annotations

import sys

import torch
from torch.utils.data import TensorDataset

import unison


def main(out: str, nproc: int | None) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    train = TensorDataset(x, x.sum(1, keepdim=True))

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    options = {} if nproc is None else {"nproc": nproc}
    trainer = unison.Trainer(
        strategy="ddp", global_batch_size=8, max_steps=6, seed=0, progress="off", throughput=False, **options
    )
    trainer.fit(model, train, loss_fn=torch.nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    if trainer.is_global_zero:
        torch.save({"state": trainer.full_state_dict(), "world_size": trainer.env.world_size}, out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
