"""Validation: ``val/loss`` must be the per-sample mean over every replica, at every validation.

The ``validation`` scenario validates every :data:`VAL_EVERY` steps on
:data:`VAL_SIZE` samples in batches of :data:`VAL_BATCH_SIZE` per replica: at
world size 2 and 4 the last chunk holds one sample, so every replica but rank 0
runs the zero-weight stand-in batch there, and ranks hold different numbers of
samples. A strategy whose reduction averages each replica's mean, or lets the
stand-in's loss into the mean, moves ``val/loss`` by about a percent (measured
by the suite's own broken strategies), three orders of magnitude above the
fp32 tolerance.

The suite records every ``unison_on_validation_end`` (step and ``val/loss``)
as the trace's ``validations``; :func:`check_validations` compares them with
the reference twin's, step by step.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import TensorDataset

VAL_EVERY = 2
VAL_BATCH_SIZE = 3
#: Two full chunks of 12 (3 per replica at world 4) and one sample: a short last batch at world 1, 2, 3 and 4.
VAL_SIZE = 25


def validation_data() -> TensorDataset:
    """Held-out regression samples (another seed than the training data), per-sample losses far apart."""
    from unison.conformance.data import regression_data

    x, y = regression_data(VAL_SIZE, seed=321).tensors
    # Targets spread over a wide range: per-replica means differ, so any mean
    # other than the per-sample one is far from it.
    return TensorDataset(x, y * 3.0)


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
    for g, w in zip(got, want):
        c.close(label, against, "val/loss", g["step"], g["loss"], w["loss"], tol, "validation", track_loss=True)
    if got:
        c.checks.append(f"{label}: val/loss at steps {[v['step'] for v in got]} equals {against}'s (rel {tol:g})")


__all__ = ["VAL_BATCH_SIZE", "VAL_EVERY", "VAL_SIZE", "check_validations", "validation_data"]
