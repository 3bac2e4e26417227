"""Divergence diagnosis: from a failed scenario's divergences to the rule the strategy likely broke.

The comparison reports *where* a strategy left the reference (every
:class:`~unison.conformance.verdict.Divergence`, earliest step first); this
module says *why*, from patterns in what the suite recorded. :data:`RULES` is
the table, in order of precedence: :func:`diagnose` asks each rule in turn and
the first finding names the diagnosis. A rule is a small function of the
:class:`~unison.conformance.diagnosis.evidence.Evidence` (package
:mod:`unison.conformance.diagnosis`):

========================= ========================= ==================================================
table rule                diagnosis                 pattern
========================= ========================= ==================================================
undeclared_refusal        undeclared_refusal        the strategy refused something its declaration
                                                    supports (before the process group, or a resume
                                                    refused with a ConfigurationError /
                                                    NotImplementedError while it declares resume)
plugin_rng                plugin_rng                a run failed with the RNG guard's PluginError: a
                                                    lifecycle plugin drew from or reseeded a global
                                                    generator (``UNISON_CHECK_PLUGIN_RNG=1``)
run_error                 error                     a run raised after setup started (or its world
                                                    died)
declaration               declaration               a precision declaration the Trainer does not honour
premise                   premise                   the reference itself broke the scenario's premise
                                                    (a suite problem)
precision_not_applied     precision_not_applied     a precision probe saw another dtype than the
                                                    declared precision: Linear outputs inside forward
                                                    not in bf16/fp16, or the optimizer updating
                                                    low-precision weights (no fp32 masters); see
                                                    :mod:`unison.conformance.sensitivity`
reduction_dtype           reduction_dtype           under a precision the trainer applies, a gradient
                                                    reduction carried bf16/fp16 data (the process
                                                    group's record of each collective's payload)
reduction_group           reduction_group           the gradient reductions' process groups (torch's
                                                    flight recorder) join fewer ranks than the
                                                    data-parallel replicas
param_groups              param_groups              the optimizer the strategy steps lost or changed
                                                    the parameter groups the user's factory built
state_dict_keys           state_dict_keys           the canonical state's key set is not the model's
                                                    (a wrapper's ``module.`` prefix, renamed keys)
validation                validation                only val/loss differs (training matches): not the
                                                    per-sample mean over all replicas
hard_coded_divisor        hard_coded_divisor        one fixed divisor D (not 1) explains the grad-norm
                                                    ratios at two world sizes (main and reshard):
                                                    ratio = world size / D at both
partial_optimizer_state   partial_optimizer_state   only resumed runs diverge, first in the lr of some
                                                    parameter groups while the others match
buffers_on_resume         buffers_on_resume         only resumed runs diverge and an integer buffer (a
                                                    counter) ends behind the uninterrupted run's by what
                                                    it had counted at the checkpoint
fresh_process_resume      fresh_process_resume      only runs resumed in new processes (``world="fresh"``)
                                                    diverge: a once-per-process draw or cache changes
                                                    training after a restart
optimizer_state_roundtrip optimizer_state_roundtrip a resume of the strategy's own checkpoint gave the
                                                    optimizer every entry back, but in another dtype,
                                                    rounded or with other step counters
resume_state              resume_state              only runs that resume a checkpoint diverge: the
                                                    checkpoint does not restore optimizer / scheduler /
                                                    RNG / model state (refined by the first quantity:
                                                    lr -> scheduler or param groups; the first resumed
                                                    loss -> model weights; a later step -> optimizer
                                                    state); a ``single`` run resuming the strategy's
                                                    checkpoint diverging -> the checkpoint is wrong
feature_rng               feature_rng               on a model with Dropout, the run with activation
                                                    checkpointing (or compile) differs from the same
                                                    strategy's run without: the recompute (or the compile
                                                    path) drew other masks
frozen_updated            frozen_updated            a frozen parameter moved in the strategy's final
                                                    state while the reference kept its initial value
buffers_twice             buffers_twice             an integer buffer (a counter) ends at a whole
                                                    multiple (k >= 2) of the reference's: every buffer
                                                    update applied k times (a recomputed forward)
initial_weights           initial_weights           the loss of a fresh run's very first micro-batch
                                                    differs, before any optimizer update: replicas did
                                                    not start from the reference's weights/buffers (or,
                                                    in mixed precision, the forward differs)
buffers_within_first_step buffers                   the first micro-batch matches but a later one of the
                                                    same step does not (only forward-side state changed)
stale_buffers             buffers                   buffers differ and the strategy's still hold their
                                                    initial values at a checkpoint
clip_before_sync          clip_before_sync          reductions ran inside ``clip_grad_norm`` and no
                                                    gradient collective in forward/backward: each
                                                    replica clipped by its local norm, then averaged
reported_grad_norm        reported_grad_norm        every grad norm that differs equals the clip value
                                                    where the reference's is above it, the losses and
                                                    weights equal: the norm after clipping reported
sync_off_boundary         gradient_sync             a gradient collective before the last micro-step or
                                                    inside ``no_sync()`` (declared boundary sync)
loss_normalisation        loss_normalisation        pair-form (token) scenario, first grad-norm ratio
                                                    1/ or x the data-parallel size with the loss equal:
                                                    the declared LossNormalisation misstates the
                                                    replicas' reduction
gradient_scale            averaged_twice, summed,   the first grad-norm ratio (strategy / reference),
                          accumulation_scale        the loss equal before: 1 / world size (divided
                                                    twice), world size (summed), 1 / or x
                                                    accumulate_grad_batches (loss divided twice / never);
                                                    when world size = accumulation, another scenario of
                                                    the strategy at another accumulation decides
norm_over_replicated_dim  norm_over_replicated_dim  a declared device mesh (``Ownership.mesh``) and the
                                                    first grad norm sqrt(k) times the reference's, the
                                                    loss equal, k a mesh dimension's size: the squared
                                                    norm all-reduced over ranks holding the same gradient
tied_weight_twice         tied_weight_twice         tied weights and the first grad norm 1 to sqrt 2
                                                    times the reference's with the loss equal: the tied
                                                    weight's gradient counted once per name
replica_desync            replica_desync            ranks disagree with each other (per-step numbers,
                                                    final state, checkpoint buffers)
only_buffers              buffers                   parameters, losses and grad norms match, buffers not
buffers_first             buffers                   a buffer is the first quantity to differ
gradient_sync             gradient_sync             gradient collectives contradict the declared
                                                    GradSync or engine boundary
scheduler                 scheduler                 the learning rate is the first quantity to differ
clipping                  uncapped_clip,            in a scenario straddling the clip value, the first
                          per_bucket_clip           update that differs followed a step whose pre-clip
                                                    norm was below the clip value (not capped at 1), or
                                                    a clipped step with the global norm equal (not
                                                    scaled by clip / global norm)
optimizer_step            optimizer                 loss and grad norm equal up to step k-1, the loss
                                                    differs at step k: the optimizer update
final_buffers             buffers                   only the final state differs, buffers among it
final_parameters          optimizer                 every per-step number matches, only the final
                                                    parameters differ
hooks                     hooks                     the hook sequence differs
counts                    counts                    the optimizer/scheduler step counts differ
unclassified              unclassified              none of the above
========================= ========================= ==================================================

Each rule has a unit test (``tests/test_diagnose_rules.py``) and is exercised
end to end with a deliberately broken strategy (``tests/test_conformance*.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from unison.conformance.diagnosis import declared, reported, resume, scale, update
from unison.conformance.diagnosis.evidence import Evidence, Finding
from unison.conformance.spec import Scenario

TITLES = {
    "undeclared_refusal": "refused something it declares supported",
    "error": "the run failed",
    "declaration": "a declaration the trainer does not honour",
    "premise": "the scenario's premise failed on the reference",
    "precision_not_applied": "the declared precision is not applied",
    "hard_coded_divisor": "gradients divided by a fixed number, not the world size",
    "partial_optimizer_state": "optimizer state restored only in part",
    "buffers_on_resume": "buffers not restored on resume",
    "resume_state": "state not restored on resume",
    "initial_weights": "replicas did not start from the reference's weights",
    "averaged_twice": "gradients averaged twice",
    "summed": "gradients summed, not averaged",
    "accumulation_scale": "loss scaled wrongly for accumulation",
    "tied_weight_twice": "a tied weight counted twice in the gradient norm",
    "norm_over_replicated_dim": "gradient norm reduced over a mesh dimension that replicates the gradients",
    "replica_desync": "replicas disagree with each other",
    "buffers": "buffer updates lost",
    "buffers_twice": "buffer updates applied more than once",
    "reduction_dtype": "gradients reduced in a lower precision than declared",
    "reduction_group": "gradients reduced over a subgroup of the data-parallel replicas",
    "param_groups": "the optimizer lost the factory's parameter groups",
    "state_dict_keys": "the state dict's names are not the model's own",
    "frozen_updated": "frozen parameters were updated",
    "feature_rng": "a module feature changed the dropout masks (RNG state not preserved)",
    "optimizer_state_roundtrip": "the checkpoint changed the optimizer state on the way",
    "clip_before_sync": "gradients clipped by each replica's local norm before they were synchronised",
    "reported_grad_norm": "the reported grad norm is the clipped one",
    "gradient_sync": "gradient sync contradicts the declaration",
    "uncapped_clip": "clip coefficient not capped at 1",
    "per_bucket_clip": "gradients clipped per bucket, not by the global norm",
    "optimizer": "optimizer update differs",
    "scheduler": "learning-rate schedule differs",
    "validation": "validation loss is not the per-sample mean over all replicas",
    "plugin_rng": "a plugin changed the training RNG state",
    "fresh_process_resume": "a resume in new processes differs from one in the same process",
    "loss_normalisation": "the declared loss normalisation misstates the gradient reduction",
    "hooks": "hook sequence differs",
    "counts": "step counts differ",
    "unclassified": "unclassified divergence",
}

Rule = Callable[[Evidence], "Finding | None"]

#: The rules in order of precedence (see the module table): the first finding wins.
RULES: tuple[Rule, ...] = (
    declared.undeclared_refusal,
    declared.plugin_rng,
    declared.run_error,
    declared.declaration,
    declared.premise,
    declared.precision_not_applied,
    reported.reduction_dtype,
    reported.reduction_group,
    reported.param_groups,
    reported.state_dict_keys,
    declared.validation,
    scale.hard_coded_divisor,
    resume.partial_optimizer_state,
    resume.buffers_on_resume,
    resume.fresh_process,
    reported.optimizer_state_roundtrip,
    resume.resume_state,
    reported.feature_rng,
    reported.frozen_updated,
    reported.buffers_twice,
    update.initial_weights,
    update.buffers_within_first_step,
    update.stale_buffers,
    reported.clip_before_sync,
    reported.reported_grad_norm,
    update.sync_off_boundary,
    scale.loss_normalisation,
    scale.gradient_scale,
    scale.norm_over_replicated_dim,
    scale.tied_weight_twice,
    update.replica_desync,
    update.only_buffers,
    update.buffers_first,
    update.gradient_sync,
    update.scheduler,
    update.clipping,
    update.optimizer_step,
    update.final_buffers,
    update.final_parameters,
    update.hooks,
    update.counts,
    update.unclassified,
)


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


def diagnose(
    scenario: Scenario, divergences: Sequence[Any], result: Any, reference: dict[str, dict[str, dict[str, Any]]]
) -> Diagnosis | None:
    """The likely broken rule behind ``divergences`` (earliest step first), or ``None`` when there are none."""
    if not divergences:
        return None
    evidence = Evidence(scenario, divergences, result, reference)
    for rule in RULES:
        found = rule(evidence)
        if found is not None:
            name, d, why = found
            return Diagnosis(name, d.run, d.step, d.quantity, why)
    raise AssertionError("unreachable: the last rule always answers")


__all__ = ["RULES", "TITLES", "Diagnosis", "diagnose"]
