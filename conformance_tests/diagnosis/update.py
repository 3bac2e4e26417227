"""Rules for where training first left the reference: the start, buffers, replicas, sync, the update.

The first step already differing points at the initial weights or at state the
forward changes (buffers); replicas apart, gradient collectives against the
declaration, the learning rate, clipping and the optimizer update follow; the
hook sequence and step counts come last, and :func:`unclassified` always
answers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from unison.conformance.diagnosis.evidence import Evidence, Finding, run_of
from unison.conformance.spec import Scenario
from unison.conformance.verdict import Divergence


def initial_weights(e: Evidence) -> Finding | None:
    """The loss of a fresh run's very first micro-batch differs, before any optimizer update."""
    initial = [(d, run) for d, run in e.first_step_losses if d.quantity == "micro-batch 0 loss"]
    if not initial:
        return None
    d, run = initial[0]
    extra = ""
    if "rank" in e.by_kind:
        extra = " The replicas also end apart from each other."
    if run.perturb:
        extra += (
            f" This run perturbed the {run.perturb} of every rank but 0: whoever the declaration names "
            "(Ownership.replica_init) did not make them equal to rank 0's."
        )
    if e.scenario.precision != "32-true":
        extra += f" (In {e.scenario.precision}, a forward that ignores the precision shows the same way.)"
    return (
        "initial_weights",
        d,
        "the loss of the very first micro-batch differs, before any optimizer "
        "update, so the forward already saw other weights or buffers than "
        "the reference's." + extra,
    )


def buffers_within_first_step(e: Evidence) -> Finding | None:
    """The first micro-batch of the first step matches but a later one of the same step does not."""
    if not e.first_step_losses or any(d.quantity == "micro-batch 0 loss" for d, _ in e.first_step_losses):
        return None
    d, _ = e.first_step_losses[0]
    later = next((x for x, _ in e.first_step_losses if x.quantity.startswith("micro-batch ")), d)
    stale = e.stale_buffers
    return (
        "buffers",
        later,
        "the first micro-batch of the first step matches but a later micro-batch of the "
        "same step does not, with no optimizer update in between: state the forward "
        "changes (buffers) evolves differently" + (f"; {stale}" if stale else ""),
    )


def stale_buffers(e: Evidence) -> Finding | None:
    """Buffers differ and the strategy's buffers still hold their initial values at a checkpoint."""
    if "buffer" not in e.by_kind:
        return None
    stale = e.stale_buffers
    return ("buffers", e.by_kind["buffer"][0], stale) if stale else None


def replica_desync(e: Evidence) -> Finding | None:
    """The ranks of the strategy's world disagree with each other."""
    if "rank" not in e.by_kind:
        return None
    d = e.by_kind["rank"][0]
    return (
        "replica_desync",
        d,
        "the ranks of the strategy's world disagree with each other "
        f"({d.note or d.quantity}): a replica trained on different weights, "
        "gradients or buffers (not synchronised, or synchronised one way only)",
    )


def only_buffers(e: Evidence) -> Finding | None:
    """Buffers differ while losses, grad norms and parameters match."""
    if "buffer" not in e.by_kind or any(d.kind in ("loss", "grad_norm", "state") for d in e.divergences):
        return None
    return (
        "buffers",
        e.by_kind["buffer"][0],
        "the parameters, losses and grad norms match but buffers do not: buffer updates "
        "made in the forward were lost (a copy of the module ran, buffers were reset or "
        "re-broadcast from a stale copy) or stale buffers were exported",
    )


def buffers_first(e: Evidence) -> Finding | None:
    """A buffer is the first quantity to differ (at a step no later than any other number's)."""
    if "buffer" not in e.by_kind:
        return None
    d = e.by_kind["buffer"][0]
    if d.step is None:
        return None
    earliest = min((x.step for x in e.numeric if x.step is not None), default=math.inf)
    if e.numeric and d.step > earliest:
        return None
    return (
        "buffers",
        d,
        "the buffers are the first to differ (the losses follow): buffer updates made in "
        "the forward were lost or not synchronised",
    )


def gradient_sync(e: Evidence) -> Finding | None:
    """Gradient collectives contradict the declared GradSync or the engine's boundary."""
    if "sync" not in e.by_kind and "boundary" not in e.by_kind:
        return None
    d = (e.by_kind.get("sync") or e.by_kind["boundary"])[0]
    return (
        "gradient_sync",
        d,
        "the gradient collectives (counted from the real process group) do not "
        "follow the declared accumulation: " + (d.note or d.quantity),
    )


