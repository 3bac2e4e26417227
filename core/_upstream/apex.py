"""NVIDIA apex internals used by unison's ``apex_distributed_fused_adam`` strategy.

Verified against apex's source at commit ``6424da3b4faa6c8f062da4a48c424fff3f02d42d``
(apex is not installed on every machine, and has no release numbers to pin).

* ``DistributedFusedAdam._grad_accs``: the gradient accumulators whose hooks send
  each gradient to the optimizer's buckets (:func:`release_grad_accumulators`).
"""

from __future__ import annotations

from typing import Any

VERIFIED_COMMIT = "6424da3b4faa6c8f062da4a48c424fff3f02d42d"


def release_grad_accumulators(optimizer: Any) -> None:
    """Drop the optimizer's gradient-accumulator hooks, so the module stops feeding a dead optimizer."""
    # PRIVATE DistributedFusedAdam._grad_accs: the list that keeps its per-parameter
    # accumulator hooks alive; apex has no method to unhook them.
    grad_accs = getattr(optimizer, "_grad_accs", None)
    if isinstance(grad_accs, list):
        grad_accs.clear()


__all__ = ["VERIFIED_COMMIT", "release_grad_accumulators"]
