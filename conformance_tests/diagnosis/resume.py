"""Rules for when only runs that resume a checkpoint diverge: what the resume did not restore.

Every rule here reads :attr:`Evidence.resumed_divergence
<unison.conformance.diagnosis.evidence.Evidence.resumed_divergence>`, the
earliest divergence when every failing run resumes a checkpoint.
"""

from __future__ import annotations

from typing import Any

from unison.conformance.diagnosis.evidence import Evidence, Finding, run_of
from unison.conformance.spec import Run


def _strategy_resume(e: Evidence) -> tuple[Any, Run, dict[str, Any]] | None:
    """The resumed divergence, its run and trace, when the run is the strategy's."""
    d = e.resumed_divergence
    if d is None:
        return None
    run = run_of(e.scenario, d.run)
    t = e.trace_of(d.run)
    if run is None or t is None or run.backend != "strategy":
        return None
    return d, run, t


def partial_optimizer_state(e: Evidence) -> Finding | None:
    """At the first resumed step the lr of some parameter groups differs while the others match."""
    found = _strategy_resume(e)
    if found is None:
        return None
    d, _, t = found
    start = e.start_of(d.run)
    if d.kind != "lr" or d.step != start:
        return None
    bad = sorted(
        {
            int(x.quantity.split("group ")[1].rstrip(")"))
            for x in e.divergences
            if x.run == d.run and x.kind == "lr" and x.step == start and "group " in x.quantity
        }
    )
    groups = next((len(s["lrs"]) for s in t.get("steps", []) if s["step"] == start), 0)
    if not bad or len(bad) >= groups:
        return None
    good = [g for g in range(groups) if g not in bad]
    return (
        "partial_optimizer_state",
        d,
        f"at the first resumed step the learning rate of parameter group(s) {bad} differs while group(s) "
        f"{good} match: the optimizer's param_groups hyperparameters were restored for some groups only",
    )


def buffers_on_resume(e: Evidence) -> Finding | None:
    """An integer buffer ends behind the uninterrupted run by exactly what it had counted at the checkpoint."""
    from unison.conformance.models import build_model

    found = _strategy_resume(e)
    if found is None:
        return None
    d, run, t = found
    source = run.resume_from or ""
    truth = e.trace_of(f"reference:{run.truth}") if run.truth else None
    saved = e.trace_of(source if ":" in source else f"{run.backend}:{source}")
    got, want = t.get("state"), (truth or {}).get("state")
    snapshots = (saved or {}).get("buffer_snapshots") or {}
    if not got or not want or not snapshots:
        return None
    at_save = snapshots[max(snapshots)]
    for name, initial in build_model(e.scenario.model).named_buffers():
        if initial.is_floating_point() or name not in got or name not in want or name not in at_save:
            continue
        counted = at_save[name].long() - initial.long()
        behind = want[name].long() - got[name].long()
        if bool((counted != 0).any()) and bool((behind == counted).all()):
            return (
                "buffers_on_resume",
                d,
                f"buffer {name!r} ends behind the uninterrupted run's by exactly what it had counted when the "
                f"checkpoint was written ({counted.flatten()[0].item()}): on resume the buffers restarted from the "
                "values the model was built with (the checkpoint did not save or load them)",
            )
    return None


def fresh_process(e: Evidence) -> Finding | None:
    """Only runs resumed in new processes diverge; the same checkpoint resumed where it was written matches."""
    failing = {d.run for d in e.divergences}
    fresh = {f"{r.backend}:{r.id}" for r in e.scenario.runs if r.world == "fresh"}
    if not fresh or not failing or not failing <= fresh:
        return None
    d = next((x for x in e.divergences if x.deviation is not None and x.tolerance), e.first)
    return (
        "fresh_process_resume",
        d,
        "only the resume in new processes diverges: the same checkpoint resumed in the process that wrote it "
        "matches the uninterrupted run. Something done once per process (a draw from the global generator, a "
        "structure built and cached per process) runs again after a restart, after the checkpoint's RNG states "
        "were restored, so the run trains with other random numbers (dropout masks); draw from a generator of "
        "its own, or do it before the states are restored",
    )


def resume_state(e: Evidence) -> Finding | None:
    """Only resumed runs diverge: which state the checkpoint did not restore, from the first quantity that differs."""
    d = e.resumed_divergence
    if d is None:
        return None
    run = run_of(e.scenario, d.run)
    if run is not None and run.backend == "reference":
        why = (
            "single resuming the strategy's checkpoint diverges while the strategy's own runs match: the "
            "checkpoint the strategy wrote is incomplete or wrong (model, optimizer or scheduler state)"
        )
    elif d.kind == "lr":
        why = (
            "the learning rate differs after resume: the scheduler state, or the optimizer state whose "
            "param_groups carry the current lr, was not restored"
        )
    elif d.kind == "loss" and d.step == e.start_of(d.run):
        why = (
            "the loss differs already at the first resumed step, before any update: the model weights "
            "(or buffers) were not restored from the checkpoint"
        )
    elif d.kind in ("state", "buffer") and not e.numeric[:1]:
        why = "only the final state differs after resume: model state not restored, or buffers not restored"
    else:
        why = (
            "the run matches the uninterrupted one at the first resumed step but drifts after: optimizer "
            "state (e.g. momentum, Adam moments) or RNG state was not restored"
        )
    fresh = [r.id for r in e.scenario.runs if r.backend == "strategy" and r.resume_from is None]
    if fresh:
        why += f"; the strategy's runs that do not resume ({', '.join(fresh)}) match the reference"
    return "resume_state", d, why


__all__ = ["buffers_on_resume", "fresh_process", "partial_optimizer_state", "resume_state"]
