"""Rules for divergences the comparison already named: refusals, errors, declarations, premises, precision.

Each names the first divergence of its kind; they come first in the table
because any numeric pattern after them would be a consequence.
"""

from __future__ import annotations

from unison.conformance.diagnosis.evidence import Evidence, Finding, run_of

#: Exceptions that say "not supported" rather than "went wrong", in a failed run's traceback.
_REFUSALS = ("ConfigurationError", "DeclaredRefusal", "NotImplementedError")


def undeclared_refusal(e: Evidence) -> Finding | None:
    """The strategy refused something its declaration supports: before the process group, or when a run
    resumes a checkpoint (loading refused with a ConfigurationError or NotImplementedError) while the
    declaration does not refuse :attr:`~unison.contract.ownership.Feature.RESUME`."""
    if "refusal" in e.by_kind:
        d = e.by_kind["refusal"][0]
        return "undeclared_refusal", d, d.note or "the refusal is not in the strategy's declaration"
    refuses = ((getattr(e.result, "ownership", None) or {}).get("refuses")) or {}
    if "resume" in refuses:
        return None
    for d in e.by_kind.get("run", []):
        run = run_of(e.scenario, d.run)
        error = ((e.trace_of(d.run) or {}).get("error") or "").strip().splitlines()
        last = error[-1] if error else ""
        raised = last.split(":", 1)[0].rsplit(".", 1)[-1]
        if run is not None and run.backend == "strategy" and run.resume_from and raised in _REFUSALS:
            return (
                "undeclared_refusal",
                d,
                f"refused to resume a checkpoint although its declaration supports resume ({last}): declare "
                "Feature.RESUME in Ownership.refuses (the trainer then refuses ckpt_path before any process group) "
                "or load the checkpoint",
            )
    return None


#: What the RNG guard's PluginError says (:mod:`unison.plugin.rng_guard`), every run of the suite being guarded.
_RNG_GUARD_TEXT = "changed the training RNG state"


def plugin_rng(e: Evidence) -> Finding | None:
    """A run failed with the RNG guard's error: a lifecycle plugin drew from (or reseeded) a global generator."""
    d = next((x for x in e.by_kind.get("run", []) if _RNG_GUARD_TEXT in (x.note or "")), None)
    if d is None:
        return None
    return (
        "plugin_rng",
        d,
        "a callback, logger or progress plugin changed the training RNG state during a lifecycle hook (the suite "
        "runs with UNISON_CHECK_PLUGIN_RNG=1, and the guard raised): dropout masks and shuffles draw from the "
        "global generators, so training would differ with the plugin on or off and a resume in a new process "
        f"would not be exact. The guard's error: {d.note}",
    )


def run_error(e: Evidence) -> Finding | None:
    """A run raised after setup started (or its world died)."""
    if "run" not in e.by_kind:
        return None
    d = e.by_kind["run"][0]
    return "error", d, d.note or "the run did not complete"


def declaration(e: Evidence) -> Finding | None:
    """A precision declaration the Trainer does not honour."""
    if "declaration" not in e.by_kind:
        return None
    d = e.by_kind["declaration"][0]
    return "declaration", d, d.note or "the Trainer did not act as the declaration says"


def premise(e: Evidence) -> Finding | None:
    """The reference itself broke the scenario's premise (a suite problem, whatever the strategy does)."""
    if "premise" not in e.by_kind:
        return None
    return (
        "premise",
        e.by_kind["premise"][0],
        "the reference run broke the scenario's premise: the scenario proves nothing "
        "until the suite is fixed, whatever the strategy does",
    )


def precision_not_applied(e: Evidence) -> Finding | None:
    """A precision probe saw another dtype than the declared precision (:mod:`unison.conformance.sensitivity`)."""
    if "precision" not in e.by_kind:
        return None
    from unison.conformance.sensitivity import diagnose_precision

    d, why = diagnose_precision(e.scenario, e.by_kind["precision"], e.strat, e.reference.get(e.scenario.name, {}))
    return "precision_not_applied", d, why


def validation(e: Evidence) -> Finding | None:
    """Only val/loss differs: it is not the per-sample mean over every replica."""
    if not all(d.kind == "validation" for d in e.divergences):
        return None
    return (
        "validation",
        e.first,
        "training matches the reference but val/loss does not: it is not the per-sample mean over every "
        "replica (each replica's mean averaged, each batch's mean averaged over replicas, or a zero-weight "
        "stand-in batch counted); the strategy's eval_loss must return this replica's batch mean and its "
        "reduce_sum must sum the (loss * weight, weight) pair over replicas",
    )


__all__ = [
    "declaration",
    "plugin_rng",
    "precision_not_applied",
    "premise",
    "run_error",
    "undeclared_refusal",
    "validation",
]
