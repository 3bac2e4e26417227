"""Precision scenarios prove their precision: sensitivity measured in the same run, and direct probes.

A precision scenario compares a strategy with the reference trained in that
precision. That comparison can only see a strategy that ignores the precision
if the precision itself moves training much further than the tolerance allows.
So every precision scenario carries an fp32 *control run* of the reference
(:data:`~unison.conformance.scenarios.PRECISION_CONTROL`), and the suite measures,
in the same run:

* **the effect**: how far the reference in the scenario's precision ends from
  its fp32 control (max abs parameter difference, largest relative per-step
  loss difference, and whether the two skip different steps);
* **the sensitivity**: the effect over the tolerance, the larger of the
  parameter and loss ratios (infinite when the skipped steps differ: a
  categorical difference). A scenario whose sensitivity is below
  :data:`SENSITIVITY_MIN` (10) is **inconclusive**, never passed: a strategy
  that trains in fp32 instead could sit inside the tolerance.

A scenario may name a control run of its own (:attr:`Scenario.control
<unison.conformance.spec.Scenario.control>`: the reference run and what it
changes); the same measure applies to it. The ``token_loss`` scenarios' control
trains each micro-batch slice's own token mean: the reference must end far
from it, or a strategy that re-weighted tokens by the split could pass.

Direct probes (:class:`PrecisionProbe`), recorded inside every strategy run of
a scenario whose precision is ``*-mixed``, on every rank:

* the dtype of every ``torch.nn.Linear`` output seen inside forward (a
  forward hook): bf16-mixed must compute in ``bfloat16``, 16-mixed in
  ``float16``, whoever the declaration says applies it (trainer autocast,
  engine, sharding policy, plugin);
* the dtype of every parameter the optimizer built by the user's factory
  updates: mixed precision keeps fp32 master weights, so every one must be
  ``float32``. bf16 weights stepped directly lose every update smaller than
  half a bf16 spacing (2**-9 of the weight): at a small learning rate most
  weights never move.

A probe that sees another dtype fails the scenario with a
:class:`~unison.conformance.verdict.Divergence` of kind ``precision`` whose
deviation is the ratio of the two dtypes' unit roundoffs (65536 between bf16
and fp32) over a tolerance of 1 (the same dtype); the diagnosis rule is
``precision_not_applied``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from unison.conformance.scenarios import PRECISION_CONTROL
from unison.conformance.spec import FP32, Scenario

#: The smallest effect / tolerance at which a precision scenario proves anything.
SENSITIVITY_MIN = 10.0

#: The dtype a ``torch.nn.Linear`` computes in under each mixed precision.
COMPUTE_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def unit_roundoff(dtype_name: str) -> float | None:
    """``finfo(dtype).eps`` of a floating dtype named as ``str(dtype)`` (``"torch.bfloat16"``), else ``None``."""
    dtype = getattr(torch, dtype_name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return None
    return float(torch.finfo(dtype).eps)


def roundoff_ratio(a: str, b: str) -> float:
    """How many times coarser the coarser of two floating dtypes is (1.0 for the same; ``inf`` if not floating)."""
    ea, eb = unit_roundoff(a), unit_roundoff(b)
    if ea is None or eb is None:
        return math.inf
    return max(ea, eb) / min(ea, eb)


# --------------------------------------------------------------------------- #
# Sensitivity (reference vs its fp32 control)
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Sensitivity:
    """How far a precision scenario's reference ends from its fp32 control, against the tolerance."""

    precision: str
    #: Max abs parameter difference between the reference and its fp32 control.
    effect_param: float
    #: Largest relative difference of any per-step or micro-batch loss.
    effect_loss: float
    #: The two skip different optimizer steps (fp16 overflow): a categorical effect.
    skipped_differs: bool
    tolerance_param: float
    tolerance_loss: float
    #: The control run (a reference run id) and, for a scenario's own control, what it changes.
    control: str = PRECISION_CONTROL
    changes: str | None = None

    @property
    def what(self) -> str:
        return self.changes or self.precision

    @property
    def ratio(self) -> float:
        """The effect over the tolerance: the more sensitive of the parameter and loss checks."""
        if self.skipped_differs:
            return math.inf
        return max(self.effect_param / self.tolerance_param, self.effect_loss / self.tolerance_loss)

    @property
    def conclusive(self) -> bool:
        return self.ratio >= SENSITIVITY_MIN

    def describe(self) -> str:
        skipped = "; the two skip different steps" if self.skipped_differs else ""
        return (
            f"sensitivity: {self.what} moves the reference {self.effect_param:.3g} (parameters, tolerance "
            f"{self.tolerance_param:.3g}, {self.effect_param / self.tolerance_param:.3g}x) and {self.effect_loss:.3g} "
            f"(relative loss, tolerance {self.tolerance_loss:.3g}, {self.effect_loss / self.tolerance_loss:.3g}x) "
            f"from its control run reference:{self.control}{skipped}: effect / tolerance {self.ratio:.3g} "
            f"({'>=' if self.conclusive else '<'} {SENSITIVITY_MIN:g})"
        )

    def inconclusive_reason(self) -> str:
        return (
            f"inconclusive: the effect the scenario exists to see is only {self.ratio:.3g}x its tolerance (needs "
            f">= {SENSITIVITY_MIN:g}x): a strategy that ignored {self.what} could pass. {self.describe()}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "control": f"reference:{self.control}",
            "changes": self.changes,
            "effect_param": self.effect_param,
            "effect_loss": self.effect_loss,
            "skipped_differs": self.skipped_differs,
            "tolerance_param": self.tolerance_param,
            "tolerance_loss": self.tolerance_loss,
            "ratio": None if math.isinf(self.ratio) else self.ratio,
            "minimum": SENSITIVITY_MIN,
            "conclusive": self.conclusive,
        }


