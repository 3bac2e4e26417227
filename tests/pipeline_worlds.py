"""What the spawned pipeline worlds run for tests/test_pipeline.py: every scenario in one process group."""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from helpers import train


def _shared_dir(prefix: str) -> str:
    root = [tempfile.mkdtemp(prefix=prefix) if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(root)
    return root[0]


def probe(schedule: str) -> dict[str, Any]:
    return train("pipeline", strategy_options={"schedule": schedule})
