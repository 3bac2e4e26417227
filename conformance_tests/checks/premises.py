"""Premise checks: the reference run shows the effect its scenario exists to test.

A scenario whose reference does not clip (or skip, or move its buffers) proves nothing
whatever the strategy does; such a failure is a ``premise`` divergence, the suite's own.
"""

from __future__ import annotations

from typing import Any

from unison.conformance.checks.numeric import Checker, state_deviation
from unison.conformance.models import build_model
from unison.conformance.spec import Scenario


def check_premises(c: Checker, scenario: Scenario, ref_runs: dict[str, dict[str, Any]]) -> None:
    """Every premise the scenario declares, on its first reference run (a failure: kind ``premise``)."""
    ref_first = ref_runs[scenario.runs[0].id]
    for check in _PREMISES:
        check(c, scenario, ref_first, ref_runs)


def _clips(c: Checker, scenario: Scenario, ref_first: dict[str, Any], ref_runs: dict[str, dict[str, Any]]) -> None:
    """The reference's pre-clip norm exceeds the clip value at every step."""
    if "clips" not in scenario.premises:
        return
    steps = ref_first.get("steps", [])
    clip = scenario.grad_clip_norm or 0.0
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


def _straddles_clip(
    c: Checker, scenario: Scenario, ref_first: dict[str, Any], ref_runs: dict[str, dict[str, Any]]
) -> None:
    """The reference's pre-clip norm is above the clip value at 3 steps or more and below it at 3 or more."""
    if "straddles_clip" not in scenario.premises:
        return
    steps = ref_first.get("steps", [])
    clip = scenario.grad_clip_norm or 0.0
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


def _clipping_changes_the_update(
    c: Checker, scenario: Scenario, ref_first: dict[str, Any], ref_runs: dict[str, dict[str, Any]]
) -> None:
    """The clipped reference ends far from its unclipped control run."""
    if not ("clips" in scenario.premises or "straddles_clip" in scenario.premises):
        return
    control = ref_runs.get("unclipped")
    if control is not None and control.get("state") is not None and ref_first.get("state") is not None:
        c.checks.append(
            "premise: the clipped reference ends far (> 100x the parameter tolerance) from its unclipped control run"
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


def _overflow_skips_one_step(
    c: Checker, scenario: Scenario, ref_first: dict[str, Any], ref_runs: dict[str, dict[str, Any]]
) -> None:
    """The reference skips exactly the poisoned step (fp16 overflow) and does not count it."""
    if "overflow" not in scenario.premises:
        return
    steps = ref_first.get("steps", [])
    poison = scenario.poison_step()
    c.checks.append(
        f"premise: the reference skips exactly step {poison} (fp16 overflow) and its scheduler does not advance there"
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


def _buffers_change(
    c: Checker, scenario: Scenario, ref_first: dict[str, Any], ref_runs: dict[str, dict[str, Any]]
) -> None:
    """Every buffer of the reference changes between consecutive checkpoints."""
    if "buffers_change" not in scenario.premises:
        return
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


#: The premise checks, in the order their divergences are reported.
_PREMISES = (_clips, _straddles_clip, _clipping_changes_the_update, _overflow_skips_one_step, _buffers_change)