def _max_rel_loss(a: Iterable[dict[str, Any]], b: Iterable[dict[str, Any]]) -> float:
    from unison.conformance.verdict import RELATIVE_FLOOR

    worst = 0.0
    for x, y in zip(a, b):
        pairs = [(x["loss"], y["loss"]), *zip(x["micro_losses"], y["micro_losses"])]
        for p, q in pairs:
            if math.isfinite(p) and math.isfinite(q):
                worst = max(worst, abs(p - q) / max(abs(q), RELATIVE_FLOOR))
    return worst


def measure(scenario: Scenario, ref_runs: dict[str, dict[str, Any]], tol: Any) -> Sensitivity | None:
    """The sensitivity of ``scenario`` from its reference runs; ``None`` without a control (an fp32 scenario
    without one of its own)."""
    from unison.conformance.checks.numeric import state_deviation

    control_id, changes = scenario.control or (PRECISION_CONTROL, None)
    if (scenario.precision == FP32 and scenario.control is None) or not any(
        r.backend == "reference" and r.id == control_id for r in scenario.runs
    ):
        return None
    main, control = ref_runs.get(scenario.runs[0].id) or {}, ref_runs.get(control_id) or {}
    if main.get("state") is None or control.get("state") is None:
        return None  # the reference runs' own failure is reported as such
    _, effect_param = state_deviation(main["state"], control["state"])
    steps, control_steps = main.get("steps", []), control.get("steps", [])
    return Sensitivity(
        precision=scenario.precision,
        effect_param=effect_param,
        effect_loss=_max_rel_loss(steps, control_steps),
        skipped_differs=[s["skipped"] for s in steps] != [s["skipped"] for s in control_steps],
        tolerance_param=tol.param,
        tolerance_loss=tol.loss,
        control=control_id,
        changes=changes,
    )


# --------------------------------------------------------------------------- #
# Probes (inside the strategy's runs)
# --------------------------------------------------------------------------- #