#: Sync divergences that name where gradients were synchronised against the declared boundary.
_OFF_BOUNDARY = ("gradient collectives before the last micro-step", "gradient collectives inside no_sync()")


def sync_off_boundary(e: Evidence) -> Finding | None:
    """Gradient collectives at a micro-step that is not the declared boundary (before replicas drift apart)."""
    d = next((x for x in e.by_kind.get("sync", []) if x.quantity.startswith(_OFF_BOUNDARY)), None)
    if d is None:
        return None
    where = f" (per micro-step: {d.got}, expected {d.expected})" if d.got is not None else ""
    return (
        "gradient_sync",
        d,
        f"the gradients were synchronised before the last micro-step{where}, inside no_sync() or at the first "
        "micro-step instead of the boundary: the gradients of the later micro-steps stay local to each replica, "
        "so the replicas step on different gradients",
    )


def scheduler(e: Evidence) -> Finding | None:
    """The learning rate is the first quantity to differ."""
    if e.first.kind != "lr":
        return None
    return (
        "scheduler",
        e.first,
        "the learning rate is the first quantity to differ: the scheduler was "
        "stepped a different number of times or built on other param groups",
    )


def _first_update(e: Evidence) -> Divergence | None:
    """The first loss divergence at step k with no grad-norm divergence of its run before k."""
    if not e.losses:
        return None
    d = e.losses[0]
    norms_before = [x for x in e.norms if x.run == d.run and x.step is not None and x.step < (d.step or 0)]
    return d if d.step is not None and not norms_before else None


def clipping(e: Evidence) -> Finding | None:
    """In a scenario straddling the clip value: the update that differs was unclipped (uncapped) or clipped."""
    d = _first_update(e)
    if d is None:
        return None
    twin = run_of(e.scenario, d.run)
    ref_steps = (e.trace_of(f"reference:{twin.twin or twin.truth}") or {}).get("steps") if twin else None
    found = clip_pattern(e.scenario, d, ref_steps or [])
    return None if found is None else (found[0], d, found[1])


def clip_pattern(scenario: Scenario, d: Any, reference_steps: Sequence[dict[str, Any]]) -> tuple[str, str] | None:
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


def optimizer_step(e: Evidence) -> Finding | None:
    """Loss and grad norm match up to step k-1, the loss differs at step k: the update was wrong."""
    d = _first_update(e)
    if d is None or d.step is None:  # _first_update returns divergences with a step
        return None
    return (
        "optimizer",
        d,
        f"loss and grad norm match up to step {d.step - 1} but the loss differs at "
        f"step {d.step}: the gradients were right and the update was not (the "
        "optimizer's rule, state, hyperparameters or parameter groups)",
    )


def _final_state_only(e: Evidence) -> bool:
    return "state" in e.by_kind and not e.losses and not e.norms


def final_buffers(e: Evidence) -> Finding | None:
    """Only the final state differs, buffers among it."""
    if not _final_state_only(e) or "buffer" not in e.by_kind:
        return None
    return "buffers", e.by_kind["buffer"][0], "buffers differ at the end"


def final_parameters(e: Evidence) -> Finding | None:
    """Every per-step number matches but the final parameters do not."""
    if not _final_state_only(e):
        return None
    return (
        "optimizer",
        e.by_kind["state"][0],
        "every per-step loss and grad norm matches but the final parameters do not: "
        "the optimizer update (its rule, state, hyperparameters or parameter groups) "
        "differs, or the last update was not applied",
    )


def hooks(e: Evidence) -> Finding | None:
    """The hook sequence, or the grad norm given to the hooks, differs."""
    if "hooks" not in e.by_kind:
        return None
    return "hooks", e.by_kind["hooks"][0], "the hook sequence or the grad norm given to the hooks differs"


def counts(e: Evidence) -> Finding | None:
    """Optimizer or scheduler steps were counted differently."""
    if "counts" not in e.by_kind:
        return None
    return "counts", e.by_kind["counts"][0], "optimizer or scheduler steps were counted differently"


def unclassified(e: Evidence) -> Finding:
    """None of the rules before it: always answers."""
    return "unclassified", e.first, "no known pattern; see the divergences"


__all__ = [
    "buffers_first",
    "buffers_within_first_step",
    "clip_pattern",
    "clipping",
    "counts",
    "final_buffers",
    "final_parameters",
    "gradient_sync",
    "hooks",
    "initial_weights",
    "only_buffers",
    "optimizer_step",
    "replica_desync",
    "scheduler",
    "stale_buffers",
    "sync_off_boundary",
    "unclassified",
]
