"""Accumulation premises: gradient collectives and engine boundaries as the declaration says.

Trainer-owned accumulation with :class:`~unison.contract.ownership.GradSync` ``boundary``: no gradient
collective inside ``no_sync()`` or before the last micro-step, and as many per optimizer step as
the same model without accumulation (``same_sync_as``); ``every-micro-step``: no ``no_sync()``
and a full sync at every micro-step. Engine-owned accumulation answers
``is_accumulation_boundary()`` exactly at the last micro-step.
"""

from __future__ import annotations

from typing import Any

from unison.conformance.checks.numeric import Checker, run_label
from unison.conformance.spec import Scenario
from unison.conformance.suite import StrategyResult
from unison.contract.ownership import AccumulationOwner, GradSync


def check_accumulation(c: Checker, scenario: Scenario, label: str, trace: dict[str, Any], data_parallel: bool) -> None:
    """Engine boundaries, or (trainer-owned, data-parallel) the gradient collectives of every rank, as declared."""
    owner = trace.get("accumulation_owner")
    a = scenario.accumulate_grad_batches
    n_steps = len(trace.get("steps", []))
    if owner == AccumulationOwner.ENGINE.value and a > 1:
        _check_engine_boundaries(c, label, trace, a, n_steps)
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
        if sync == GradSync.BOUNDARY.value:
            if a > 1:
                _check_boundary_sync(c, label, r, coll, a, n_steps)
        else:
            _check_every_micro_step_sync(c, label, r, coll, a)
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


def _check_engine_boundaries(c: Checker, label: str, trace: dict[str, Any], a: int, n_steps: int) -> None:
    """Engine-owned accumulation: ``is_accumulation_boundary()`` true at the last of ``a`` micro-steps only.

    The answers are read from the training loop's marks in the run's profile (a run in a world of one
    process is not profiled: there the trainer's own check, which stops a fit at the first answer that
    disagrees with its micro-step, stands alone).
    """
    expected = ([False] * (a - 1) + [True]) * n_steps
    ranks = [rt for rt in (trace.get("ranks") or [trace]) if rt.get("boundaries") is not None]
    if not ranks:
        return
    c.checks.append(f"{label}: engine boundary answered at the last of {a} micro-steps only")
    for r, rt in enumerate(ranks):
        if rt.get("boundaries") != expected:
            c.fail(
                label,
                f"is_accumulation_boundary() on rank {r}",
                expected=expected,
                got=rt.get("boundaries"),
                kind="boundary",
            )


def _check_boundary_sync(c: Checker, label: str, r: int, coll: dict[str, Any], a: int, n_steps: int) -> None:
    """GradSync.BOUNDARY on rank ``r``: no_sync() on every non-boundary micro-step, no gradient collective in it."""
    micro = coll.get("gradient_sync_per_micro_step") or []
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
            note="declared GradSync.BOUNDARY: gradients must not be synchronised on non-boundary micro-steps",
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


def _check_every_micro_step_sync(c: Checker, label: str, r: int, coll: dict[str, Any], a: int) -> None:
    """GradSync.EVERY_MICRO_STEP on rank ``r``: no no_sync(), gradient collectives at every micro-step."""
    micro = coll.get("gradient_sync_per_micro_step") or []
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


def check_same_sync(c: Checker, scenario: Scenario, result: StrategyResult) -> None:
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
                        run_label("strategy", "main"),
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
            differs = next((i for i, (x, y) in enumerate(zip(ga, gb)) if x != y), None)
            c.fail(
                run_label("strategy", "main"),
                f"gradient collectives per optimizer step on rank {r}",
                step=differs,
                expected=gb[: len(ga)],
                got=ga,
                against=f"scenario {scenario.same_sync_as!r}",
                kind="sync",
            )


def reduction_components(trace: dict[str, Any]) -> list[list[int]]:
    """The ranks joined by the gradient reductions of every rank (each rank's groups, merged where they
    share a rank): one set per group of replicas that exchanged gradients, sorted."""
    components: list[set[int]] = []
    for rt in trace.get("ranks") or [trace]:
        groups = rt.get("process_groups") or {}
        for name in (rt.get("collectives") or {}).get("gradient_groups") or {}:
            joined = set(groups.get(name) or ())
            if not joined:
                continue
            for other in [comp for comp in components if comp & joined]:
                components.remove(other)
                joined |= other
            components.append(joined)
    return sorted(sorted(comp) for comp in components)


def check_reduction_groups(c: Checker, label: str, trace: dict[str, Any]) -> None:
    """The gradient reductions (flight recorder: each collective's group) join every data-parallel replica.

    Each rank's reductions of more than one element in forward/backward, over the groups they ran on, are
    merged where groups share a rank (HSDP: the shard group, then the replicate group); every merged set
    must hold exactly the strategy's ``data_parallel_size`` ranks, as its declaration (its mesh) says.
    """
    dp = trace.get("data_parallel_size", 1)
    components = reduction_components(trace)
    if dp < 2 or not components:
        return
    c.checks.append(
        f"{label}: the gradient reductions' process groups join the {dp} data-parallel replicas "
        f"(ranks joined: {components})"
    )
    wrong = [comp for comp in components if len(comp) != dp]
    if wrong:
        c.fail(
            label,
            "gradient reduction groups",
            expected=f"groups of {dp} data-parallel replicas",
            got=f"ranks joined: {components}",
            kind="reduction_group",
            note=f"the gradients were reduced over {wrong[0]} only, not over all {dp} data-parallel replicas",
        )
