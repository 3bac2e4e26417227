"""What the diagnosis rules read: one failed scenario's divergences, traces and derived views.

The derived views (divergences by kind, the first grad-norm ratio, the runs
that only diverge after a resume...) are computed once, on first use, and
shared by every rule that reads them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from unison.conformance.models import build_model
from unison.conformance.spec import Run, Scenario
from unison.conformance.verdict import Divergence

#: Relative agreement for a grad-norm ratio to match a pattern (well above
#: fp32 and bf16 noise, far below the gap between 1/2, 1/4, 2 and 4).
RATIO_MATCH = 0.05

#: What a rule finds: the diagnosis rule's name, the divergence where it first
#: shows, and the explanation from the recorded numbers.
Finding = tuple[str, Divergence, str]


def run_of(scenario: Scenario, label: str) -> Run | None:
    """The run a ``backend:run_id`` label names, or ``None``."""
    backend, _, run_id = label.partition(":")
    return next((r for r in scenario.runs if r.backend == backend and r.id == run_id), None)


def first_step(run: Run | None, trace: dict[str, Any] | None) -> int:
    """The first optimizer step a run recorded (``-1`` for a resumed run that recorded none)."""
    steps = (trace or {}).get("steps") or []
    if steps:
        return min(s["step"] for s in steps)
    return 0 if run is None or run.resume_from is None else -1


def close(a: float, b: float) -> bool:
    """``a`` within :data:`RATIO_MATCH` of ``b`` (relative to ``b``)."""
    return abs(a - b) <= RATIO_MATCH * abs(b)


@dataclass
class Evidence:
    """One failed scenario: its divergences (earliest step first), the strategy's result and the reference."""

    scenario: Scenario
    divergences: Sequence[Divergence]
    #: The strategy's :class:`~unison.conformance.suite.StrategyResult`, or ``None``.
    result: Any
    reference: dict[str, dict[str, dict[str, Any]]]

    @cached_property
    def by_kind(self) -> dict[str, list[Divergence]]:
        out: dict[str, list[Divergence]] = {}
        for d in self.divergences:
            out.setdefault(d.kind, []).append(d)
        return out

    @property
    def first(self) -> Divergence:
        return self.divergences[0]

    @cached_property
    def strat(self) -> dict[str, dict[str, Any]]:
        """The strategy's traces of this scenario, by run id."""
        return self.result.traces.get(self.scenario.name, {}) if self.result is not None else {}

    def trace_of(self, label: str) -> dict[str, Any] | None:
        """The trace of a ``backend:run_id`` label (reference runs: the strategy's suite's first)."""
        backend, _, run_id = label.partition(":")
        if backend == "strategy":
            return self.strat.get(run_id)
        if self.result is not None:
            t = self.result.reference_traces.get(self.scenario.name, {}).get(run_id)
            if t is not None:
                return t
        return self.reference.get(self.scenario.name, {}).get(run_id)

    def start_of(self, label: str) -> int:
        """The first optimizer step the run ``label`` recorded."""
        return first_step(run_of(self.scenario, label), self.trace_of(label))

    @cached_property
    def losses(self) -> list[Divergence]:
        return [d for d in self.divergences if d.kind == "loss"]

    @cached_property
    def norms(self) -> list[Divergence]:
        return [d for d in self.divergences if d.kind == "grad_norm"]

    @cached_property
    def numeric(self) -> list[Divergence]:
        return [d for d in self.divergences if d.kind in ("loss", "grad_norm", "lr", "state", "buffer", "skipped")]

    @cached_property
    def resumed_divergence(self) -> Divergence | None:
        """When only runs that resume a checkpoint diverge: the earliest of their divergences."""
        failing = {d.run for d in self.divergences if d.kind not in ("rank",)}
        runs = [run_of(self.scenario, label) for label in failing]
        if not runs or not all(r is not None and r.resume_from is not None for r in runs):
            return None
        return min(
            (x for x in self.divergences if x.run in failing), key=lambda x: math.inf if x.step is None else x.step
        )

    @cached_property
    def first_step_losses(self) -> list[tuple[Divergence, Run]]:
        """Loss divergences at the first step of a run that starts from scratch."""
        out = []
        for d in self.losses:
            run = run_of(self.scenario, d.run)
            if run is not None and run.resume_from is None and d.step == self.start_of(d.run):
                out.append((d, run))
        return out

    @cached_property
    def first_norm_ratio(self) -> tuple[Divergence, float] | None:
        """The first grad-norm divergence and its ratio strategy / reference, when no loss differed before it."""
        if not self.norms:
            return None
        d = self.norms[0]
        earlier_loss = [
            x for x in self.losses if x.run == d.run and x.step is not None and d.step is not None and x.step < d.step
        ]
        if earlier_loss or not isinstance(d.got, float) or not isinstance(d.expected, float) or not d.expected:
            return None
        return d, d.got / d.expected

    @cached_property
    def stale_buffers(self) -> str | None:
        """Why the strategy's buffers look never updated (equal to the initial ones at a checkpoint), or ``None``."""
        initial = dict(build_model(self.scenario.model).named_buffers())
        if not initial:
            return None
        for run_id, trace in self.strat.items():
            for done, snapshot in sorted((trace.get("buffer_snapshots") or {}).items()):
                same = [
                    n
                    for n, v in snapshot.items()
                    if n in initial
                    and v.shape == initial[n].shape
                    and bool((v.double() - initial[n].double()).abs().max() == 0)
                ]
                if same and len(same) == len(snapshot):
                    return (
                        f"after {done} optimizer steps strategy:{run_id}'s buffers ({', '.join(same)}) still hold "
                        "their initial values: buffer updates made in the forward are lost (a copy of the module or "
                        "of its buffers ran the forward, or buffers are reset / re-broadcast from a stale copy)"
                    )
        return None


__all__ = ["RATIO_MATCH", "Evidence", "Finding", "close", "first_step", "run_of"]
