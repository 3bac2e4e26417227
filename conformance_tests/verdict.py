"""Verdict types: statuses, per-precision tolerances, divergences and a scenario's verdict.

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
from dataclasses import dataclass, field
from typing import Any

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


@dataclass
class Divergence:
    """One failed check.

    ``kind`` classifies it for the diagnosis: ``loss``, ``grad_norm``, ``lr``,
    ``skipped``, ``state``, ``buffer``, ``hooks``, ``counts``, ``rank``
    (ranks disagree), ``sync`` (gradient collectives vs the declaration),
    ``boundary``, ``refusal`` (undeclared), ``run`` (an error), ``premise``,
    ``declaration``, ``precision`` (a probe saw another dtype than the precision
    declared), ``feature`` (a probe saw no sign of the compile or activation
    checkpointing the run asked for) or ``other``.
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
