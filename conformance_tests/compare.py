"""Judging traces: explicit tolerances, and declarations verified rather than trusted.

A strategy passes (*proves*) a scenario when every check below holds; every
failed check is a :class:`Divergence` naming the scenario, the run, the
quantity, the step and both values, and every failed scenario gets a
:class:`~unison.conformance.diagnose.Diagnosis` naming the likely broken rule.

What is compared (see :mod:`unison.conformance.scenarios` for the run roles):

* against the ``twin`` reference run (same shape): the hook sequence, the
  optimizer and scheduler step counts, every per-step number, the canonical
  buffers at every checkpoint and the final canonical state;
* against the ``truth`` (uninterrupted) run: per-step numbers matched by step
  index and, when both end at the same step, the final state;
* against ``same_as`` strategy runs: final state and per-step numbers
  (save -> resume equals uninterrupted);
* on every rank: the same per-step numbers, hook sequence, final canonical
  state and checkpoint buffers as rank 0 (replicas that end apart fail); the
  optimizer the user's factory built was really stepped in every counted
  optimizer step and in no skipped one; the scheduler's ``last_epoch`` equals
  the counted scheduler steps; the grad norm given to
  ``unison_on_before_optimizer_step`` is the one reported for the step;
* declarations: trainer-owned accumulation synchronises gradients as its
  :class:`~unison.contract.ownership.GradSync` says: ``boundary``: no gradient
  all-reduce or reduce-scatter inside ``no_sync()`` or in any micro-step but
  the last, and as many gradient collectives per optimizer step as the same
  model without accumulation (``same_sync_as``); ``every-micro-step``: no
  ``no_sync()`` entered and, at every micro-step, as many gradient collectives
  as one optimizer step without accumulation. Engine-owned accumulation answers
  ``is_accumulation_boundary()`` exactly at the last micro-step; a declared
  reshardable state_dict resumes at another world size (the ``reshard``
  scenario); a declared-unsupported precision is refused with a
  ConfigurationError naming it before any process group, and a
  declared-supported one is accepted.

Refusals. A run refused before ``fit`` starts the process group (the runner's
``refused`` status) is *declared out* only when the run needs something the
strategy's declaration refuses: a :class:`~unison.contract.ownership.Feature`, a
precision, or the world size (:func:`~unison.conformance.scenarios.needs`).
Any other refusal is a failure, "refused X although it declares it
supported". A run that fails after setup started is an error, never a refusal.

Tolerances (:data:`TOLERANCES`) are ceilings per precision, measured on torch
2.13 CPU/gloo with ``ddp`` at world size 2 against ``single``:

========== ============ ========== =============== ===============================
precision  param (abs)  loss (rel) grad norm (rel) measured: ddp, world 2, 6 steps
========== ============ ========== =============== ===============================
32-true    1e-5         1e-5       1e-5            param 6e-8, loss 1.9e-7, norm 1e-7
bf16-mixed 5e-3         1e-2       1e-2            param 1.3e-4, loss 2.1e-3, norm 8.9e-4
16-mixed   1e-3         2e-3       2e-3            param 2.2e-5, loss 3.9e-4, norm 2.5e-4
bf16-true  5e-2         5e-2       5e-2            (no scenario; for precision plugins)
========== ============ ========== =============== ===============================

Why bf16 is looser: autocast rounds every matmul output to 8 mantissa bits
(relative step 2**-8 = 3.9e-3; losses are compared per micro-batch too, the
2.1e-3 above). A data-parallel rank multiplies half of the
micro-batch, so its weight gradient is a bf16 sum over fewer rows and rounds
differently from the reference's single product; AdamW then turns a one-ulp
gradient difference into up to an lr-sized parameter difference (lr = 1e-2).
The ceilings are about 2.5 bf16 ulps for the loss and norm (2**-8 each) and
roughly 40x the measured parameter deviation, leaving room for engines that
keep bf16 parameters with fp32 master weights instead of autocast. fp16 has 11
mantissa bits (4.9e-4), hence the tighter ceilings; its per-rank activation
gradients are also larger than the reference's (each rank's loss is a mean
over fewer samples) but never overflow in the scenario (its premise). The fp32 ceiling
is the one the product promises; it is never loosened.

A ceiling only proves something if the effect it guards is far larger: every
precision scenario measures, in the same run, how far its reference ends from an
fp32 control run, and is ``inconclusive`` (not proven) when that effect is below
10x the ceiling; probes check the dtypes the strategy computes and updates in
(:mod:`unison.conformance.sensitivity`). On the ``bf16_mixed`` scenario (targets
near 128, where bf16 rounds every prediction to a whole number) bf16 moves the
reference 8.1e-2 from fp32 (16x the parameter ceiling; 27x the loss ceiling)
while ``ddp`` ends 3.2e-4 from the bf16 reference.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from unison.conformance.runner import StrategyResult
from unison.conformance.scenarios import Run, Scenario, build_model, needs
from unison.conformance.validation import check_validations
from unison.contract.ownership import AccumulationOwner, Feature, GradSync, WorldSizes

#: Denominator floor of the relative comparisons.
RELATIVE_FLOOR = 1e-3

#: Verdict statuses. ``declared_out``: the strategy refused the scenario and its
#: declaration says it refuses something the scenario needs. ``inconclusive``: every
#: check held, but the scenario cannot see what it exists to see (its effect is
#: below 10x its tolerance, :mod:`unison.conformance.sensitivity`): not proven.
PASS, FAIL, DECLARED_OUT, SKIPPED = "pass", "fail", "declared_out", "skipped"
INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class Tolerance:
    """Ceilings for one precision: ``|a - b| <= tol * max(|b|, 1e-3)``, except ``param`` (absolute)."""

    #: Max abs difference of any floating tensor of the canonical state.
    param: float
    #: Per-step loss and every micro-batch loss.
    loss: float
    #: Per-step global grad norm.
    grad_norm: float
    #: Learning rates are computed, not measured: they must agree to round-off.
    lr: float = 1e-9


TOLERANCES: dict[str, Tolerance] = {
    "32-true": Tolerance(param=1e-5, loss=1e-5, grad_norm=1e-5),
    "bf16-mixed": Tolerance(param=5e-3, loss=1e-2, grad_norm=1e-2),
    "16-mixed": Tolerance(param=1e-3, loss=2e-3, grad_norm=2e-3),
    "bf16-true": Tolerance(param=5e-2, loss=5e-2, grad_norm=5e-2),
}


def tolerance_for(precision: str) -> Tolerance:
    try:
        return TOLERANCES[precision]
    except KeyError:
        raise KeyError(f"no tolerance is defined for precision {precision!r}; known: {sorted(TOLERANCES)}") from None


# --------------------------------------------------------------------------- #
# Results
# --------------------------------------------------------------------------- #


@dataclass
class Divergence:
    """One failed check.

    ``kind`` classifies it for the diagnosis: ``loss``, ``grad_norm``, ``lr``,
    ``skipped``, ``state``, ``buffer``, ``hooks``, ``counts``, ``rank``
    (ranks disagree), ``sync`` (gradient collectives vs the declaration),
    ``boundary``, ``refusal`` (undeclared), ``run`` (an error), ``premise``,
    ``declaration``, ``precision`` (a probe saw another dtype than the precision
    declared) or ``other``.
    """

    scenario: str
    run: str
    quantity: str
    step: int | None = None
    expected: Any = None
    got: Any = None
    deviation: float | None = None
    tolerance: float | None = None
    against: str | None = None
    note: str | None = None
    kind: str = "other"

    def message(self) -> str:
        where = f"scenario {self.scenario!r}, run {self.run}"
        if self.against:
            where += f" vs {self.against}"
        what = f"{self.quantity}"
        if self.step is not None:
            what += f" at step {self.step}"
        parts = [f"{where}: {what}"]
        if self.expected is not None or self.got is not None:
            parts.append(f"expected {_fmt(self.expected)}, got {_fmt(self.got)}")
        if self.deviation is not None and self.tolerance is not None:
            parts.append(f"|diff| {self.deviation:.3g} > tolerance {self.tolerance:.3g}")
        if self.note:
            parts.append(self.note)
        return ": ".join(parts[:2]) + ("; " + "; ".join(parts[2:]) if len(parts) > 2 else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "run": self.run,
            "quantity": self.quantity,
            "step": self.step,
            "expected": _plain(self.expected),
            "got": _plain(self.got),
            "deviation": self.deviation,
            "tolerance": self.tolerance,
            "against": self.against,
            "note": self.note,
            "kind": self.kind,
            "message": self.message(),
        }


@dataclass
class Verdict:
    """The outcome of one scenario for one strategy."""

    scenario: str
    strategy: str
    #: ``"pass"`` (proven), ``"fail"``, ``"declared_out"`` (refused, and the
    #: declaration says so; with the reason) or ``"skipped"`` (the strategy is
    #: unavailable here).
    status: str
    reason: str | None = None
    divergences: list[Divergence] = field(default_factory=list)
    #: Largest |parameter difference| against any reference run compared.
    max_param_deviation: float | None = None
    #: Largest relative loss difference against any reference run compared.
    max_loss_deviation: float | None = None
    #: What was verified, in words (shown in the HTML report).
    checks: list[str] = field(default_factory=list)
    #: Gradient collectives per optimizer step on rank 0 (trainer-owned accumulation).
    gradient_sync_per_step: list[int] | None = None
    #: For a failed scenario: the first divergence and the likely broken rule.
    diagnosis: Any = None
    #: The precision the scenario trains in (its tolerances).
    precision: str | None = None
    #: A precision scenario's effect (reference vs its fp32 control) over its tolerance
    #: (:class:`~unison.conformance.sensitivity.Sensitivity`), as a dict.
    sensitivity: dict[str, Any] | None = None

    @property
    def passed(self) -> bool:
        return self.status == PASS

    @property
    def deviation_ratio(self) -> float | None:
        """A proven scenario's largest measured deviation over its tolerance (parameters and losses; the
        smaller, the further inside the tolerance), or ``None`` when nothing numeric was compared."""
        tol = TOLERANCES.get(self.precision or "32-true")
        if self.status != PASS or tol is None:
            return None
        ratios = []
        if self.max_param_deviation is not None:
            ratios.append(self.max_param_deviation / tol.param)
        if self.max_loss_deviation is not None:
            ratios.append(self.max_loss_deviation / tol.loss)
        return max(ratios) if ratios else None

    @property
    def margin(self) -> float | None:
        """A failed scenario's first numeric divergence over its tolerance (how far outside it the deciding
        check fell), or ``None`` when the failure is not numeric (a refusal, an error, a hook sequence)."""
        if self.status != FAIL:
            return None
        for d in self.divergences:
            if d.deviation is not None and d.tolerance:
                return d.deviation / d.tolerance
        return None

    def summary(self) -> str:
        if self.status == PASS:
            dev = "" if self.max_param_deviation is None else f" (max |dθ| {self.max_param_deviation:.1e})"
            return "pass" + dev
        if self.status == FAIL:
            text = "FAIL: " + (self.divergences[0].message() if self.divergences else (self.reason or "?"))
            if self.diagnosis is not None:
                text += f" [likely: {self.diagnosis.title}]"
            return text
        return f"{status_label(self.status)}: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "strategy": self.strategy,
            "status": self.status,
            "reason": self.reason,
            "max_param_deviation": self.max_param_deviation,
            "max_loss_deviation": self.max_loss_deviation,
            "divergences": [d.to_dict() for d in self.divergences],
            "checks": self.checks,
            "gradient_sync_per_step": self.gradient_sync_per_step,
            "diagnosis": self.diagnosis.to_dict() if self.diagnosis is not None else None,
            "deviation_ratio": self.deviation_ratio,
            "margin": self.margin,
            "sensitivity": self.sensitivity,
            "summary": self.summary(),
        }


def status_label(status: str) -> str:
    """How a status reads in tables: ``declared_out`` -> ``declared out``."""
    return {DECLARED_OUT: "declared out"}.get(status, status)


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list) and len(value) > 12:
        return f"[{', '.join(map(str, value[:12]))}, ... ({len(value)} items)]"
    return str(value)


# --------------------------------------------------------------------------- #
# Primitive comparisons
# --------------------------------------------------------------------------- #


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


class _Checker:
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

    def _close(
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
            self._close(run, against, "loss", step, a["loss"], b["loss"], self.tol.loss, "loss", track_loss=True)
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
                    self._close(run, against, f"micro-batch {i} loss", step, x, y, self.tol.loss, "loss")
            self._close(
                run, against, "grad_norm", step, a["grad_norm"], b["grad_norm"], self.tol.grad_norm, "grad_norm"
            )
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
                    self._close(run, against, f"lr (group {g})", step, x, y, self.tol.lr, "lr")

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


# --------------------------------------------------------------------------- #
# Scenario judgement
# --------------------------------------------------------------------------- #


def _label(backend: str, run_id: str) -> str:
    return f"{backend}:{run_id}"


_EXCEPTION_LINE = re.compile(r"^[\w.]+(Exception|Error|Exit|Interrupt|Warning)\b.*")


def _error_line(trace: dict[str, Any]) -> str:
    """The error's last line; with the outermost exception first when it wraps another
    (``CheckpointException`` holds each rank's failure)."""
    text = (trace.get("error") or trace.get("reason") or "").strip()
    if not text:
        return "unknown error"
    last = text.splitlines()[-1]
    raised = [line for line in text.splitlines() if _EXCEPTION_LINE.match(line)]
    if raised and raised[0] != last and raised[0].split(":")[0] not in last:
        return f"{raised[0]} ... {last}"
    return last


def _buffer_names(scenario: Scenario) -> list[str]:
    return [name for name, _ in build_model(scenario.model).named_buffers()]


def _check_premises(c: _Checker, scenario: Scenario, ref_runs: dict[str, dict[str, Any]]) -> None:
    ref_first = ref_runs[scenario.runs[0].id]
    steps = ref_first.get("steps", [])
    clip = scenario.grad_clip_norm or 0.0
    if "clips" in scenario.premises:
        c.checks.append(f"premise: the reference's pre-clip norm exceeds {scenario.grad_clip_norm} at every step")
        for s in steps:
            if not s["grad_norm"] > clip:
                c.fail(
                    "reference",
                    "premise: clipping clips",
                    step=s["step"],
                    kind="premise",
                    note=f"reference grad norm {s['grad_norm']:.4g} <= clip {scenario.grad_clip_norm}",
                )
    if "straddles_clip" in scenario.premises:
        c.checks.append(
            f"premise: the reference's pre-clip norm exceeds {scenario.grad_clip_norm} at 3 steps or more and "
            "stays below it at 3 or more"
        )
        above = [s["step"] for s in steps if s["grad_norm"] > clip]
        below = [s["step"] for s in steps if s["grad_norm"] < clip]
        if len(above) < 3 or len(below) < 3:
            c.fail(
                "reference",
                "premise: clipping straddles the clip value",
                kind="premise",
                note=f"reference steps above clip {clip}: {above}, below: {below} (3 of each needed)",
            )
    if "clips" in scenario.premises or "straddles_clip" in scenario.premises:
        control = ref_runs.get("unclipped")
        if control is not None and control.get("state") is not None and ref_first.get("state") is not None:
            c.checks.append(
                "premise: the clipped reference ends far (> 100x the parameter tolerance) from its "
                "unclipped control run"
            )
            _, dev = state_deviation(ref_first["state"], control["state"])
            if dev <= 100 * c.tol.param:
                c.fail(
                    "reference",
                    "premise: clipping changes the update",
                    deviation=dev,
                    kind="premise",
                    note=f"the clipped and unclipped reference runs end {dev:.3g} apart: clipping clipped nothing",
                )
    if "overflow" in scenario.premises:
        poison = scenario.poison_step()
        c.checks.append(
            f"premise: the reference skips exactly step {poison} (fp16 overflow) and its scheduler "
            "does not advance there"
        )
        skipped = [s["step"] for s in steps if s["skipped"]]
        if skipped != [poison]:
            c.fail("reference", "premise: overflow skips one step", expected=[poison], got=skipped, kind="premise")
        counts = ref_first.get("counts", {})
        expected = len(steps) - 1
        if counts.get("optimizer_steps") != expected or counts.get("scheduler_steps") != expected:
            c.fail(
                "reference",
                "premise: skipped step not counted",
                expected=expected,
                kind="premise",
                got=(counts.get("optimizer_steps"), counts.get("scheduler_steps")),
            )
    if "buffers_change" in scenario.premises:
        c.checks.append(
            "premise: every buffer of the reference changes between consecutive checkpoints (the "
            "step counter by the micro-batches run)"
        )
        initial = dict(build_model(scenario.model).named_buffers())
        snapshots = ref_first.get("buffer_snapshots") or {}
        if len(snapshots) < 2:
            c.fail(
                "reference",
                "premise: buffers recorded at checkpoints",
                expected=">= 2 checkpoints",
                got=sorted(snapshots),
                kind="premise",
            )
        previous, prev_done = initial, 0
        for done in sorted(snapshots):
            for name, value in snapshots[done].items():
                before = previous[name]
                if value.is_floating_point():
                    moved = float((value.double() - before.double()).abs().max())
                    if moved <= 100 * c.tol.param:
                        c.fail(
                            "reference",
                            f"premise: buffer {name!r} changes",
                            step=done - 1,
                            deviation=moved,
                            kind="premise",
                            note=f"moved only {moved:.3g} since step {prev_done}",
                        )
                elif int(value) - int(before) != (done - prev_done) * scenario.accumulate_grad_batches:
                    c.fail(
                        "reference",
                        f"premise: buffer {name!r} counts forwards",
                        step=done - 1,
                        kind="premise",
                        expected=int(before) + (done - prev_done) * scenario.accumulate_grad_batches,
                        got=int(value),
                    )
            previous, prev_done = snapshots[done], done


def _check_rank_consistency(c: _Checker, label: str, trace: dict[str, Any]) -> None:
    ranks = trace.get("ranks") or [trace]
    for r, rt in enumerate(ranks):
        if rt.get("status") != "ok":
            c.fail(label, f"rank {r} status", expected="ok", got=rt.get("status"), kind="rank")
            continue
        if rt.get("hooks") != trace.get("hooks"):
            c.fail(label, f"hook sequence on rank {r}", note="differs from rank 0's", kind="rank")
        if not _same_steps(rt.get("steps"), trace.get("steps")):
            c.fail(
                label,
                f"per-step numbers on rank {r}",
                kind="rank",
                note="differ from rank 0's (must be identical on every rank)",
            )
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


#: Hooks whose number of calls depends on the world size by design: one per
#: validation batch of this replica (the reference runs more, smaller-world
#: strategies fewer, each over more samples).
_PER_REPLICA_BATCH_HOOKS = ("unison_validation_progress",)


def _comparable_hooks(hooks: list[str]) -> list[str]:
    return [h for h in hooks if h not in _PER_REPLICA_BATCH_HOOKS]


def _same_steps(a: Any, b: Any) -> bool:
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


def _check_accumulation(
    c: _Checker, scenario: Scenario, label: str, trace: dict[str, Any], data_parallel: bool
) -> None:
    owner = trace.get("accumulation_owner")
    a = scenario.accumulate_grad_batches
    n_steps = len(trace.get("steps", []))
    if owner == AccumulationOwner.ENGINE.value and a > 1:
        expected = ([False] * (a - 1) + [True]) * n_steps
        c.checks.append(f"{label}: engine boundary answered at the last of {a} micro-steps only")
        for r, rt in enumerate(trace.get("ranks") or [trace]):
            if rt.get("boundaries") != expected:
                c.fail(
                    label,
                    f"is_accumulation_boundary() on rank {r}",
                    expected=expected,
                    got=rt.get("boundaries"),
                    kind="boundary",
                )
    if owner != AccumulationOwner.TRAINER.value or not data_parallel:
        return
    sync = trace.get("accumulation_sync", GradSync.BOUNDARY.value)
    if sync == GradSync.BOUNDARY.value:
        if a > 1:
            c.checks.append(
                f"{label}: declared boundary sync: no gradient all-reduce/reduce-scatter inside "
                "no_sync() or in any micro-step but the last, on any rank"
            )
    else:
        c.checks.append(
            f"{label}: declared every-micro-step sync: no_sync() never entered, gradient collectives "
            "at every micro-step on every rank"
        )
    c.checks.append(f"{label}: at least one gradient collective per optimizer step")
    for r, rt in enumerate(trace.get("ranks") or [trace]):
        coll = rt.get("collectives")
        if not coll:
            c.fail(label, f"collective counts on rank {r}", note="not recorded", kind="sync")
            continue
        micro = coll.get("gradient_sync_per_micro_step") or []
        if sync == GradSync.BOUNDARY.value:
            if a > 1:
                expected_entries = (a - 1) * n_steps
                if coll["no_sync_entries"] != expected_entries:
                    c.fail(
                        label,
                        f"no_sync() entries on rank {r}",
                        expected=expected_entries,
                        got=coll["no_sync_entries"],
                        kind="sync",
                    )
                if coll["gradient_sync_in_no_sync"]:
                    c.fail(
                        label,
                        f"gradient collectives inside no_sync() on rank {r}",
                        expected=0,
                        got=coll["gradient_sync_in_no_sync"],
                        kind="sync",
                        note="declared GradSync.BOUNDARY: gradients must not be synchronised on non-boundary "
                        "micro-steps",
                    )
                for step, counts in enumerate(micro):
                    early = counts[:-1]
                    if any(early):
                        c.fail(
                            label,
                            f"gradient collectives before the last micro-step on rank {r}",
                            step=step,
                            expected=[0] * len(early),
                            got=early,
                            kind="sync",
                            note="declared GradSync.BOUNDARY (synchronised at the boundary only)",
                        )
                        break
        else:
            if coll["no_sync_entries"]:
                c.fail(
                    label,
                    f"no_sync() entries on rank {r}",
                    expected=0,
                    got=coll["no_sync_entries"],
                    kind="sync",
                    note="declared GradSync.EVERY_MICRO_STEP: the trainer enters no no_sync()",
                )
            for step, counts in enumerate(micro):
                if len(counts) != a or not all(counts):
                    c.fail(
                        label,
                        f"gradient collectives per micro-step on rank {r}",
                        step=step,
                        expected=f"{a} micro-steps, each >= 1",
                        got=counts,
                        kind="sync",
                        note="declared GradSync.EVERY_MICRO_STEP (synchronised at every micro-step)",
                    )
                    break
        for step, n in enumerate(coll["gradient_sync_per_step"]):
            if n < 1:
                c.fail(
                    label,
                    f"gradient collectives on rank {r}",
                    step=step,
                    expected=">= 1",
                    got=n,
                    kind="sync",
                    note="gradients were never synchronised",
                )


def declared_refusals(ownership: dict[str, Any], world_size: int) -> dict[str, str]:
    """Everything ``ownership`` (a declaration as a dict) refuses at ``world_size``: key -> reason.

    Keys are :class:`~unison.contract.ownership.Feature` values, ``"precision:NAME"``
    and ``"world_size"``, as in :func:`~unison.conformance.scenarios.needs`.
    """
    out = dict(ownership.get("refuses", {}))
    for name, support in ownership.get("precision", {}).items():
        if support["owner"] == "unsupported":
            out[f"precision:{name}"] = support["detail"]
    ws = ownership.get("world_sizes")
    if ws:
        refused = WorldSizes(**ws).refusal(world_size)
        if refused:
            out["world_size"] = refused
    return out


def judge_refusal(
    scenario: Scenario, run: Run, trace: dict[str, Any], ownership: dict[str, Any], world_size: int
) -> tuple[str | None, Divergence | None]:
    """A refused run: ``(reason, None)`` when the declaration allows it, else ``(None, failure)``."""
    refusal = trace.get("refusal") or {}
    needed = needs(scenario, run)
    needed["world_size"] = f"world size {world_size}"
    declared = declared_refusals(ownership, world_size)
    hit = {k: declared[k] for k in needed if k in declared}
    if refusal.get("option") == "optimizer":
        # A refusal of the optimizer is covered by a declared optimizer
        # restriction only, not by an unrelated declared refusal.
        hit = {k: v for k, v in hit.items() if k == Feature.ANY_OPTIMIZER.value}
    feature = refusal.get("feature")
    label = _label(run.backend, run.id)
    message = refusal.get("message") or trace.get("reason") or "?"
    if feature is not None and feature not in declared:
        return None, Divergence(
            scenario.name,
            label,
            "undeclared refusal",
            kind="refusal",
            got=message,
            note=f"refused {feature} although it declares it supported (unison.DeclaredRefusal naming a feature "
            "the declaration does not refuse)",
        )
    if hit:
        return "; ".join(f"declares {k} refused: {why}" for k, why in hit.items()), None
    what = refusal.get("option") or "the run"
    asked = ", ".join(needed)
    return None, Divergence(
        scenario.name,
        label,
        "undeclared refusal",
        kind="refusal",
        got=message,
        note=f"refused {what} although it declares it supported: its declaration refuses none of what this run "
        f"needs ({asked}); declare the refusal (Ownership.refuses, precision, world_sizes) or support it",
    )


def judge_scenario(
    scenario: Scenario,
    result: StrategyResult,
    reference: dict[str, dict[str, dict[str, Any]]],
) -> Verdict:
    """The verdict of ``scenario`` for the strategy measured in ``result``."""
    from unison.conformance import sensitivity
    from unison.conformance.diagnose import diagnose

    v = Verdict(scenario.name, result.name, PASS, precision=scenario.precision)
    if result.status == "skipped":
        v.status, v.reason = SKIPPED, result.reason
        return v
    if result.status != "ran":
        v.status, v.reason = FAIL, result.reason
        return v
    own = result.ownership or {}
    if scenario.kind == "declarations":
        return _judge_declarations(scenario, result, v)
    if scenario.requires_reshardable and not own.get("state_dict", {}).get("reshardable"):
        fmt = own.get("state_dict", {}).get("format") or "its format"
        v.status, v.reason = (
            DECLARED_OUT,
            f"declares its state_dict not reshardable ({fmt}): its checkpoints resume only at the world size "
            "and under the strategy that wrote them",
        )
        return v

    c = _Checker(scenario, tolerance_for(scenario.precision))
    ref_runs = reference.get(scenario.name, {})
    for run in scenario.runs:
        if run.backend == "reference" and not (run.resume_from or "").startswith("strategy:"):
            t = ref_runs.get(run.id)
            if t is None or t["status"] != "ok":
                c.fail(
                    _label("reference", run.id),
                    "reference run",
                    kind="premise",
                    note=f"the reference itself failed: {_error_line(t or {})}",
                )
    if c.divergences:
        return _finish(v, c)
    _check_premises(c, scenario, ref_runs)
    sens = sensitivity.measure(scenario, ref_runs, c.tol)
    if sens is not None:
        c.checks.append(sens.describe())
        v.sensitivity = sens.to_dict()

    strat = result.traces.get(scenario.name, {})
    # Refusals before training: declared out only where the declaration says
    # so. A refusal of the other world size only drops that run (the
    # checkpoint is still verified at that world size under single).
    dropped: set[str] = set()
    declared_out: list[str] = []
    for run in scenario.runs:
        t = strat.get(run.id) if run.backend == "strategy" else None
        if t is None or t["status"] != "refused":
            continue
        world = result.alt_world_size if run.world == "alt" else result.world_size
        reason, failure = judge_refusal(scenario, run, t, own, world)
        if failure is not None:
            c.divergences.append(failure)
            dropped.add(run.id)
        elif run.world == "alt":
            dropped.add(run.id)
            c.checks.append(
                f"strategy:{run.id} refused world size {world} ({reason}); the world-size change is "
                "verified under single only"
            )
        else:
            declared_out.append(f"strategy:{run.id} refused ({reason})")
            dropped.add(run.id)
    if declared_out and not c.divergences:
        v.status, v.reason = DECLARED_OUT, declared_out[0]
        v.checks = c.checks + declared_out
        return v

    buffers = _buffer_names(scenario)
    for run in scenario.runs:
        label = _label(run.backend, run.id)
        if run.backend == "strategy" and run.id in dropped:
            continue
        if run.backend == "strategy":
            t = strat.get(run.id)
            world_error = result.world_errors.get(run.world)
        else:
            if not (run.resume_from or "").startswith("strategy:"):
                # Pure reference runs: only their own resume exactness is checked.
                t = ref_runs.get(run.id)
                if run.truth is not None and t is not None:
                    _compare_to_truth(c, run, label, t, ref_runs, buffers)
                continue
            if (run.resume_from or "").split(":", 1)[1] in dropped:
                continue
            t = result.reference_traces.get(scenario.name, {}).get(run.id)
            world_error = None
        if t is None:
            c.fail(label, "run", note=f"did not execute: {world_error or 'no trace'}", kind="run")
            continue
        if t["status"] != "ok":
            c.fail(label, "run", note=f"{t['status']}: {_error_line(t)}", kind="run")
            continue
        _check_rank_consistency(c, label, t)
        if run.backend == "strategy":
            sensitivity.check_probes(c, scenario, label, t)
        data_parallel = t.get("world_size", 1) > 1
        _check_accumulation(c, scenario, label, t, data_parallel)
        if run.twin is not None:
            twin = ref_runs.get(run.twin)
            against = _label("reference", run.twin)
            if twin is None or twin["status"] != "ok":
                c.fail(label, "twin", note=f"reference run {run.twin!r} missing", kind="run")
            else:
                hooks, twin_hooks = _comparable_hooks(t["hooks"]), _comparable_hooks(twin["hooks"])
                if hooks != twin_hooks:
                    first = _first_difference(twin_hooks, hooks)
                    c.fail(
                        label,
                        "hook sequence",
                        expected=first[0],
                        got=first[1],
                        against=against,
                        kind="hooks",
                        note=f"first difference at call {first[2]}",
                    )
                for key in ("optimizer_steps", "scheduler_steps"):
                    if t["counts"][key] != twin["counts"][key]:
                        c.fail(
                            label,
                            key.replace("_", " "),
                            expected=twin["counts"][key],
                            got=t["counts"][key],
                            against=against,
                            kind="counts",
                        )
                c.steps(label, t, twin, against, exact_range=True)
                if scenario.val_every:
                    check_validations(c, label, t, twin, against)
                c.buffer_snapshots(label, t.get("buffer_snapshots"), twin.get("buffer_snapshots"), against)
                c.state(label, t.get("state"), twin.get("state"), against, buffers=buffers)
        if run.truth is not None:
            _compare_to_truth(c, run, label, t, ref_runs, buffers)
        for other in run.same_as:
            o = strat.get(other)
            against = _label("strategy", other)
            if o is None or o["status"] != "ok":
                c.fail(label, "same_as", note=f"strategy run {other!r} missing", kind="run")
                continue
            c.steps(label, t, o, against, exact_range=False)
            c.state(label, t.get("state"), o.get("state"), against, track=False, buffers=buffers)
        c.checks.append(_describe_run_checks(run))

    if scenario.same_sync_as:
        _check_same_sync(c, scenario, result)
    main = strat.get(next((r.id for r in scenario.runs if r.backend == "strategy"), ""), {})
    if main.get("collectives"):
        v.gradient_sync_per_step = main["collectives"]["gradient_sync_per_step"]
    v = _finish(v, c)
    if v.status == FAIL:
        v.diagnosis = diagnose(scenario, v.divergences, result, reference)
    elif v.status == PASS and sens is not None and not sens.conclusive:
        v.status, v.reason = INCONCLUSIVE, sens.inconclusive_reason()
    return v


def _compare_to_truth(
    c: _Checker, run: Run, label: str, t: dict[str, Any], ref_runs: dict[str, dict[str, Any]], buffers: Iterable[str]
) -> None:
    truth = ref_runs.get(run.truth or "")
    against = _label("reference", run.truth or "?")
    if truth is None or truth["status"] != "ok":
        c.fail(label, "truth", note=f"reference run {run.truth!r} missing", kind="run")
        return
    if t.get("status") != "ok":
        c.fail(label, "run", note=f"{t.get('status')}: {_error_line(t)}", kind="run")
        return
    c.steps(label, t, truth, against, exact_range=False)
    last = max((s["step"] for s in t.get("steps", [])), default=None)
    truth_last = max((s["step"] for s in truth.get("steps", [])), default=None)
    if last is not None and last == truth_last:
        c.state(label, t.get("state"), truth.get("state"), against, buffers=buffers)


def _check_same_sync(c: _Checker, scenario: Scenario, result: StrategyResult) -> None:
    other = result.traces.get(scenario.same_sync_as or "", {}).get("main")
    mine = result.traces.get(scenario.name, {}).get("main")
    if not other or not mine or other.get("status") != "ok" or mine.get("status") != "ok":
        return
    if mine.get("accumulation_owner") != AccumulationOwner.TRAINER.value or mine.get("world_size", 1) < 2:
        return
    every = mine.get("accumulation_sync") == GradSync.EVERY_MICRO_STEP.value
    if every:
        c.checks.append(
            f"gradient collectives at every micro-step equal one optimizer step of "
            f"{scenario.same_sync_as!r} (accumulation 1): a full sync per micro-step, as declared"
        )
    else:
        c.checks.append(
            f"gradient collectives per optimizer step equal those of {scenario.same_sync_as!r} "
            f"(accumulation 1): one sync per optimizer step, not per micro-step"
        )
    for r, (a, b) in enumerate(zip(mine.get("ranks") or [mine], other.get("ranks") or [other])):
        ca, cb = a.get("collectives") or {}, b.get("collectives") or {}
        gb = cb.get("gradient_sync_per_step")
        if every:
            micro = ca.get("gradient_sync_per_micro_step")
            if micro is None or gb is None:
                continue
            for step, (counts, want) in enumerate(zip(micro, gb)):
                if any(n != want for n in counts):
                    c.fail(
                        _label("strategy", "main"),
                        f"gradient collectives per micro-step on rank {r}",
                        step=step,
                        expected=[want] * len(counts),
                        got=counts,
                        against=f"scenario {scenario.same_sync_as!r}",
                        kind="sync",
                    )
                    break
            continue
        ga = ca.get("gradient_sync_per_step")
        if ga is None or gb is None:
            continue
        if ga != gb[: len(ga)]:
            step = next((i for i, (x, y) in enumerate(zip(ga, gb)) if x != y), None)
            c.fail(
                _label("strategy", "main"),
                f"gradient collectives per optimizer step on rank {r}",
                step=step,
                expected=gb[: len(ga)],
                got=ga,
                against=f"scenario {scenario.same_sync_as!r}",
                kind="sync",
            )


def _describe_run_checks(run: Run) -> str:
    parts = []
    if run.perturb:
        parts.append(f"started with perturbed {run.perturb} on every rank but 0")
    if run.twin:
        parts.append(
            f"hooks, step counts, per-step loss/lr/grad norm, checkpoint buffers and final state = reference:{run.twin}"
        )
    if run.truth:
        parts.append(f"per-step numbers and final state = reference:{run.truth} (uninterrupted)")
    if run.same_as:
        parts.append(f"final state = strategy:{', strategy:'.join(run.same_as)}")
    return f"{run.backend}:{run.id}: " + "; ".join(parts) if parts else f"{run.backend}:{run.id}: ran"


def _first_difference(a: list[str], b: list[str]) -> tuple[Any, Any, int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return x, y, i
    n = min(len(a), len(b))
    return (a[n] if n < len(a) else "(end)"), (b[n] if n < len(b) else "(end)"), n


def _finish(v: Verdict, c: _Checker) -> Verdict:
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


def _judge_declarations(scenario: Scenario, result: StrategyResult, v: Verdict) -> Verdict:
    c = _Checker(scenario, tolerance_for("32-true"))
    outcomes = result.declarations
    if not outcomes:
        c.fail("declarations", "precision declarations", note="not checked", kind="declaration")
    for o in outcomes:
        p, raised = o["precision"], o["raised"]
        label = f"Trainer(precision={p!r})"
        if o.get("world_size") not in (None, result.world_size):
            label += f" at world size {o['world_size']}"
        if o["process_group_started"]:
            c.fail(label, "process group", note="building the Trainer started a process group", kind="declaration")
        if o["declared"] == "unsupported":
            c.checks.append(f"{p}: declared unsupported ({o['detail']}): ConfigurationError at construction")
            if raised is None:
                c.fail(
                    label,
                    "declared-unsupported precision",
                    expected="ConfigurationError",
                    got="accepted",
                    kind="declaration",
                )
            elif not raised["is_configuration_error"]:
                c.fail(
                    label,
                    "declared-unsupported precision",
                    expected="ConfigurationError",
                    got=raised["type"],
                    note=raised["message"],
                    kind="declaration",
                )
            elif p not in raised["message"]:
                c.fail(
                    label, "error message", note=f"does not name the precision: {raised['message']}", kind="declaration"
                )
        else:
            c.checks.append(f"{p}: declared supported ({o['owner']}): accepted at construction")
            if raised is not None:
                c.fail(
                    label,
                    "declared-supported precision",
                    expected="accepted",
                    got=f"{raised['type']}: {raised['message']}",
                    kind="refusal",
                    note=f"refused {p} although it declares it supported",
                )
    if not c.divergences and not any(o["declared"] == "unsupported" for o in outcomes):
        v.reason = "no precision declared unsupported; every declared one is accepted"
    v = _finish(v, c)
    if v.status == FAIL:
        from unison.conformance.diagnose import diagnose

        v.diagnosis = diagnose(scenario, v.divergences, result, {})
    return v


def judge(
    result: StrategyResult, reference: dict[str, dict[str, dict[str, Any]]], scenarios: Iterable[Scenario]
) -> dict[str, Verdict]:
    """Every scenario's verdict for one strategy.

    Never raises (but on ``KeyboardInterrupt``): a comparison that cannot be
    made (a trace the suite did not expect) is that scenario's failure, named.
    """
    out = {}
    for s in scenarios:
        try:
            out[s.name] = judge_scenario(s, result, reference)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            out[s.name] = Verdict(
                s.name, result.name, FAIL, reason=f"the comparison could not be made: {type(exc).__name__}: {exc}"
            )
    return out


__all__ = [
    "DECLARED_OUT",
    "FAIL",
    "INCONCLUSIVE",
    "PASS",
    "SKIPPED",
    "TOLERANCES",
    "Divergence",
    "Tolerance",
    "Verdict",
    "declared_refusals",
    "judge",
    "judge_refusal",
    "judge_scenario",
    "state_deviation",
    "status_label",
    "tolerance_for",
]
