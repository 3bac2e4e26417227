"""A training run that is SIGKILLed in the middle of committing a checkpoint to S3.

``python s3_kill_run.py URL STEPS KILL_STEP`` trains ``single`` with a save
every 2 steps into ``URL`` and kills itself (SIGKILL: no cleanup of any kind)
after the first object of the checkpoint of step ``KILL_STEP`` was copied to
its final prefix, i.e. mid-commit. Server address and credentials come from
the AWS variables.
"""

from __future__ import annotations

import os
import signal
import sys

from unison.checkpointing.remote_storage import FsspecStorage

from helpers import train

url, steps, kill_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
copy = FsspecStorage._copy_object


def copy_then_die(self: FsspecStorage, src: str, dst: str) -> None:
    copy(self, src, dst)
    if f"/step-{kill_step:08d}/" in dst:
        os.kill(os.getpid(), signal.SIGKILL)


FsspecStorage._copy_object = copy_then_die  # type: ignore[method-assign]  # the fault being injected
train(
    "single",
    max_steps=steps,
    checkpoint_dir=url,
    checkpoint_every_n_steps=2,
    ckpt_path="auto",
    record=False,
    progress="off",
    accumulate_grad_batches=2,
    global_batch_size=16,
    grad_clip_norm=0.5,
)
print("not killed", flush=True)
