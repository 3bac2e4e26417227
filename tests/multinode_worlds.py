"""What every worker of the multi-node tests runs (started by torchrun agents acting as nodes).

``multinode_worlds.py OUT STRATEGY[,STRATEGY...]``: joins the world torchrun
formed (``env://``), trains each strategy on the same tiny run as
:func:`reference`, and rank 0 writes each final state and the world's shape
to ``OUT`` (``torch.save``).
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import sys
from typing import Any

import torch
import torch.distributed as dist

from helpers import train

RUN = {
    "accumulate_grad_batches": 2,
    "global_batch_size": 16,
    "max_steps": 6,
    "grad_clip_norm": 0.5,
    "record": False,
    "progress": "off",
    "throughput": False,
}


def reference() -> dict[str, torch.Tensor]:
    """The same run in one process."""
    return train("single", **RUN)["state"]


def main(out: str, strategies: list[str]) -> None:
    # One process group for every strategy's fit (the trainer uses a group that exists).
    dist.init_process_group("gloo")
    result: dict[str, Any] = {
        "world_size": dist.get_world_size(),
        "ranks": [None] * dist.get_world_size(),
        "states": {},
    }
    # Which node each rank sits on, as torchrun told it: GROUP_RANK is the agent's (node's) rank.
    dist.all_gather_object(result["ranks"], (os.environ["GROUP_RANK"], os.environ["LOCAL_RANK"]))
    for strategy in strategies:
        result["states"][strategy] = train(strategy, **RUN)["state"]
    if dist.get_rank() == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
