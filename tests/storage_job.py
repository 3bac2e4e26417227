"""Factories for the storage tests' training jobs (``unison train`` configs and scripts name them).

The ``Slow`` callback sleeps after every optimizer step so that a job is
still running while a second one starts on the same checkpoint directory.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.utils.data import TensorDataset

import unison


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def datasets() -> tuple[TensorDataset, None]:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(128, 8, generator=g), torch.randn(128, 1, generator=g)), None


loss = torch.nn.functional.mse_loss


class Slow:
    """Sleep ``seconds`` after each optimizer step."""

    def __init__(self, seconds: float = 0.2) -> None:
        self.seconds = seconds

    @unison.hookimpl
    def unison_on_train_step_end(self) -> None:
        time.sleep(self.seconds)


def config(checkpoint_dir: str, max_steps: int, every: int, slow: float) -> str:
    """A ``unison train`` config training :func:`model` into ``checkpoint_dir`` (``slow`` s per step)."""
    return f'''
[trainer]
global_batch_size = 8
max_steps = {max_steps}
checkpoint_dir = "{checkpoint_dir}"
checkpoint_every_n_steps = {every}
progress = "off"
[model]
factory = "storage_job.py:model"
[data]
factory = "storage_job.py:datasets"
[loss]
factory = "storage_job.py:loss"
[[callbacks]]
factory = "storage_job.py:Slow"
kwargs = {{ seconds = {slow} }}
'''


if __name__ == "__main__":
    # python storage_job.py CHECKPOINT_DIR MAX_STEPS EVERY SLOW: train fresh, as a script (no CLI)
    root, steps, every, slow = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    trainer = unison.Trainer(
        strategy="single",
        global_batch_size=8,
        max_steps=steps,
        checkpoint_dir=root,
        checkpoint_every_n_steps=every,
        progress="off",
        callbacks=[Slow(slow)],
    )
    trainer.fit(model, datasets()[0], loss_fn=loss, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
