"""Declared-behaviour checks: refusals allowed by the declaration, and precision declarations.

Refusals. A run refused before ``fit`` starts the process group (the suite's
``refused`` status) is *declared out* only when the run needs something the
strategy's declaration refuses: a :class:`~unison.contract.ownership.Feature`, a
precision, or the world size (:func:`~unison.conformance.spec.needs`).
Any other refusal is a failure, "refused X although it declares it
supported". A run that fails after setup started is an error, never a refusal.
"""

from __future__ import annotations

from typing import Any

from unison.conformance.checks.numeric import Checker, finish, run_label
from unison.conformance.spec import Run, Scenario, needs
from unison.conformance.suite import StrategyResult
from unison.conformance.verdict import FAIL, Divergence, Verdict, tolerance_for
from unison.contract.ownership import Feature, WorldSizes


def declared_refusals(ownership: dict[str, Any], world_size: int) -> dict[str, str]:
    """Everything ``ownership`` (a declaration as a dict) refuses at ``world_size``: key -> reason.

    Keys are :class:`~unison.contract.ownership.Feature` values, ``"precision:NAME"``
    and ``"world_size"``, as in :func:`~unison.conformance.spec.needs`.
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
    label = run_label(run.backend, run.id)
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


def judge_declarations(scenario: Scenario, result: StrategyResult, v: Verdict) -> Verdict:
    c = Checker(scenario, tolerance_for("32-true"))
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
    v = finish(v, c)
    if v.status == FAIL:
        from unison.conformance.diagnosis.table import diagnose

        v.diagnosis = diagnose(scenario, v.divergences, result, {})
    return v
