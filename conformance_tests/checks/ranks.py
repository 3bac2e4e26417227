"""Rank consistency: every rank of a world recorded the same as rank 0, and counted honestly.

Per rank: status, hook sequence, per-step numbers, final canonical state, checkpoint buffers,
the optimizer the user's factory built really stepped once per counted optimizer step (never
on a skipped one), the scheduler's ``last_epoch`` equal to the counted scheduler steps; and the
grad norm given to ``unison_on_before_optimizer_step`` equal to the reported one.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from unison.conformance.checks.numeric import Checker, state_deviation


def check_rank_consistency(c: Checker, label: str, trace: dict[str, Any]) -> None:
    """Every rank of ``trace`` (rank 0's, with ``ranks``) against rank 0; the hooks' grad norm against the step's."""
    ranks = trace.get("ranks") or [trace]
    for r, rt in enumerate(ranks):
        if rt.get("status") != "ok":
            c.fail(label, f"rank {r} status", expected="ok", got=rt.get("status"), kind="rank")
            continue
        if rt.get("hooks") != trace.get("hooks"):
            c.fail(label, f"hook sequence on rank {r}", note="differs from rank 0's", kind="rank")
        if not same_steps(rt.get("steps"), trace.get("steps")):
            c.fail(
                label,
                f"per-step numbers on rank {r}",
                kind="rank",
                note="differ from rank 0's (must be identical on every rank)",
            )
        _check_rank_state(c, label, r, rt, trace)
        _check_rank_counts(c, label, r, rt)
    for s in trace.get("steps", []):
        hn = s.get("hook_grad_norm")
        if hn is None or not ((math.isnan(hn) and math.isnan(s["grad_norm"])) or hn == s["grad_norm"]):
            c.fail(
                label,
                "grad norm given to unison_on_before_optimizer_step",
                step=s["step"],
                expected=s["grad_norm"],
                got=hn,
                kind="hooks",
            )


def _check_rank_state(c: Checker, label: str, r: int, rt: dict[str, Any], trace: dict[str, Any]) -> None:
    """Rank ``r``'s final canonical state and checkpoint buffers equal rank 0's."""
    if r > 0 and rt.get("state") is not None and trace.get("state") is not None:
        name, dev = state_deviation(rt["state"], trace["state"])
        if dev > c.tol.param:
            c.fail(
                label,
                f"final state on rank {r}",
                deviation=dev,
                tolerance=c.tol.param,
                kind="rank",
                note=f"rank {r}'s canonical state differs from rank 0's (worst: {name!r}): replicas ended apart",
            )
    if r > 0 and rt.get("buffer_snapshots") and trace.get("buffer_snapshots"):
        for done, snap in sorted(rt["buffer_snapshots"].items()):
            name, dev = state_deviation(snap, trace["buffer_snapshots"].get(done, {}))
            ints_differ = any(
                not v.is_floating_point() and not torch.equal(v, trace["buffer_snapshots"].get(done, {}).get(k, v))
                for k, v in snap.items()
            )
            if dev > c.tol.param or ints_differ:
                c.fail(
                    label,
                    f"buffers at checkpoint on rank {r}",
                    step=done - 1,
                    kind="rank",
                    deviation=dev,
                    tolerance=c.tol.param,
                    note=f"rank {r}'s buffers differ from rank 0's (worst: {name!r})",
                )


def _check_rank_counts(c: Checker, label: str, r: int, rt: dict[str, Any]) -> None:
    """Rank ``r``'s optimizer really stepped once per counted step, never on a skipped one; scheduler in step."""
    counts = rt.get("counts") or {}
    done = counts.get("optimizer_steps", 0) - counts.get("optimizer_steps_at_start", 0)
    if counts.get("optimizers_built", 1) == 0:
        c.fail(
            label,
            f"optimizer on rank {r}",
            expected="built by the user's optimizer factory",
            got="the factory was never called",
            kind="counts",
        )
    elif counts.get("optimizer_updates_observed") != done:
        c.fail(
            label,
            f"real optimizer updates on rank {r}",
            expected=done,
            got=counts.get("optimizer_updates_observed"),
            kind="counts",
            note="optimizer steps in which the optimizer built by the user's factory was stepped, "
            "vs the trainer's count",
        )
    for s in rt.get("steps") or []:
        if s["skipped"] and s.get("optimizer_step_calls"):
            c.fail(
                label,
                f"optimizer stepped on a skipped step on rank {r}",
                step=s["step"],
                expected=0,
                got=s["optimizer_step_calls"],
                kind="counts",
            )
    last_epoch = counts.get("scheduler_last_epoch")
    if last_epoch is not None and last_epoch != counts.get("scheduler_steps"):
        c.fail(
            label,
            f"scheduler steps on rank {r}",
            expected=counts.get("scheduler_steps"),
            got=last_epoch,
            note="the scheduler's last_epoch vs the trainer's count",
            kind="counts",
        )


def same_steps(a: Any, b: Any) -> bool:
    """Exact equality of per-step records, where nan equals nan (skipped fp16 steps)."""

    def norm(x: Any) -> Any:
        if isinstance(x, float) and math.isnan(x):
            return "nan"
        if isinstance(x, dict):
            # How often an engine calls step() per update is its own business.
            return {k: norm(v) for k, v in x.items() if k != "optimizer_step_calls"}
        if isinstance(x, list):
            return [norm(v) for v in x]
        return x

    return norm(a) == norm(b)
