"""The tiny job of tests/lifecycle_worlds.py with a stall timeout and a rank that freezes on cue.

    unison run --nproc 2 tests/watchdog_worlds.py --ckpt DIR --out FILE --stall 20 [--freeze RANK:STEP]

``--freeze 1:7`` makes rank 1 write the time to ``OUT.frozen`` and stop itself
(SIGSTOP) at the end of step 7 of the first attempt. Every rank writes its pid
to ``OUT.pid-RANK`` so that a test can make sure nothing is left behind. Every
run resumes with ``ckpt_path="auto"``; rank 0 writes the final canonical state
to ``OUT`` and the loss history to ``OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch

import unison

from lifecycle_worlds import data, model


class Freeze:
    """Stops this process (SIGSTOP) at the end of one step, after noting the time."""

    def __init__(self, spec: str | None, out: str) -> None:
        rank = int(os.environ.get("RANK", "0"))
        who, step = spec.split(":") if spec else ("-1", "0")
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.step = int(step) if who == str(rank) and first_attempt else None
        self.out = out

    @unison.hookimpl
    def unison_on_train_step_end(self, step):
        if self.step is not None and step + 1 == self.step:
            with open(self.out + ".frozen", "w") as f:
                f.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4, help="checkpoint every N steps")
    p.add_argument("--stall", type=float, default=20.0, help="stall_timeout_s")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--freeze", default=None, help="RANK:STEP")
    args = p.parse_args()
    with open(f"{args.out}.pid-{os.environ.get('RANK', '0')}", "w") as f:
        f.write(str(os.getpid()))
    trainer = unison.Trainer(
        strategy="ddp",
        global_batch_size=8,
        max_steps=args.steps,
        seed=0,
        checkpoint_dir=args.ckpt,
        checkpoint_every_n_steps=args.every,
        stall_timeout_s=args.stall,
        callbacks=[Freeze(args.freeze, args.out)],
    )
    progress = trainer.fit(
        model(),
        data(),
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        ckpt_path="auto",
    )
    state = trainer.full_state_dict()
    if trainer.is_global_zero:
        torch.save(state, args.out)
        with open(args.out + ".json", "w") as f:
            json.dump({"history": [o.as_dict() for o in progress.history]}, f)


if __name__ == "__main__":
    main()
