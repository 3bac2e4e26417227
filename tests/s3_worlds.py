"""What the 2-rank world of tests/test_s3_checkpoints.py runs: save/resume against a real S3 server.

The server's address and credentials arrive in the standard AWS variables,
inherited from the test process. DeepSpeed picks its accelerator at first
import, so ``DS_ACCELERATOR=cpu`` is set before anything imports it.
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from typing import Any

import torch

from helpers import max_abs_diff, train

#: Small and fast: 8 steps of 16 samples, accumulation 2, a scheduler; fp32.
SMALL = {
    "accumulate_grad_batches": 2,
    "global_batch_size": 16,
    "grad_clip_norm": 0.5,
    "record": False,
    "progress": "off",
    "throughput": False,
}
STEPS, HALF, EVERY, KEEP = 8, 4, 2, 2


def save_resume(strategies: list[str], url: str) -> dict[str, Any]:
    """Per strategy: an uninterrupted local run, then the same run in two halves through ``url`` (``auto``)."""
    out: dict[str, Any] = {}
    for strategy in strategies:
        full = train(strategy, max_steps=STEPS, **SMALL)
        ckpt = {
            "checkpoint_dir": f"{url}/{strategy}",
            "checkpoint_every_n_steps": EVERY,
            "keep_last_n_checkpoints": KEEP,
            "ckpt_path": "auto",
        }
        first = train(strategy, max_steps=HALF, **ckpt, **SMALL)
        resumed = train(strategy, max_steps=STEPS, **ckpt, **SMALL)
        out[strategy] = {
            "first_steps": [h["step"] for h in first["history"]],
            "resumed_steps": [h["step"] for h in resumed["history"]],
            "diff": max_abs_diff(resumed["state"], full["state"]),
            "equal": all(torch.equal(resumed["state"][k], full["state"][k]) for k in full["state"]),
            "state": resumed["state"] if torch.distributed.get_rank() == 0 else None,
        }
    return out
