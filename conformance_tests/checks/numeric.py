"""Numeric checks: a run's per-step numbers, buffers and final state against another run's.

A :class:`Checker` collects the divergences and the largest deviations of one scenario;
every other check module reports through it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from unison.conformance.spec import Scenario
from unison.conformance.verdict import FAIL, RELATIVE_FLOOR, Divergence, Tolerance, Verdict


def state_deviation(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[str | None, float]:
    """The floating entry with the largest max-abs difference, and that difference (shared names only)."""
    worst_name, worst = None, 0.0
    for name in sorted(set(got) & set(want)):
        a, b = got[name], want[name]
        if tuple(a.shape) != tuple(b.shape) or not a.is_floating_point() or not b.is_floating_point() or not a.numel():
            continue
        diff = (a.double() - b.double()).abs()
        dev = float(diff.max()) if bool(torch.isfinite(diff).all()) else math.inf
        if worst_name is None or dev > worst:
            worst_name, worst = name, dev
    return worst_name, worst


def run_label(backend: str, run_id: str) -> str:
    return f"{backend}:{run_id}"


class Checker:
    """Accumulates divergences and deviations for one scenario."""

    def __init__(self, scenario: Scenario, tol: Tolerance) -> None:
        self.scenario = scenario
        self.tol = tol
        self.divergences: list[Divergence] = []
        self.max_param: float | None = None
        self.max_loss: float | None = None
        self.checks: list[str] = []

    def fail(self, run: str, quantity: str, **kw: Any) -> None:
        self.divergences.append(Divergence(self.scenario.name, run, quantity, **kw))

    def close(
        self,
        run: str,
        against: str,
        quantity: str,
        step: int | None,
        a: float,
        b: float,
        tol: float,
        kind: str,
        track_loss: bool = False,
    ) -> None:
        if not (math.isfinite(a) and math.isfinite(b)):
            # fp16 overflow steps: both must be non-finite (nan and inf alike).
            if math.isfinite(a) != math.isfinite(b):
                self.fail(
                    run,
                    quantity,
                    step=step,
                    expected=b,
                    got=a,
                    against=against,
                    note="one is finite, the other is not",
                    kind=kind,
                )
            return
        # Relative, with a floor far below every scenario's losses and norms:
        # an absolute floor of 1 would make the check blind for small losses
        # (the fp16 scenario's are ~1e-2).
        dev = abs(a - b) / max(abs(b), RELATIVE_FLOOR)
        if track_loss:
            self.max_loss = dev if self.max_loss is None else max(self.max_loss, dev)
        if dev > tol:
            self.fail(
                run, quantity, step=step, expected=b, got=a, deviation=dev, tolerance=tol, against=against, kind=kind
            )

    def steps(self, run: str, trace: dict[str, Any], ref: dict[str, Any], against: str, *, exact_range: bool) -> None:
        """Per-step numbers of ``trace`` against ``ref``, matched by step index."""
        got = {s["step"]: s for s in trace.get("steps", [])}
        want = {s["step"]: s for s in ref.get("steps", [])}
        if exact_range and sorted(got) != sorted(want):
            self.fail(run, "steps run", expected=sorted(want), got=sorted(got), against=against, kind="counts")
        if not got:
            self.fail(run, "steps run", expected="at least one step", got=[], against=against, kind="counts")
        for step in sorted(got):
            a = got[step]
            if step not in want:
                if not exact_range:
                    self.fail(
                        run,
                        "steps run",
                        step=step,
                        against=against,
                        note="the reference has no such step",
                        kind="counts",
                    )
                continue
            b = want[step]
            if a["skipped"] != b["skipped"]:
                self.fail(
                    run, "skipped", step=step, expected=b["skipped"], got=a["skipped"], against=against, kind="skipped"
                )
            self.close(run, against, "loss", step, a["loss"], b["loss"], self.tol.loss, "loss", track_loss=True)
            if len(a["micro_losses"]) != len(b["micro_losses"]):
                self.fail(
                    run,
                    "micro-batch count",
                    step=step,
                    expected=len(b["micro_losses"]),
                    got=len(a["micro_losses"]),
                    against=against,
                    kind="counts",
                )
            else:
                for i, (x, y) in enumerate(zip(a["micro_losses"], b["micro_losses"])):
                    self.close(run, against, f"micro-batch {i} loss", step, x, y, self.tol.loss, "loss")
            self.close(run, against, "grad_norm", step, a["grad_norm"], b["grad_norm"], self.tol.grad_norm, "grad_norm")
            if len(a["lrs"]) != len(b["lrs"]):
                self.fail(
                    run,
                    "parameter groups",
                    step=step,
                    expected=len(b["lrs"]),
                    got=len(a["lrs"]),
                    against=against,
                    kind="lr",
                )
            else:
                for g, (x, y) in enumerate(zip(a["lrs"], b["lrs"])):
                    self.close(run, against, f"lr (group {g})", step, x, y, self.tol.lr, "lr")

    def state(
        self,
        run: str,
        got: dict[str, torch.Tensor] | None,
        want: dict[str, torch.Tensor] | None,
        against: str,
        *,
        track: bool = True,
        buffers: Iterable[str] = (),
    ) -> None:
        """Final canonical state dicts: same names, shapes and values within ``tol.param``."""
        if got is None or want is None:
            self.fail(run, "final state", against=against, note="missing (the run produced no state)", kind="state")
            return
        buffers = set(buffers)
        if set(got) != set(want):
            missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
            self.fail(
                run,
                "state_dict keys",
                expected=f"missing {missing}",
                got=f"extra {extra}",
                against=against,
                kind="state",
            )
        worst = 0.0
        for name in sorted(set(got) & set(want)):
            a, b = got[name], want[name]
            what = "buffer" if name in buffers else "parameter"
            kind = "buffer" if name in buffers else "state"
            if tuple(a.shape) != tuple(b.shape):
                self.fail(
                    run,
                    f"state[{name!r}] shape",
                    expected=tuple(b.shape),
                    got=tuple(a.shape),
                    against=against,
                    kind=kind,
                )
                continue
            if a.is_floating_point() != b.is_floating_point():
                self.fail(
                    run, f"state[{name!r}] dtype", expected=str(b.dtype), got=str(a.dtype), against=against, kind=kind
                )
                continue
            if not a.is_floating_point():
                if not torch.equal(a, b):
                    self.fail(
                        run, f"final {what} {name!r}", expected=b.tolist(), got=a.tolist(), against=against, kind=kind
                    )
                continue
            if a.numel() == 0:
                continue
            diff = (a.double() - b.double()).abs()
            dev = float(diff.max()) if bool(torch.isfinite(diff).all()) else math.inf
            worst = max(worst, dev)
            if dev > self.tol.param:
                self.fail(
                    run,
                    f"final {what} {name!r}",
                    deviation=dev,
                    tolerance=self.tol.param,
                    against=against,
                    note="max abs difference of the canonical (fp32) state",
                    kind=kind,
                )
        if track:
            self.max_param = worst if self.max_param is None else max(self.max_param, worst)

    def buffer_snapshots(
        self,
        run: str,
        got: dict[int, dict[str, torch.Tensor]] | None,
        want: dict[int, dict[str, torch.Tensor]] | None,
        against: str,
    ) -> None:
        """Canonical buffers at every checkpoint both runs wrote (keyed by steps done)."""
        if not want:
            return
        got = got or {}
        for done in sorted(want):
            if done not in got:
                self.fail(
                    run,
                    "buffers at checkpoint",
                    step=done - 1,
                    expected=f"a checkpoint after {done} steps",
                    got=sorted(got),
                    against=against,
                    kind="buffer",
                )
                continue
            for name, b in want[done].items():
                a = got[done].get(name)
                if a is None:
                    self.fail(
                        run,
                        f"buffer {name!r} at checkpoint",
                        step=done - 1,
                        note="missing",
                        against=against,
                        kind="buffer",
                    )
                elif a.is_floating_point():
                    dev = float((a.double() - b.double()).abs().max()) if a.shape == b.shape else math.inf
                    if dev > self.tol.param:
                        self.fail(
                            run,
                            f"buffer {name!r} at checkpoint",
                            step=done - 1,
                            deviation=dev,
                            tolerance=self.tol.param,
                            against=against,
                            kind="buffer",
                            note=f"canonical buffer after {done} optimizer steps",
                        )
                elif not torch.equal(a, b):
                    self.fail(
                        run,
                        f"buffer {name!r} at checkpoint",
                        step=done - 1,
                        expected=b.tolist(),
                        got=a.tolist(),
                        against=against,
                        kind="buffer",
                        note=f"canonical buffer after {done} optimizer steps",
                    )


def finish(v: Verdict, c: Checker) -> Verdict:
    # Earliest step first (stable: checks without a step keep their order, last),
    # so the first divergence reported is where the strategy first left the reference.
    v.divergences = sorted(c.divergences, key=lambda d: math.inf if d.step is None else d.step)
    v.max_param_deviation = c.max_param
    v.max_loss_deviation = c.max_loss
    v.checks = c.checks
    if c.divergences:
        v.status = FAIL
        v.reason = c.divergences[0].message()
    return v