class PrecisionProbe:
    """Records the dtypes a strategy really computes and updates in (see the module docstring).

    :meth:`attach` registers a forward hook on every ``torch.nn.Linear`` of the
    user's module before it is handed to the trainer (wrappers run the same
    submodules); :meth:`watch` registers a step pre-hook on every optimizer the
    user's factory builds, which records the dtypes of the parameters in its
    ``param_groups`` when it really steps (an engine may swap its own fp32
    partitions in; an optimizer built but never stepped counts for nothing).
    """

    def __init__(self) -> None:
        self.outputs: Counter[str] = Counter()
        self.weights: Counter[str] = Counter()
        #: Elements per dtype held by the optimizer at a step (the most seen at any one step).
        self.stepped: Counter[str] = Counter()
        self._handles: list[Any] = []

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        self._handles.append(optimizer.register_step_pre_hook(self._record_step))

    def _record_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        held: Counter[str] = Counter()
        seen: set[int] = set()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    held[str(p.dtype)] += p.numel()
        for dtype, n in held.items():
            self.stepped[dtype] = max(self.stepped[dtype], n)

    def attach(self, model: torch.nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                self._handles.append(module.register_forward_hook(self._record))

    def _record(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            self.outputs[str(output.dtype)] += 1
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            self.weights[str(weight.dtype)] += 1

    def result(self) -> dict[str, Any]:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return {
            "linear_outputs": dict(self.outputs),
            "linear_weights": dict(self.weights),
            "optimizer_params": dict(self.stepped),
        }


def probes_apply(scenario: Scenario) -> bool:
    return scenario.precision in COMPUTE_DTYPES


def check_probes(c: Any, scenario: Scenario, label: str, trace: dict[str, Any]) -> None:
    """Fail ``c`` (a comparison checker) where a rank computed or updated in another dtype than declared."""
    if not probes_apply(scenario):
        return
    want = str(COMPUTE_DTYPES[scenario.precision])
    fp32 = str(torch.float32)
    steps = trace.get("steps") or []
    first = min((s["step"] for s in steps), default=0)
    c.checks.append(
        f"{label}: probes on every rank: every Linear output inside forward is {want}; every parameter the "
        "optimizer updates is float32 (fp32 master weights)"
    )
    for r, rt in enumerate(trace.get("ranks") or [trace]):
        probe = rt.get("precision_probe")
        if rt.get("status") != "ok":
            continue
        if not probe or not probe.get("linear_outputs"):
            c.fail(label, f"Linear outputs inside forward on rank {r}", note="no Linear forward recorded", kind="run")
            continue
        other = {d: n for d, n in probe["linear_outputs"].items() if d != want}
        if other:
            worst = max(other, key=lambda d: roundoff_ratio(d, want))
            total = sum(probe["linear_outputs"].values())
            c.fail(
                label,
                f"Linear output dtype inside forward on rank {r}",
                step=first,
                expected=want,
                got=", ".join(f"{d} ({n} of {total} forwards)" for d, n in sorted(other.items())),
                deviation=roundoff_ratio(worst, want),
                tolerance=1.0,
                kind="precision",
                note=f"the forward did not compute in {scenario.precision}; deviation is the ratio of the dtypes' "
                "unit roundoffs",
            )
        held = probe.get("optimizer_params") or {}
        low = {d: n for d, n in held.items() if d != fp32}
        if low:
            worst = max(low, key=lambda d: roundoff_ratio(d, fp32))
            total = sum(held.values())
            c.fail(
                label,
                f"fp32 master weights on rank {r}",
                step=first,
                expected=f"{fp32} (the parameters the optimizer updates)",
                got=", ".join(f"{d} ({n} of {total} elements)" for d, n in sorted(low.items())),
                deviation=roundoff_ratio(worst, fp32),
                tolerance=1.0,
                kind="precision",
                note=f"{scenario.precision} keeps fp32 master weights; the optimizer steps {worst} weights, so every "
                f"update below half a {worst} spacing is lost; deviation is the ratio of the dtypes' unit roundoffs",
            )


def diagnose_precision(
    scenario: Scenario, divergences: list[Any], strat: dict[str, dict[str, Any]], ref_runs: dict[str, dict[str, Any]]
) -> tuple[Any, str]:
    """The deciding divergence and the explanation of rule ``precision_not_applied``."""
    from unison.conformance.checks.numeric import state_deviation

    d = divergences[0]
    masters = "master weights" in d.quantity
    if masters:
        why = (
            f"the optimizer updates {d.got} instead of fp32 master weights, although {scenario.precision} keeps "
            "fp32 masters: the weights were cast down and stepped directly, so every update smaller than half a "
            "spacing of their dtype is lost (at a small learning rate most weights never move)"
        )
    else:
        why = (
            f"{scenario.precision} is declared supported but the forward did not compute in it: Linear outputs "
            f"were {d.got}, expected {d.expected}. Whoever the declaration names (trainer autocast, the engine's "
            "config, the sharding policy, a precision plugin) never applied it"
        )
    main = (strat.get("main") or {}).get("state")
    ref, control = (ref_runs.get("main") or {}).get("state"), (ref_runs.get(PRECISION_CONTROL) or {}).get("state")
    if main is not None and ref is not None and control is not None:
        _, to_ref = state_deviation(main, ref)
        _, to_control = state_deviation(main, control)
        why += (
            f". The strategy's final parameters are {to_ref:.3g} from the {scenario.precision} reference and "
            f"{to_control:.3g} from its fp32 control run"
        )
    why += f" (deciding check: {d.deviation:.3g} / tolerance {d.tolerance:g})"
    return d, why


__all__ = [
    "COMPUTE_DTYPES",
    "SENSITIVITY_MIN",
    "PrecisionProbe",
    "Sensitivity",
    "check_probes",
    "diagnose_precision",
    "measure",
    "probes_apply",
    "roundoff_ratio",
]
