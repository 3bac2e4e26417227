"""What the worlds of tests/test_s3_data.py run: training on sharded data read from the test S3 server.

The server's address and credentials arrive in the standard AWS variables and the shard-index cache
in ``UNISON_DATA_CACHE``, inherited from the test process (which built the indexes once).
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from shard_files import JsonlStream, decode

import unison
from unison.data.shards import ShardedDataset

from helpers import mlp

GLOBAL_BATCH, ACCUMULATE = 16, 2
STEPS, RESUME_AT = 8, 5  # 96 samples: 6 steps per epoch, so the run crosses an epoch boundary


def fit(
    data: Any,
    strategy: str,
    workers: int,
    *,
    max_steps: int | None = STEPS,
    max_epochs: int | None = None,
    checkpoint_dir: str | None = None,
    ckpt_path: str | None = None,
) -> dict[str, Any]:
    trainer = unison.Trainer(
        strategy=strategy,
        global_batch_size=GLOBAL_BATCH,
        accumulate_grad_batches=ACCUMULATE,
        num_workers=workers,
        max_steps=max_steps,
        max_epochs=max_epochs,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every_n_steps=RESUME_AT if checkpoint_dir else None,
        grad_clip_norm=1.0,
        seed=3,
        progress="off",
        throughput=False,
    )
    progress = trainer.fit(
        mlp(), data, loss_fn=torch.nn.functional.mse_loss, optimizer=torch.optim.AdamW, ckpt_path=ckpt_path
    )
    return {
        "state": trainer.full_state_dict(),
        "losses": [h.loss for h in progress.history],
        "steps": [h.step for h in progress.history],
    }


def _shared_dir() -> str:
    """A directory every rank agrees on (rank 0 makes it, the name is broadcast)."""
    dist = torch.distributed.is_initialized()
    name = [tempfile.mkdtemp(prefix="unison-shards-")] if not dist or torch.distributed.get_rank() == 0 else [None]
    if dist:
        torch.distributed.broadcast_object_list(name, src=0)
    return name[0]


def runs(strategies: list[str], pattern: str, workers: tuple[int, ...]) -> dict[str, Any]:
    """Per strategy and worker count: a full run on ``pattern``'s shards, and the same run saved at
    ``RESUME_AT`` and resumed."""
    out: dict[str, Any] = {}
    for strategy in strategies:
        for w in workers:
            out[f"{strategy}-{w}"] = fit(ShardedDataset(pattern, decode), strategy, w)
            root = _shared_dir()
            fit(ShardedDataset(pattern, decode), strategy, w, max_steps=RESUME_AT, checkpoint_dir=root)
            resumed = fit(ShardedDataset(pattern, decode), strategy, w, checkpoint_dir=root, ckpt_path="last")
            out[f"{strategy}-{w}-resumed"] = resumed
    return out


def one_pass(kind: str, pattern: str, urls: list[str], strategy: str = "ddp") -> list[int]:
    """One epoch of ``kind`` ("sharded" or "iterable") data; the steps taken."""
    data = ShardedDataset(pattern, decode) if kind == "sharded" else JsonlStream(urls)
    return fit(data, strategy, 0, max_steps=None, max_epochs=1)["steps"]
