"""Divergence diagnosis: from a failed scenario's divergences to the rule the strategy likely broke.

The comparison reports *where* a strategy left the reference (every
:class:`~unison.conformance.verdict.Divergence`, earliest step first); this
module says *why*, from patterns in what the suite recorded. The rules, in the
order they are tried (the first that matches names the diagnosis):

================== ===================================================================
rule               pattern
================== ===================================================================
undeclared_refusal the strategy refused something its declaration supports
error              a run raised after setup started (or its world died)
declaration        a precision declaration that the Trainer does not honour
premise            the reference itself broke the scenario's premise (a suite problem)
precision_not_     a precision probe saw another dtype than the declared precision:
applied            Linear outputs inside forward not in bf16/fp16, or the optimizer
                   updating low-precision weights (no fp32 masters); see
                   :mod:`unison.conformance.sensitivity`
hard_coded_divisor one fixed divisor explains the grad-norm ratios at two world sizes
                   (main and reshard): gradients divided by D, not the world size
partial_optimizer_state
                   only resumed runs diverge, first in the lr of some parameter groups
                   while the others match
buffers_on_resume  only resumed runs diverge and a buffer counter ends behind by what
                   it had counted at the checkpoint: buffers not saved or not loaded
resume_state       only runs that resume a checkpoint diverge: the checkpoint does
                   not restore optimizer / scheduler / RNG / model state (refined by
                   the first quantity: lr -> scheduler or optimizer param groups; the
                   first resumed loss -> model weights; a later step -> optimizer
                   state such as momentum); a ``single`` run resuming
                   the strategy's checkpoint diverging -> the checkpoint written is wrong
initial_weights    the loss of the run's very first micro-batch differs, before any
                   optimizer update: replicas did not start from the reference's
                   weights/buffers (or, in mixed precision, the forward differs)
buffers            the first micro-batch matches but a later one of the same step does
                   not (nothing but forward-side state changed in between), or the
                   strategy's buffers still hold their initial values at a checkpoint,
                   or only buffers differ: buffer updates lost or stale buffers exported
averaged_twice     the first grad-norm divergence has ratio 1 / world size (strategy /
                   reference) with losses equal: gradients divided by the world size
                   twice (2.0 reference/strategy at world 2)
summed             ratio = world size: gradients summed over replicas, not averaged
accumulation_scale ratio 1 / accumulate_grad_batches or accumulate_grad_batches: the loss
                   divided twice, or not divided, for accumulation
tied_weight_twice  tied weights and the first grad norm 1 to sqrt 2 times the reference's
                   with the loss equal: the tied weight's gradient counted once per name
replica_desync     ranks disagree with each other (per-step numbers, final state,
                   checkpoint buffers) while rank 0 matches the reference up to then
gradient_sync      gradient collectives contradict the declared GradSync or engine boundary
uncapped_clip      in a scenario straddling the clip value, the first update that differs
                   followed a step whose pre-clip norm was below the clip value
per_bucket_clip    the same, after a clipped step with the global norm equal: the
                   gradients were not scaled by clip / global norm
optimizer          loss and grad norm equal up to step k-1 but the loss differs at step
                   k, or every per-step number matches and only the final parameters
                   differ: the optimizer update (rule, state, hyperparameters, groups)
validation         only val/loss differs from the reference's (training matches): not the
                   per-sample mean over all replicas
scheduler          the learning rate is the first quantity to differ
hooks / counts     the hook sequence or the optimizer/scheduler step counts differ
unclassified       none of the above
================== ===================================================================

The rules that look past one number (hard_coded_divisor, tied_weight_twice,
uncapped_clip, per_bucket_clip, buffers_on_resume, partial_optimizer_state)
live in :mod:`unison.conformance.diagnose_rules`.

Each rule is tested with a deliberately broken trace or strategy (see
``tests/test_conformance*.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from unison.conformance import diagnose_rules
from unison.conformance.spec import Run, Scenario

#: Relative agreement for a grad-norm ratio to match a pattern (well above
#: fp32 and bf16 noise, far below the gap between 1/2, 1/4, 2 and 4).
RATIO_MATCH = 0.05

TITLES = {
    "undeclared_refusal": "refused something it declares supported",
    "error": "the run failed",
    "declaration": "a declaration the trainer does not honour",
    "premise": "the scenario's premise failed on the reference",
    "precision_not_applied": "the declared precision is not applied",
    "resume_state": "state not restored on resume",
    "initial_weights": "replicas did not start from the reference's weights",
    "averaged_twice": "gradients averaged twice",
    "summed": "gradients summed, not averaged",
    "accumulation_scale": "loss scaled wrongly for accumulation",
    "replica_desync": "replicas disagree with each other",
    "buffers": "buffer updates lost",
    "gradient_sync": "gradient sync contradicts the declaration",
    "optimizer": "optimizer update differs",
    "scheduler": "learning-rate schedule differs",
    "validation": "validation loss is not the per-sample mean over all replicas",
    "hooks": "hook sequence differs",
    "counts": "step counts differ",
    "unclassified": "unclassified divergence",
    **diagnose_rules.TITLES,
}


@dataclass
class Diagnosis:
    """The likely broken rule behind a failed scenario, with the first divergence that shows it."""

    rule: str
    #: The run, step and quantity where it first shows.
    run: str
    step: int | None
    quantity: str
    #: Why this rule, from the recorded numbers.
    explanation: str

    @property
    def title(self) -> str:
        return TITLES.get(self.rule, self.rule)

    def message(self) -> str:
        where = f"{self.quantity}" + (f" at step {self.step}" if self.step is not None else "") + f" ({self.run})"
        explanation = self.explanation[:1].upper() + self.explanation[1:]
        return f"{self.title}: first seen in {where}. {explanation}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "title": self.title,
            "run": self.run,
            "step": self.step,
            "quantity": self.quantity,
            "explanation": self.explanation,
            "message": self.message(),
        }


def _make(rule: str, d: Any, explanation: str) -> Diagnosis:
    return Diagnosis(rule, d.run, d.step, d.quantity, explanation)


def _run_of(scenario: Scenario, label: str) -> Run | None:
    backend, _, run_id = label.partition(":")
    return next((r for r in scenario.runs if r.backend == backend and r.id == run_id), None)


def _first_step(scenario: Scenario, run: Run | None, trace: dict[str, Any] | None) -> int:
    steps = (trace or {}).get("steps") or []
    if steps:
        return min(s["step"] for s in steps)
    return 0 if run is None or run.resume_from is None else -1


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= RATIO_MATCH * abs(b)


def _ratio_rule(ratio: float, world: int, accumulation: int) -> tuple[str, str] | None:
    """The scale error a strategy/reference grad-norm ratio points at, or ``None``."""
    candidates: list[tuple[str, str]] = []
    if world > 1 and _close(ratio, 1 / world):
        candidates.append(
            (
                "averaged_twice",
                f"1/world size = 1/{world}: the gradients were divided by the world "
                "size twice (e.g. an averaging all-reduce of a loss already averaged, "
                "or averaging twice)",
            )
        )
    if world > 1 and _close(ratio, world):
        candidates.append(
            (
                "summed",
                f"the world size {world}: the gradients were summed over replicas and never divided by the world size",
            )
        )
    if accumulation > 1 and _close(ratio, 1 / accumulation):
        candidates.append(
            (
                "accumulation_scale",
                f"1/accumulate_grad_batches = 1/{accumulation}: the loss was "
                "divided for accumulation twice (trainer and engine both)",
            )
        )
    if accumulation > 1 and _close(ratio, accumulation):
        candidates.append(
            (
                "accumulation_scale",
                f"accumulate_grad_batches = {accumulation}: the micro-batch "
                "losses were summed, never divided for accumulation",
            )
        )
    if not candidates:
        return None
    rule = candidates[0][0]
    text = " or ".join(why for _, why in candidates)
    return rule, text


def _stale_buffers(scenario: Scenario, strat: dict[str, dict[str, Any]]) -> str | None:
    """Why the strategy's buffers look never updated (equal to the initial ones at a checkpoint), or ``None``."""
    from unison.conformance.models import build_model

    initial = dict(build_model(scenario.model).named_buffers())
    if not initial:
        return None
    for run_id, trace in strat.items():
        for done, snapshot in sorted((trace.get("buffer_snapshots") or {}).items()):
            same = [
                n
                for n, v in snapshot.items()
                if n in initial
                and v.shape == initial[n].shape
                and bool((v.double() - initial[n].double()).abs().max() == 0)
            ]
            if same and len(same) == len(snapshot):
                return (
                    f"after {done} optimizer steps strategy:{run_id}'s buffers ({', '.join(same)}) still hold "
                    "their initial values: buffer updates made in the forward are lost (a copy of the module or of its "
                    "buffers ran the forward, or buffers are reset / re-broadcast from a stale copy)"
                )
    return None


