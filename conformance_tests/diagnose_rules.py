"""Diagnosis rules that look past one number: clipping, fixed divisors, tied weights, what a resume restored.

:func:`unison.conformance.diagnose.diagnose` tries these where the pattern
they refine would otherwise name a broader rule (see its module table):

======================= ================================================================
rule                    pattern
======================= ================================================================
hard_coded_divisor      the strategy's runs at two world sizes (the main one and the
                        reshard one) show grad-norm ratios (strategy / reference) that
                        one fixed divisor explains: ratio = world size / D at both, D
                        not 1 (a matching world counts as ratio 1)
tied_weight_twice       the model has tied weights and the first grad norm exceeds the
                        reference's, with the loss equal, by a factor in (1, sqrt 2]:
                        the tied weight's gradient counted once per name
uncapped_clip           a scenario whose steps straddle the clip value: the first update
                        that differs follows a step whose pre-clip norm was *below* the
                        clip value (clipping must leave it unchanged)
per_bucket_clip         the same scenario, the first update that differs follows a step
                        clipped (pre-clip norm above the clip value) with the global norm
                        equal: the clip coefficient is not clip / global norm
buffers_on_resume       only resumed runs diverge and an integer buffer (a counter) ends
                        behind the uninterrupted run's by exactly what it had counted when
                        the checkpoint was written: buffers restarted from the values the
                        model was built with
partial_optimizer_state only resumed runs diverge, first in the learning rate of some
                        parameter groups while others match: param_groups hyperparameters
                        restored for some groups only
======================= ================================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from unison.conformance.spec import Run, Scenario

#: Relative agreement for ratios and divisors (as :data:`unison.conformance.diagnose.RATIO_MATCH`).
MATCH = 0.05

TITLES = {
    "hard_coded_divisor": "gradients divided by a fixed number, not the world size",
    "tied_weight_twice": "a tied weight counted twice in the gradient norm",
    "uncapped_clip": "clip coefficient not capped at 1",
    "per_bucket_clip": "gradients clipped per bucket, not by the global norm",
    "buffers_on_resume": "buffers not restored on resume",
    "partial_optimizer_state": "optimizer state restored only in part",
}

TraceOf = Callable[[str], "dict[str, Any] | None"]


def _run(scenario: Scenario, label: str) -> Run | None:
    backend, _, run_id = label.partition(":")
    return next((r for r in scenario.runs if r.backend == backend and r.id == run_id), None)


def _ratio(d: Any) -> float | None:
    if d.kind == "grad_norm" and isinstance(d.got, float) and isinstance(d.expected, float) and d.expected:
        return d.got / d.expected
    return None


def hard_coded_divisor(
    scenario: Scenario, divergences: Sequence[Any], trace_of: TraceOf
) -> tuple[str, Any, str] | None:
    """A fixed divisor D behind the grad-norm ratios at two or more world sizes, or ``None``."""
    worlds: dict[int, list[str]] = {}
    for run in scenario.runs:
        t = trace_of(f"strategy:{run.id}") if run.backend == "strategy" else None
        if t is not None and t.get("status") == "ok":
            worlds.setdefault(int(t.get("world_size", 1) or 1), []).append(f"strategy:{run.id}")
    if len(worlds) < 2:
        return None
    divisors: dict[int, tuple[float, Any]] = {}
    for world, labels in worlds.items():
        mine = [d for d in divergences if d.run in labels and d.kind not in ("rank",)]
        if not mine:
            divisors[world] = (float(world), None)
            continue
        first = min(mine, key=lambda d: math.inf if d.step is None else d.step)
        ratio = _ratio(first)
        if ratio is None:
            return None
        same_step_loss = [d for d in mine if d.run == first.run and d.kind == "loss" and d.step == first.step]
        if same_step_loss:
            return None
        divisors[world] = (world / ratio, first)
    values = [v for v, _ in divisors.values()]
    divisor = values[0]
    if abs(divisor - 1) <= MATCH or any(abs(v - divisor) > MATCH * divisor for v in values):
        return None
    shown = [(w, d) for w, (_, d) in sorted(divisors.items()) if d is not None]
    if not shown:
        return None
    world, d = shown[0]
    per_world = ", ".join(
        f"world {w}: " + ("matches" if x is None else f"{x.got / x.expected:.4g}x")
        for w, (_, x) in sorted(divisors.items())
    )
    return (
        "hard_coded_divisor",
        d,
        f"the grad norm relative to the reference's is world size / {divisor:.3g} at every world size the "
        f"strategy ran ({per_world}): the summed gradients are divided by a fixed {divisor:.3g}, not by the world "
        "size (often with the all-reduce skipped at world size 1)",
    )


def tied_weight_twice(scenario: Scenario, ratio: float) -> str | None:
    """Why a grad norm ``ratio`` (strategy / reference, loss equal) points at a tied weight counted twice."""
    from unison.conformance.models import build_model
    from unison.ownership import Feature
    from unison.strategy import model_features

    if Feature.TIED_WEIGHTS not in model_features(build_model(scenario.model)):
        return None
    if not 1.0 < ratio <= math.sqrt(2) * (1 + MATCH):
        return None
    return (
        f"with the loss equal, the global grad norm is {ratio:.4g}x the reference's, in (1, sqrt 2]: the model "
        "ties one weight under two names and its gradient was counted once per name (a norm over "
        "named_parameters(remove_duplicate=False), or over both copies of an untied replica)"
    )


def clip_rule(scenario: Scenario, d: Any, reference_steps: Sequence[dict[str, Any]]) -> tuple[str, str] | None:
    """Uncapped or per-bucket clipping behind the first update that differs (``d``: a loss at step k)."""
    clip = scenario.grad_clip_norm
    if clip is None or "straddles_clip" not in scenario.premises or not d.step:
        return None
    norms = {s["step"]: s["grad_norm"] for s in reference_steps}
    before = d.step - 1
    if before not in norms:
        return None
    norm = norms[before]
    earlier_above = [k for k in sorted(norms) if k < before and norms[k] > clip]
    earlier_below = [k for k in sorted(norms) if k < before and norms[k] < clip]
    if norm < clip:
        why = (
            f"the first update that differs is step {before}'s, whose pre-clip norm {norm:.4g} is below the clip "
            f"value {clip:g}: clipping must leave it unchanged (coefficient min(1, {clip:g}/{norm:.4g}) = 1), "
            f"and a coefficient not capped at 1 scales it up {clip / norm:.3g}x"
        )
        if earlier_above:
            why += f"; the clipped updates before it (steps {earlier_above}) match the reference"
        return "uncapped_clip", why
    why = (
        f"the first update that differs is step {before}'s, clipped (pre-clip norm {norm:.4g} above the clip value "
        f"{clip:g}) with the global norm equal to the reference's: the gradients were not scaled by "
        f"{clip:g} / global norm, e.g. each bucket or shard clipped by its own norm"
    )
    if earlier_below:
        why += f"; the unclipped updates before it (steps {earlier_below}) match the reference"
    return "per_bucket_clip", why


def resume_rule(
    scenario: Scenario, d: Any, start: int, divergences: Sequence[Any], trace_of: TraceOf
) -> tuple[str, str] | None:
    """Buffers or part of the optimizer state not restored, when only resumed runs diverge (``d`` the first)."""
    run = _run(scenario, d.run)
    t = trace_of(d.run)
    if run is None or t is None:
        return None
    if d.kind == "lr" and d.step == start:
        bad = sorted(
            {
                int(x.quantity.split("group ")[1].rstrip(")"))
                for x in divergences
                if x.run == d.run and x.kind == "lr" and x.step == start and "group " in x.quantity
            }
        )
        groups = next((len(s["lrs"]) for s in t.get("steps", []) if s["step"] == start), 0)
        if bad and len(bad) < groups:
            good = [g for g in range(groups) if g not in bad]
            return (
                "partial_optimizer_state",
                f"at the first resumed step the learning rate of parameter group(s) {bad} differs while group(s) "
                f"{good} match: the optimizer's param_groups hyperparameters were restored for some groups only",
            )
    return _buffers_restarted(scenario, run, t, trace_of)


def _buffers_restarted(scenario: Scenario, run: Run, t: dict[str, Any], trace_of: TraceOf) -> tuple[str, str] | None:
    from unison.conformance.models import build_model

    source = run.resume_from or ""
    truth = trace_of(f"reference:{run.truth}") if run.truth else None
    saved = trace_of(source if ":" in source else f"{run.backend}:{source}")
    got, want = t.get("state"), (truth or {}).get("state")
    snapshots = (saved or {}).get("buffer_snapshots") or {}
    if not got or not want or not snapshots:
        return None
    at_save = snapshots[max(snapshots)]
    for name, initial in build_model(scenario.model).named_buffers():
        if initial.is_floating_point() or name not in got or name not in want or name not in at_save:
            continue
        counted = at_save[name].long() - initial.long()
        behind = want[name].long() - got[name].long()
        if bool((counted != 0).any()) and bool((behind == counted).all()):
            return (
                "buffers_on_resume",
                f"buffer {name!r} ends behind the uninterrupted run's by exactly what it had counted when the "
                f"checkpoint was written ({counted.flatten()[0].item()}): on resume the buffers restarted from the "
                "values the model was built with (the checkpoint did not save or load them)",
            )
    return None


__all__ = ["TITLES", "clip_rule", "hard_coded_divisor", "resume_rule", "tied_weight_twice"]
