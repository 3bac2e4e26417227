"""A tiny training script that tests/test_lifecycle*.py run under torchrun, with faults on cue.

    python -m torch.distributed.run --nproc-per-node=2 tests/lifecycle_worlds.py \
        --strategy ddp --ckpt DIR --out FILE [--fault ATTEMPT:RANK:STEP:SIGNAL ...]

``--fault 0:1:7:KILL`` sends SIGKILL to rank 1 at the end of step 7 in the
first attempt (``TORCHELASTIC_RESTART_COUNT`` 0); ``*`` as ATTEMPT means every
attempt; ``TERM``/``USR1`` send those signals instead; ``PARENT`` as RANK
signals torchrun itself (from rank 0). Every run resumes with
``ckpt_path="auto"``. Rank 0 writes the final canonical state to ``OUT`` and
the loss history to ``OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
from torch.utils.data import TensorDataset

import unison


class Faults:
    """Sends the configured signals at the end of the configured steps."""

    def __init__(self, specs: list[str]) -> None:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        rank = int(os.environ.get("RANK", "0"))
        self.at: dict[int, tuple[str, str]] = {}
        for spec in specs:
            when, who, step, sig = spec.split(":")
            if when not in ("*", str(attempt)):
                continue
            if (who == "PARENT" and rank == 0) or who == str(rank):
                self.at[int(step)] = (who, sig)

    @unison.hookimpl
    def unison_on_train_step_end(self, step):
        if step + 1 in self.at:
            who, sig = self.at[step + 1]
            os.kill(os.getppid() if who == "PARENT" else os.getpid(), getattr(signal, f"SIG{sig}"))


def data(n: int = 256, d: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(n, d, generator=g)
    return TensorDataset(x, x @ torch.randn(d, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g))


def model(d: int = 8, hidden: int = 16, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = [torch.nn.Linear(d, hidden), torch.nn.Tanh()]
    for _ in range(layers - 1):
        blocks += [torch.nn.Linear(hidden, hidden), torch.nn.Tanh()]
    net = torch.nn.Sequential(*blocks, torch.nn.Linear(hidden, 1))
    # A tensor-parallel plan (the first Linear split by outputs, the second by inputs), for fsdp_tp.
    net.tp_plan = {"0": "colwise", "2": "rowwise"}
    return net


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=1, help="checkpoint every N steps")
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--fault", action="append", default=[])
    args = p.parse_args()
    trainer = unison.Trainer(
        strategy=args.strategy,
        global_batch_size=8,
        accumulate_grad_batches=args.accumulate,
        max_steps=args.steps,
        seed=0,
        checkpoint_dir=args.ckpt,
        checkpoint_every_n_steps=args.every,
        callbacks=[Faults(args.fault)],
    )
    progress = trainer.fit(
        model(hidden=args.hidden, layers=args.layers),
        data(),
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        ckpt_path="auto",
    )
    state = trainer.full_state_dict()
    if trainer.is_global_zero:
        torch.save(state, args.out)
        with open(args.out + ".json", "w") as f:
            json.dump(
                {
                    "history": [o.as_dict() for o in progress.history],
                    "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                },
                f,
            )


if __name__ == "__main__":
    main()
