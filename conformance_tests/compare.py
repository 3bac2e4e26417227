"""Judging one scenario: which traces are compared with which, and the verdict.

A strategy passes (*proves*) a scenario when every check below holds; every
failed check is a :class:`Divergence` naming the scenario, the run, the
quantity, the step and both values, and every failed scenario gets a
:class:`~unison.conformance.diagnosis.table.Diagnosis` naming the likely broken rule.

What is compared (see :mod:`unison.conformance.spec` for the run roles):

* against the ``twin`` reference run (same shape): the hook sequence, the
  optimizer and scheduler step counts, every per-step number, the canonical
  buffers at every checkpoint and the final canonical state;
* against the ``truth`` (uninterrupted) run: per-step numbers matched by step
  index and, when both end at the same step, the final state;
* against ``same_as`` strategy runs: final state and per-step numbers
  (save -> resume equals uninterrupted);
* against ``exact_as`` runs of the same backend: the same, bit for bit (tolerance 0: default
  plugins on or off, a resume in new processes against one in the same process);
* against the scenario's ``full_batch`` reference run (accumulation 1): per-step loss and grad
  norm and the final state (a token-weighted loss does not depend on the split);
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

Refusals. A run refused before ``fit`` starts the process group (the suite's
``refused`` status) is *declared out* only when the run needs something the
strategy's declaration refuses: a :class:`~unison.contract.ownership.Feature`, a
precision, or the world size (:func:`~unison.conformance.spec.needs`).
Any other refusal is a failure, "refused X although it declares it
supported". A run that fails after setup started is an error, never a refusal.

The checks themselves live in :mod:`unison.conformance.checks`; the verdict
types and tolerances in :mod:`unison.conformance.verdict`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from unison.conformance.checks.declared import judge_declarations, judge_refusal
from unison.conformance.checks.numeric import Checker, finish, run_label
from unison.conformance.checks.premises import check_premises
from unison.conformance.checks.ranks import check_rank_consistency
from unison.conformance.checks.reported import (
    check_optimizer_roundtrip,
    check_param_groups,
    check_reduction_dtypes,
)
from unison.conformance.checks.runs import (
    compare_exactly,
    compare_to_full_batch,
    compare_to_truth,
    compare_to_twin,
    error_line,
)
from unison.conformance.checks.sync import check_accumulation, check_reduction_groups, check_same_sync
from unison.conformance.feature_probes import check_feature_probe
from unison.conformance.models import build_model
from unison.conformance.spec import Run, Scenario
from unison.conformance.suite import StrategyResult
from unison.conformance.verdict import (
    DECLARED_OUT,
    FAIL,
    INCONCLUSIVE,
    PASS,
    SKIPPED,
    Verdict,
    tolerance_for,
)


def _buffer_names(scenario: Scenario) -> list[str]:
    return [name for name, _ in build_model(scenario.model).named_buffers()]


def judge_scenario(
    scenario: Scenario,
    result: StrategyResult,
    reference: dict[str, dict[str, dict[str, Any]]],
) -> Verdict:
    """The verdict of ``scenario`` for the strategy measured in ``result``."""
    from unison.conformance import sensitivity
    from unison.conformance.diagnosis.table import diagnose

    v = Verdict(scenario.name, result.name, PASS, precision=scenario.precision)
    if _settled_without_comparing(scenario, result, v):
        return v
    if scenario.kind == "declarations":
        return judge_declarations(scenario, result, v)

    c = Checker(scenario, tolerance_for(scenario.precision))
    ref_runs = reference.get(scenario.name, {})
    _check_reference_ran(c, scenario, ref_runs)
    if c.divergences:
        return finish(v, c)
    check_premises(c, scenario, ref_runs)
    sens = sensitivity.measure(scenario, ref_runs, c.tol)
    if sens is not None:
        c.checks.append(sens.describe())
        v.sensitivity = sens.to_dict()

    strat = result.traces.get(scenario.name, {})
    dropped, declared_out = _judge_refusals(c, scenario, result, strat)
    if declared_out and not c.divergences:
        v.status, v.reason = DECLARED_OUT, declared_out[0]
        v.checks = c.checks + declared_out
        return v

    buffers = _buffer_names(scenario)
    for run in scenario.runs:
        _judge_run(c, scenario, run, result, ref_runs, dropped, buffers)

    if scenario.same_sync_as:
        check_same_sync(c, scenario, result)
    main = strat.get(next((r.id for r in scenario.runs if r.backend == "strategy"), ""), {})
    if main.get("collectives"):
        v.gradient_sync_per_step = main["collectives"]["gradient_sync_per_step"]
    v = finish(v, c)
    if v.status == FAIL:
        v.diagnosis = diagnose(scenario, v.divergences, result, reference)
    elif v.status == PASS and sens is not None and not sens.conclusive:
        v.status, v.reason = INCONCLUSIVE, sens.inconclusive_reason()
    return v


def _settled_without_comparing(scenario: Scenario, result: StrategyResult, v: Verdict) -> bool:
    """Set ``v`` and say so when nothing is compared: strategy skipped or failed to run, or not reshardable."""
    if result.status == "skipped":
        v.status, v.reason = SKIPPED, result.reason
        return True
    if result.status != "ran":
        v.status, v.reason = FAIL, result.reason
        return True
    missing = scenario.unavailable()
    if missing is not None:
        v.status, v.reason = SKIPPED, f"unavailable here: {missing}"
        return True
    state_dict = (result.ownership or {}).get("state_dict", {})
    if scenario.kind != "declarations" and scenario.requires_reshardable and not state_dict.get("reshardable"):
        fmt = state_dict.get("format") or "its format"
        v.status, v.reason = (
            DECLARED_OUT,
            f"declares its state_dict not reshardable ({fmt}): its checkpoints resume only at the world size "
            "and under the strategy that wrote them",
        )
        return True
    return False


def _check_reference_ran(c: Checker, scenario: Scenario, ref_runs: dict[str, dict[str, Any]]) -> None:
    """Every reference run of the scenario (but those resuming the strategy's checkpoints) completed."""
    for run in scenario.runs:
        if run.backend == "reference" and not (run.resume_from or "").startswith("strategy:"):
            t = ref_runs.get(run.id)
            if t is None or t["status"] != "ok":
                c.fail(
                    run_label("reference", run.id),
                    "reference run",
                    kind="premise",
                    note=f"the reference itself failed: {error_line(t or {})}",
                )


def _judge_refusals(
    c: Checker, scenario: Scenario, result: StrategyResult, strat: dict[str, dict[str, Any]]
) -> tuple[set[str], list[str]]:
    """Refusals before training: declared out only where the declaration says so; ``(dropped, declared_out)``.

    A refusal of the other world size only drops that run (the checkpoint is
    still verified at that world size under single).
    """
    own = result.ownership or {}
    dropped: set[str] = set()
    declared_out: list[str] = []
    for run in scenario.runs:
        t = strat.get(run.id) if run.backend == "strategy" else None
        if t is None or t["status"] != "refused":
            continue
        world = result.alt_world_size if run.world == "alt" else result.world_size
        reason, failure = judge_refusal(scenario, run, t, own, world)
        dropped.add(run.id)
        if failure is not None:
            c.divergences.append(failure)
        elif run.world == "alt":
            c.checks.append(
                f"strategy:{run.id} refused world size {world} ({reason}); the world-size change is "
                "verified under single only"
            )
        else:
            declared_out.append(f"strategy:{run.id} refused ({reason})")
    return dropped, declared_out


def _judge_run(
    c: Checker,
    scenario: Scenario,
    run: Run,
    result: StrategyResult,
    ref_runs: dict[str, dict[str, Any]],
    dropped: set[str],
    buffers: list[str],
) -> None:
    """Every check of one run: its ranks, its accumulation, and against its twin, truth and same_as runs."""
    from unison.conformance import sensitivity

    label = run_label(run.backend, run.id)
    strat = result.traces.get(scenario.name, {})
    from_strategy = (run.resume_from or "").startswith("strategy:")
    if run.backend == "strategy":
        if run.id in dropped:
            return
        t = strat.get(run.id)
        world_error = result.world_errors.get(run.world)
    elif not from_strategy:
        _judge_reference_run(c, scenario, run, ref_runs, buffers)
        return
    elif (run.resume_from or "").split(":", 1)[1] in dropped:
        return
    else:
        t = result.reference_traces.get(scenario.name, {}).get(run.id)
        world_error = None
    if t is None:
        c.fail(label, "run", note=f"did not execute: {world_error or 'no trace'}", kind="run")
        return
    if t["status"] != "ok":
        c.fail(label, "run", note=f"{t['status']}: {error_line(t)}", kind="run")
        return
    check_rank_consistency(c, label, t)
    if run.backend == "strategy":
        sensitivity.check_probes(c, scenario, label, t)
        check_feature_probe(c, scenario, label, t, ref_runs.get(run.twin) if run.twin else None)
        twin = ref_runs.get(run.twin or run.truth or "") or next(iter(ref_runs.values()), None)
        check_param_groups(c, label, t, twin)
        check_reduction_dtypes(c, scenario.precision, label, t)
        check_reduction_groups(c, label, t)
    check_optimizer_roundtrip(c, run, label, t, _written_by(run, strat, ref_runs))
    # Gradient syncs are expected only among data-parallel replicas (fsdp_tp at world 2 has one: dp=1 x tp=2).
    check_accumulation(c, scenario, label, t, t.get("data_parallel_size", t.get("world_size", 1)) > 1)
    if run.twin is not None:
        compare_to_twin(c, scenario, run, label, t, ref_runs, buffers)
    if run.truth is not None:
        compare_to_truth(c, run, label, t, ref_runs, buffers)
    for other in run.same_as:
        o = strat.get(other)
        against = run_label("strategy", other)
        if o is None or o["status"] != "ok":
            c.fail(label, "same_as", note=f"strategy run {other!r} missing", kind="run")
            continue
        c.steps(label, t, o, against, exact_range=False)
        # A run compared with the strategy's own runs only (activation_checkpointing_rng) reports that deviation.
        alone = run.twin is None and run.truth is None
        c.state(label, t.get("state"), o.get("state"), against, track=alone, buffers=buffers)
    for other in run.exact_as:
        compare_exactly(c, label, t, strat.get(other), run_label("strategy", other), buffers)
    if run.twin is not None:
        compare_to_full_batch(c, scenario, label, t, ref_runs, buffers)
    c.checks.append(_describe_run_checks(run))


def _written_by(
    run: Run, strat: dict[str, dict[str, Any]], ref_runs: dict[str, dict[str, Any]]
) -> dict[str, Any] | None:
    """The trace of the run whose checkpoint ``run`` resumed (``part``, ``strategy:part``, ``reference:part``)."""
    if run.resume_from is None:
        return None
    backend, _, source = run.resume_from.rpartition(":")
    if backend == "reference" or (not backend and run.backend == "reference"):
        return ref_runs.get(source)
    return strat.get(source)


def _judge_reference_run(
    c: Checker, scenario: Scenario, run: Run, ref_runs: dict[str, dict[str, Any]], buffers: list[str]
) -> None:
    """A pure reference run: only its own resume exactness, and what the scenario says of the reference (equal
    to another reference run bit for bit; equal to the full-batch run)."""
    label, t = run_label("reference", run.id), ref_runs.get(run.id)
    if t is None or t.get("status") != "ok":
        return  # reported by _check_reference_ran
    if run.truth is not None:
        compare_to_truth(c, run, label, t, ref_runs, buffers)
    for other in run.exact_as:
        compare_exactly(c, label, t, ref_runs.get(other), run_label("reference", other), buffers)
    if run is scenario.runs[0]:
        compare_to_full_batch(c, scenario, label, t, ref_runs, buffers)


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
    if run.exact_as:
        parts.append(f"every per-step number and the final state bit for bit = {run.backend}:{', '.join(run.exact_as)}")
    return f"{run.backend}:{run.id}: " + "; ".join(parts) if parts else f"{run.backend}:{run.id}: ran"


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