def diagnose(
    scenario: Scenario, divergences: Sequence[Any], result: Any, reference: dict[str, dict[str, dict[str, Any]]]
) -> Diagnosis | None:
    """The likely broken rule behind ``divergences`` (earliest step first), or ``None`` when there are none."""
    if not divergences:
        return None
    by_kind: dict[str, list[Any]] = {}
    for d in divergences:
        by_kind.setdefault(d.kind, []).append(d)
    first = divergences[0]
    strat = result.traces.get(scenario.name, {}) if result is not None else {}

    def trace_of(label: str) -> dict[str, Any] | None:
        backend, _, run_id = label.partition(":")
        if backend == "strategy":
            return strat.get(run_id)
        if result is not None:
            t = result.reference_traces.get(scenario.name, {}).get(run_id)
            if t is not None:
                return t
        return reference.get(scenario.name, {}).get(run_id)

    if "refusal" in by_kind:
        d = by_kind["refusal"][0]
        return _make("undeclared_refusal", d, d.note or "the refusal is not in the strategy's declaration")
    if "run" in by_kind:
        d = by_kind["run"][0]
        return _make("error", d, d.note or "the run did not complete")
    if "declaration" in by_kind:
        d = by_kind["declaration"][0]
        return _make("declaration", d, d.note or "the Trainer did not act as the declaration says")
    if "premise" in by_kind:
        d = by_kind["premise"][0]
        return _make(
            "premise",
            d,
            "the reference run broke the scenario's premise: the scenario proves nothing "
            "until the suite is fixed, whatever the strategy does",
        )
    if "precision" in by_kind:
        from unison.conformance.sensitivity import diagnose_precision

        d, why = diagnose_precision(scenario, by_kind["precision"], strat, reference.get(scenario.name, {}))
        return _make("precision_not_applied", d, why)

    if all(d.kind == "validation" for d in divergences):
        d = first
        return _make(
            "validation",
            d,
            "training matches the reference but val/loss does not: it is not the per-sample mean over every "
            "replica (each replica's mean averaged, or a zero-weight stand-in batch counted); the strategy's "
            "reduce_sum must sum the (loss * weight, weight) pair over replicas",
        )

    numeric = [d for d in divergences if d.kind in ("loss", "grad_norm", "lr", "state", "buffer", "skipped")]
    divisor = diagnose_rules.hard_coded_divisor(scenario, divergences, trace_of)
    if divisor is not None:
        return _make(divisor[0], divisor[1], divisor[2])
    # -- only resumed runs diverge --------------------------------------------------------------- #
    failing_runs = {d.run for d in divergences if d.kind not in ("rank",)}
    runs = [_run_of(scenario, label) for label in failing_runs]
    if runs and all(r is not None and r.resume_from is not None for r in runs):
        fresh = [r.id for r in scenario.runs if r.backend == "strategy" and r.resume_from is None]
        d = min((x for x in divergences if x.run in failing_runs), key=lambda x: math.inf if x.step is None else x.step)
        run = _run_of(scenario, d.run)
        start = _first_step(scenario, run, trace_of(d.run))
        refined = diagnose_rules.resume_rule(scenario, d, start, divergences, trace_of)
        if refined is not None and run is not None and run.backend == "strategy":
            return _make(refined[0], d, refined[1])
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
        elif d.kind == "loss" and d.step == start:
            why = (
                "the loss differs already at the first resumed step, before any update: the model weights "
                "(or buffers) were not restored from the checkpoint"
            )
        elif d.kind in ("state", "buffer") and not numeric[:1]:
            why = "only the final state differs after resume: model state not restored, or buffers not restored"
        else:
            why = (
                "the run matches the uninterrupted one at the first resumed step but drifts after: optimizer "
                "state (e.g. momentum, Adam moments) or RNG state was not restored"
            )
        if fresh:
            why += f"; the strategy's runs that do not resume ({', '.join(fresh)}) match the reference"
        return _make("resume_state", d, why)

    # -- the first step already differs: initial weights, or state that changes in the forward -- #
    losses = [d for d in divergences if d.kind == "loss"]
    first_step_losses = []
    for d in losses:
        run = _run_of(scenario, d.run)
        if run is not None and run.resume_from is None and d.step == _first_step(scenario, run, trace_of(d.run)):
            first_step_losses.append((d, run))
    if first_step_losses:
        initial = [(d, run) for d, run in first_step_losses if d.quantity == "micro-batch 0 loss"]
        if initial:
            d, run = initial[0]
            extra = ""
            if "rank" in by_kind:
                extra = " The replicas also end apart from each other."
            if run.perturb:
                extra += (
                    f" This run perturbed the {run.perturb} of every rank but 0: whoever the declaration names "
                    "(Ownership.replica_init) did not make them equal to rank 0's."
                )
            if scenario.precision != "32-true":
                extra += f" (In {scenario.precision}, a forward that ignores the precision shows the same way.)"
            return _make(
                "initial_weights",
                d,
                "the loss of the very first micro-batch differs, before any optimizer "
                "update, so the forward already saw other weights or buffers than "
                "the reference's." + extra,
            )
        d, run = first_step_losses[0]
        later = next((x for x, _ in first_step_losses if x.quantity.startswith("micro-batch ")), d)
        stale = _stale_buffers(scenario, strat)
        return _make(
            "buffers",
            later,
            "the first micro-batch of the first step matches but a later micro-batch of the "
            "same step does not, with no optimizer update in between: state the forward "
            "changes (buffers) evolves differently" + (f"; {stale}" if stale else ""),
        )
    stale = _stale_buffers(scenario, strat)
    if stale and "buffer" in by_kind:
        return _make("buffers", by_kind["buffer"][0], stale)

    # -- a gradient scale error ------------------------------------------------------------------ #
    norms = [d for d in divergences if d.kind == "grad_norm"]
    if norms:
        d = norms[0]
        earlier_loss = [
            x for x in losses if x.run == d.run and x.step is not None and d.step is not None and x.step < d.step
        ]
        if not earlier_loss and isinstance(d.got, float) and isinstance(d.expected, float) and d.expected:
            ratio = d.got / d.expected
            world = (trace_of(d.run) or {}).get("world_size", getattr(result, "world_size", 1)) or 1
            match = _ratio_rule(ratio, world, scenario.accumulate_grad_batches)
            loss_equal = not any(x.run == d.run and x.step == d.step for x in losses)
            tied = diagnose_rules.tied_weight_twice(scenario, ratio) if match is None and loss_equal else None
            if tied is not None:
                return _make("tied_weight_twice", d, tied)
            if match is not None:
                rule, why = match
                return _make(
                    rule,
                    d,
                    f"with the loss equal, the global grad norm is {ratio:.4g}x the reference's "
                    f"(reference/strategy {1 / ratio:.4g}), which is {why}",
                )

    # -- ranks disagree --------------------------------------------------------------------------- #
    if "rank" in by_kind:
        d = by_kind["rank"][0]
        return _make(
            "replica_desync",
            d,
            "the ranks of the strategy's world disagree with each other "
            f"({d.note or d.quantity}): a replica trained on different weights, "
            "gradients or buffers (not synchronised, or synchronised one way only)",
        )

    # -- only buffers --------------------------------------------------------------------------- #
    if "buffer" in by_kind and not any(d.kind in ("loss", "grad_norm", "state") for d in divergences):
        d = by_kind["buffer"][0]
        return _make(
            "buffers",
            d,
            "the parameters, losses and grad norms match but buffers do not: buffer updates "
            "made in the forward were lost (a copy of the module ran, buffers were reset or "
            "re-broadcast from a stale copy) or stale buffers were exported",
        )
    if (
        "buffer" in by_kind
        and by_kind["buffer"][0].step is not None
        and (
            not numeric
            or by_kind["buffer"][0].step <= min((x.step for x in numeric if x.step is not None), default=math.inf)
        )
    ):
        d = by_kind["buffer"][0]
        return _make(
            "buffers",
            d,
            "the buffers are the first to differ (the losses follow): buffer updates made in "
            "the forward were lost or not synchronised",
        )

    # -- gradient sync declarations -------------------------------------------------------------- #
    if "sync" in by_kind or "boundary" in by_kind:
        d = (by_kind.get("sync") or by_kind["boundary"])[0]
        return _make(
            "gradient_sync",
            d,
            "the gradient collectives (counted from the real process group) do not "
            "follow the declared accumulation: " + (d.note or d.quantity),
        )

    # -- learning rate ---------------------------------------------------------------------------- #
    if first.kind == "lr":
        return _make(
            "scheduler",
            first,
            "the learning rate is the first quantity to differ: the scheduler was "
            "stepped a different number of times or built on other param groups",
        )

    # -- the update: optimizer -------------------------------------------------------------------- #
    if losses:
        d = losses[0]
        norms_before = [x for x in norms if x.run == d.run and x.step is not None and x.step < (d.step or 0)]
        if d.step is not None and not norms_before:
            twin = _run_of(scenario, d.run)
            ref_steps = (trace_of(f"reference:{twin.twin or twin.truth}") or {}).get("steps") if twin else None
            clipped = diagnose_rules.clip_rule(scenario, d, ref_steps or [])
            if clipped is not None:
                return _make(clipped[0], d, clipped[1])
            return _make(
                "optimizer",
                d,
                f"loss and grad norm match up to step {d.step - 1} but the loss differs at "
                f"step {d.step}: the gradients were right and the update was not (the "
                "optimizer's rule, state, hyperparameters or parameter groups)",
            )
    if "state" in by_kind and not losses and not norms:
        d = by_kind["state"][0]
        if "buffer" in by_kind:
            return _make("buffers", by_kind["buffer"][0], "buffers differ at the end")
        return _make(
            "optimizer",
            d,
            "every per-step loss and grad norm matches but the final parameters do not: "
            "the optimizer update (its rule, state, hyperparameters or parameter groups) "
            "differs, or the last update was not applied",
        )
    if "hooks" in by_kind:
        return _make("hooks", by_kind["hooks"][0], "the hook sequence or the grad norm given to the hooks differs")
    if "counts" in by_kind:
        return _make("counts", by_kind["counts"][0], "optimizer or scheduler steps were counted differently")
    return _make("unclassified", first, "no known pattern; see the divergences")


__all__ = ["TITLES", "Diagnosis", "diagnose"]
