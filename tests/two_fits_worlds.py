"""Two ``fit`` calls in one worker under plain ``torchrun`` (the pattern of notebooks and hyper-parameter loops).

    torchrun --nproc-per-node 2 tests/two_fits_worlds.py OUT

Each fit trains the tiny MLP of lifecycle_worlds.py with ``ddp`` for 4 steps at its own learning rate;
rank 0 writes both final losses to ``OUT`` (JSON) once the second fit has ended.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import unison

from lifecycle_worlds import data, model


def main() -> None:
    losses = []
    for lr in (1e-2, 1e-3):
        trainer = unison.Trainer(
            strategy="ddp", global_batch_size=8, max_steps=4, seed=0, progress="off", loggers=False, throughput=False
        )
        progress = trainer.fit(
            model(),
            data(),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda params, lr=lr: torch.optim.SGD(params, lr=lr),
        )
        losses.append(progress.history[-1].loss)
    if os.environ["RANK"] == "0":
        with open(sys.argv[1], "w") as f:
            json.dump({"losses": losses, "world_size": int(os.environ["WORLD_SIZE"])}, f)


if __name__ == "__main__":
    main()
