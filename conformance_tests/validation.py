"""Validation: ``val/loss`` must be the per-sample mean over every replica, at every validation.

The ``validation`` scenario validates every :data:`VAL_EVERY` steps on
:data:`VAL_SIZE` samples in batches of :data:`VAL_BATCH_SIZE` per replica. The
last chunk is short and splits unevenly over the replicas, several samples on
each: 3 + 2 at world size 2, 2 + 1 + 1 + 1 at world size 4 (3 + 3 + 2 at 3, a
short batch of 2 in one process); :func:`last_chunk_split` says which. A
one-sample last chunk would not do: every other replica runs a zero-weight
stand-in of that same sample, so a mean that weights replicas (or batches)
instead of samples lands on the same number (measured: 19.4992651 vs
19.4992650 for a strategy averaging each batch's loss over replicas).

The samples of the short chunk have targets offset by :data:`LAST_CHUNK_OFFSET`
times their position in it: the replicas holding fewer of them hold the larger
losses, so any mean other than the per-sample one (each replica's mean
averaged, each batch's mean averaged over replicas, the short batch dropped or
counted as a full one) moves ``val/loss`` by percents, against a relative
tolerance of 1e-5 in fp32 (the suite's broken strategies ``per_rank_val_mean``
and ``batch_mean_over_replicas`` show the margins).

The suite records every ``unison_on_validation_end`` (step and ``val/loss``)
as the trace's ``validations``; :func:`check_validations` compares them with
the reference twin's, step by step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import TensorDataset

VAL_EVERY = 2
VAL_BATCH_SIZE = 3
#: One full chunk of 12 (3 per replica at world 4) and 5 samples: a short last batch at world 1, 2, 3 and 4,
#: split unevenly over the replicas at 2, 3 and 4 with no zero-weight stand-in.
VAL_SIZE = 17
#: How far apart the targets of the short last chunk's samples are (times their position in it).
LAST_CHUNK_OFFSET = 4.0


def last_chunk_split(replicas: int) -> list[int]:
    """How many samples of the last validation chunk each replica holds (the trainer's split)."""
    from unison.data.plan import validation_slices

    last = VAL_SIZE % (VAL_BATCH_SIZE * replicas) or VAL_BATCH_SIZE * replicas
    return [validation_slices(last, replicas, rank)[1] for rank in range(replicas)]


def validation_data() -> TensorDataset:
    """Held-out regression samples (another seed than the training data), per-sample losses far apart."""
    from unison.conformance.data import regression_data

    x, y = regression_data(VAL_SIZE, seed=321).tensors
    # Targets spread over a wide range, so per-replica means differ; the short last chunk rising by
    # position, so the replicas with fewer of its samples hold the larger losses (see the module docstring).
    y = y * 3.0
    last = VAL_SIZE % (VAL_BATCH_SIZE * 4)
    y[-last:] += LAST_CHUNK_OFFSET * torch.arange(1, last + 1, dtype=y.dtype).unsqueeze(1)
    return TensorDataset(x, y)


def check_validations(c: Any, label: str, trace: dict[str, Any], twin: dict[str, Any], against: str) -> None:
    """Every validation of ``trace`` equals the twin's: same steps, ``val/loss`` within the loss tolerance."""
    got, want = trace.get("validations") or [], twin.get("validations") or []
    if [v["step"] for v in got] != [v["step"] for v in want]:
        c.fail(
            label,
            "validation steps",
            expected=[v["step"] for v in want],
            got=[v["step"] for v in got],
            against=against,
            kind="validation",
        )
        return
    tol = c.tol.loss
    replicas = int(trace.get("data_parallel_size") or 1)
    if replicas > 1:
        split = last_chunk_split(replicas)
        c.checks.append(
            f"premise: the last validation chunk splits {'+'.join(map(str, split))} over {replicas} replicas"
            + (" (unevenly: only a per-sample mean matches)" if len(set(split)) > 1 and min(split) > 0 else "")
        )
    for g, w in zip(got, want):
        c.close(label, against, "val/loss", g["step"], g["loss"], w["loss"], tol, "validation", track_loss=True)
    if got:
        c.checks.append(f"{label}: val/loss at steps {[v['step'] for v in got]} equals {against}'s (rel {tol:g})")


__all__ = [
    "LAST_CHUNK_OFFSET",
    "VAL_BATCH_SIZE",
    "VAL_EVERY",
    "VAL_SIZE",
    "check_validations",
    "last_chunk_split",
    "validation_data",
]
