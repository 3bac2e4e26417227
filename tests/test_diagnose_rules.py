"""Each diagnosis rule on its own: it fires on the pattern it names and not on a near miss.

The evidence is built by hand (divergences, a strategy result with traces, the
reference's traces) for a scenario of the real table; no process runs. The
end-to-end counterpart, deliberately broken strategies diagnosed by the whole
suite, is ``tests/test_conformance_broken.py`` and friends.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

from unison.conformance.diagnosis import declared, reported, resume, scale, update
from unison.conformance.diagnosis.evidence import Evidence
from unison.conformance.diagnosis.table import RULES, diagnose
from unison.conformance.models import build_model
from unison.conformance.scenarios import SCENARIOS_BY_NAME
from unison.conformance.verdict import Divergence


def div(kind: str, run: str = "strategy:main", quantity: str = "loss", step: int | None = 1, **kw: Any) -> Divergence:
    return Divergence("s", run, quantity, step=step, kind=kind, **kw)


def steps(first: int = 0, last: int = 5, norm: float = 1.0, lrs: int = 1) -> list[dict[str, Any]]:
    return [{"step": k, "grad_norm": norm, "lrs": [0.1] * lrs} for k in range(first, last + 1)]


def evidence(
    scenario: str,
    divergences: list[Divergence],
    traces: dict[str, dict[str, Any]] | None = None,
    reference: dict[str, dict[str, Any]] | None = None,
) -> Evidence:
    """Evidence for ``scenario``; strategy traces default to one ok ``main`` run at world size 2."""
    if traces is None:
        traces = {"main": {"status": "ok", "steps": steps(), "world_size": 2}}
    result = types.SimpleNamespace(traces={scenario: traces}, reference_traces={}, world_size=2)
    return Evidence(SCENARIOS_BY_NAME[scenario], divergences, result, {scenario: reference or {}})


def rule_of(found: Any) -> str | None:
    return None if found is None else found[0]


# -- the table ------------------------------------------------------------------------------------------ #


def test_the_table_ends_with_a_rule_that_always_answers() -> None:
    assert RULES[-1] is update.unclassified
    assert len(set(RULES)) == len(RULES)
    d = diagnose(SCENARIOS_BY_NAME["plain"], [div("other")], None, {})
    assert d is not None and d.rule == "unclassified"
    assert diagnose(SCENARIOS_BY_NAME["plain"], [], None, {}) is None


def test_precedence_the_first_rule_that_fires_names_the_diagnosis() -> None:
    # A refusal and an error together: the refusal comes first in the table.
    d = diagnose(SCENARIOS_BY_NAME["plain"], [div("run", note="boom"), div("refusal", note="no")], None, {})
    assert d is not None and d.rule == "undeclared_refusal" and d.explanation == "no"


# -- what the comparison already named ------------------------------------------------------------------ #


@pytest.mark.parametrize(
    ("rule", "kind", "name"),
    [
        (declared.undeclared_refusal, "refusal", "undeclared_refusal"),
        (declared.run_error, "run", "error"),
        (declared.declaration, "declaration", "declaration"),
        (declared.premise, "premise", "premise"),
    ],
)
def test_named_kind_rules(rule: Any, kind: str, name: str) -> None:
    assert rule_of(rule(evidence("plain", [div("loss"), div(kind)]))) == name
    assert rule(evidence("plain", [div("loss"), div("other")])) is None


def test_precision_not_applied() -> None:
    probe = div("precision", quantity="Linear output dtype", got="torch.float32", expected="torch.bfloat16")
    probe.deviation, probe.tolerance = 0.5, 0.1
    found = declared.precision_not_applied(evidence("bf16_mixed", [probe]))
    assert found is not None and found[0] == "precision_not_applied" and "did not compute in it" in found[2]
    assert declared.precision_not_applied(evidence("bf16_mixed", [div("loss")])) is None


def test_validation() -> None:
    assert rule_of(declared.validation(evidence("validation", [div("validation"), div("validation")]))) == "validation"
    assert declared.validation(evidence("validation", [div("validation"), div("loss")])) is None


# -- gradient scale ---------------------------------------------------------------------------------------- #


def test_hard_coded_divisor_across_two_world_sizes() -> None:
    traces = {
        "part": {"status": "ok", "steps": steps(), "world_size": 2},
        "resumed": {"status": "ok", "steps": steps(4), "world_size": 4},
    }
    # Divided by a fixed 2: ratio 1 at world 2 (no divergence), 2 at world 4.
    found = scale.hard_coded_divisor(
        evidence("reshard", [div("grad_norm", run="strategy:resumed", got=2.0, expected=1.0)], traces)
    )
    assert rule_of(found) == "hard_coded_divisor" and "fixed 2" in found[2]
    # Near miss: ratio 1/world at world 4 and a match at world 2 is no single divisor (4/0.25 = 16 vs 2).
    assert (
        scale.hard_coded_divisor(
            evidence("reshard", [div("grad_norm", run="strategy:resumed", got=0.25, expected=1.0)], traces)
        )
        is None
    )


@pytest.mark.parametrize(
    ("scenario", "ratio", "name"),
    [
        ("plain", 0.5, "averaged_twice"),
        ("plain", 2.0, "summed"),
        ("accumulation", 0.25, "accumulation_scale"),
        ("accumulation", 4.0, "accumulation_scale"),
    ],
)
def test_gradient_scale(scenario: str, ratio: float, name: str) -> None:
    assert rule_of(scale.gradient_scale(evidence(scenario, [div("grad_norm", got=ratio, expected=1.0)]))) == name
    # Near miss: 10% off the pattern (the match is 5%).
    assert scale.gradient_scale(evidence(scenario, [div("grad_norm", got=ratio * 1.1, expected=1.0)])) is None


def test_gradient_scale_needs_the_loss_equal_before() -> None:
    early_loss = div("loss", step=0)
    assert scale.gradient_scale(evidence("plain", [early_loss, div("grad_norm", got=0.5, expected=1.0)])) is None


def test_norm_over_replicated_dim() -> None:
    hsdp = {"mesh": {"dims": [{"name": "replicate", "size": None}, {"name": "shard", "size": 2}], "shape": "..."}}
    traces = {"main": {"status": "ok", "steps": steps(), "world_size": 4}}

    def found(ratio: float, ownership: Any = hsdp, losses: tuple[Divergence, ...] = ()) -> Any:
        e = evidence("plain", [*losses, div("grad_norm", got=ratio, expected=1.0)], traces)
        e.result.ownership = ownership
        return scale.norm_over_replicated_dim(e)

    name, _, why = found(2**0.5)
    assert name == "norm_over_replicated_dim" and "'replicate' or 'shard'" in why and "sqrt(2)" in why
    assert scale.mesh_dimension_sizes(hsdp, 8) == {"replicate": 4, "shard": 2}
    assert rule_of(found(2.0, {"mesh": {"dims": [{"name": "replicate", "size": None}, {"name": "shard", "size": 1}]}}))
    # Near misses: no declared mesh; a ratio no dimension explains; the loss already differs at that step.
    assert found(2**0.5, ownership={"mesh": None}) is None
    assert found(1.3) is None
    assert found(2**0.5, losses=(div("loss", step=1),)) is None


def test_tied_weight_twice() -> None:
    norm = div("grad_norm", got=1.3, expected=1.0)
    assert rule_of(scale.tied_weight_twice(evidence("tied_weights", [norm]))) == "tied_weight_twice"
    # Near misses: no tied weights in the model; a ratio above sqrt 2.
    assert scale.tied_weight_twice(evidence("plain", [norm])) is None
    assert scale.tied_weight_twice(evidence("tied_weights", [div("grad_norm", got=1.6, expected=1.0)])) is None


# -- resume ------------------------------------------------------------------------------------------------ #


def _resumed_traces(lrs: int = 2) -> dict[str, dict[str, Any]]:
    return {
        "full": {"status": "ok", "steps": steps(), "world_size": 2},
        "part": {"status": "ok", "steps": steps(0, 2), "world_size": 2},
        "resumed": {"status": "ok", "steps": steps(3, 5, lrs=lrs), "world_size": 2},
    }


def test_partial_optimizer_state() -> None:
    group1 = div("lr", run="strategy:resumed", quantity="lr (group 1)", step=3)
    found = resume.partial_optimizer_state(evidence("resume_adagrad", [group1], _resumed_traces()))
    assert rule_of(found) == "partial_optimizer_state" and "[1]" in found[2]
    # Near miss: every group differs.
    group0 = div("lr", run="strategy:resumed", quantity="lr (group 0)", step=3)
    assert resume.partial_optimizer_state(evidence("resume_adagrad", [group0, group1], _resumed_traces())) is None


def test_buffers_on_resume() -> None:
    scenario = SCENARIOS_BY_NAME["resume"]
    initial = dict(build_model(scenario.model).named_buffers())
    counter = next(n for n, v in initial.items() if not v.is_floating_point())
    traces = _resumed_traces(lrs=1)
    traces["part"]["buffer_snapshots"] = {3: {counter: initial[counter] + 6}}
    traces["resumed"]["state"] = {counter: initial[counter] + 6}
    reference = {"full": {"status": "ok", "steps": steps(), "state": {counter: initial[counter] + 12}}}
    final = div("buffer", run="strategy:resumed", quantity=f"final {counter}", step=None)
    assert rule_of(resume.buffers_on_resume(evidence("resume", [final], traces, reference))) == "buffers_on_resume"
    # Near miss: behind by another amount than it had counted at the checkpoint.
    traces["resumed"]["state"] = {counter: initial[counter] + 7}
    assert resume.buffers_on_resume(evidence("resume", [final], traces, reference)) is None


def test_resume_state() -> None:
    late = div("loss", run="strategy:resumed", step=5)
    found = resume.resume_state(evidence("resume_sgd", [late], _resumed_traces(lrs=1)))
    assert rule_of(found) == "resume_state" and "optimizer state" in found[2] and "(full, part)" in found[2]
    # Near miss: a run that does not resume diverges too.
    assert resume.resume_state(evidence("resume_sgd", [late, div("loss", run="strategy:full")])) is None


def test_plugin_rng() -> None:
    guard = div("run", note="error: unison.errors.PluginError: a plugin changed the training RNG state during x")
    found = declared.plugin_rng(evidence("default_plugins", [guard]))
    assert rule_of(found) == "plugin_rng" and "UNISON_CHECK_PLUGIN_RNG=1" in found[2]
    # Near miss: another error (run_error's).
    assert declared.plugin_rng(evidence("default_plugins", [div("run", note="error: RuntimeError: boom")])) is None


def test_fresh_process() -> None:
    fresh = div("state", run="strategy:resumed", quantity="final parameter '0.weight'", step=None)
    fresh.deviation, fresh.tolerance = 1e-3, 1e-5
    found = resume.fresh_process(evidence("fresh_resume", [fresh]))
    assert rule_of(found) == "fresh_process_resume" and "once per process" in found[2]
    # Near miss: the resume in the process that saved diverges too.
    here = div("loss", run="strategy:resumed_here", step=4)
    assert resume.fresh_process(evidence("fresh_resume", [fresh, here])) is None


def test_loss_normalisation() -> None:
    traces = {"main": {"status": "ok", "steps": steps(), "world_size": 2, "data_parallel_size": 2}}

    def declared_as(replicas: str, ratio: float, scenario: str = "token_loss") -> Any:
        e = evidence(scenario, [div("grad_norm", quantity="grad_norm", step=0, got=ratio, expected=1.0)], traces)
        e.result.ownership = {"loss_normalisation": {"replicas": replicas, "divisor": "micro-batches"}}
        return scale.loss_normalisation(e)

    found = declared_as("sum", 0.5)
    assert rule_of(found) == "loss_normalisation" and "replicas: sum" in found[2] and "averages" in found[2]
    assert rule_of(declared_as("mean", 2.0, "token_loss_hf")) == "loss_normalisation"
    # Near misses: "mean" declared and half the norm is gradients averaged twice; a scalar-loss scenario.
    assert declared_as("mean", 0.5) is None
    assert declared_as("sum", 0.5, "plain") is None


# -- where training first left the reference ---------------------------------------------------------------- #


def test_initial_weights() -> None:
    first = div("loss", quantity="micro-batch 0 loss", step=0)
    assert rule_of(update.initial_weights(evidence("plain", [first]))) == "initial_weights"
    # Near miss: a later step.
    assert update.initial_weights(evidence("plain", [div("loss", quantity="micro-batch 0 loss", step=2)])) is None


def test_buffers_within_first_step() -> None:
    second = div("loss", quantity="micro-batch 1 loss", step=0)
    assert rule_of(update.buffers_within_first_step(evidence("buffers", [second]))) == "buffers"
    first = div("loss", quantity="micro-batch 0 loss", step=0)
    assert update.buffers_within_first_step(evidence("buffers", [first, second])) is None


def test_stale_buffers() -> None:
    initial = dict(build_model(SCENARIOS_BY_NAME["buffers"].model).named_buffers())
    traces = {"main": {"status": "ok", "steps": steps(), "world_size": 2, "buffer_snapshots": {3: initial}}}
    found = update.stale_buffers(evidence("buffers", [div("buffer", step=2)], traces))
    assert rule_of(found) == "buffers" and "still hold" in found[2]
    moved = {n: v + 1 for n, v in initial.items()}
    traces["main"]["buffer_snapshots"] = {3: moved}
    assert update.stale_buffers(evidence("buffers", [div("buffer", step=2)], traces)) is None


def test_replica_desync() -> None:
    assert rule_of(update.replica_desync(evidence("plain", [div("loss"), div("rank")]))) == "replica_desync"
    assert update.replica_desync(evidence("plain", [div("loss")])) is None


def test_only_buffers() -> None:
    assert rule_of(update.only_buffers(evidence("buffers", [div("buffer"), div("hooks")]))) == "buffers"
    assert update.only_buffers(evidence("buffers", [div("buffer"), div("state")])) is None


def test_buffers_first() -> None:
    assert rule_of(update.buffers_first(evidence("buffers", [div("buffer", step=1), div("loss", step=2)]))) == "buffers"
    assert update.buffers_first(evidence("buffers", [div("loss", step=1), div("buffer", step=2)])) is None


def test_gradient_sync() -> None:
    assert rule_of(update.gradient_sync(evidence("accumulation", [div("loss"), div("boundary")]))) == "gradient_sync"
    assert update.gradient_sync(evidence("accumulation", [div("loss"), div("counts")])) is None


def test_scheduler() -> None:
    assert rule_of(update.scheduler(evidence("lr_scheduler", [div("lr"), div("loss", step=2)]))) == "scheduler"
    assert update.scheduler(evidence("lr_scheduler", [div("loss"), div("lr", step=2)])) is None


@pytest.mark.parametrize(("norm_before", "name"), [(1.0, "uncapped_clip"), (3.0, "per_bucket_clip")])
def test_clipping(norm_before: float, name: str) -> None:
    # clipping clips at 2.0; the loss first differs at step 3, after step 2's update.
    reference = {"main": {"status": "ok", "steps": [*steps(0, 1, norm=3.0), *steps(2, 2, norm=norm_before)]}}
    assert rule_of(update.clipping(evidence("clipping", [div("loss", step=3)], reference=reference))) == name
    # Near miss: the same divergence in a scenario that does not straddle a clip value.
    assert update.clipping(evidence("plain", [div("loss", step=3)], reference=reference)) is None


def test_optimizer_step() -> None:
    assert rule_of(update.optimizer_step(evidence("plain", [div("loss", step=3)]))) == "optimizer"
    # Near miss: the grad norm differed first (the gradients were wrong, not the update).
    assert update.optimizer_step(evidence("plain", [div("grad_norm", step=2), div("loss", step=3)])) is None


def test_final_buffers() -> None:
    final = [div("state", step=None), div("buffer", step=None)]
    assert rule_of(update.final_buffers(evidence("buffers", final))) == "buffers"
    assert update.final_buffers(evidence("buffers", [div("state", step=None)])) is None


def test_final_parameters() -> None:
    assert rule_of(update.final_parameters(evidence("plain", [div("state", step=None)]))) == "optimizer"
    assert update.final_parameters(evidence("plain", [div("loss", step=3), div("state", step=None)])) is None


def test_hooks_and_counts() -> None:
    assert rule_of(update.hooks(evidence("plain", [div("hooks")]))) == "hooks"
    assert update.hooks(evidence("plain", [div("counts")])) is None
    assert rule_of(update.counts(evidence("plain", [div("counts")]))) == "counts"
    assert update.counts(evidence("plain", [div("hooks")])) is None


def test_every_rule_in_the_table_has_a_test_here() -> None:
    text = Path(__file__).read_text()
    untested = [r.__name__ for r in RULES if f".{r.__name__}" not in text.replace(" RULES", "")]
    assert not untested, untested


def test_diagnose_builds_the_diagnosis_from_the_finding() -> None:
    e = evidence("plain", [div("grad_norm", quantity="grad norm", got=0.5, expected=1.0)])
    d = diagnose(e.scenario, e.divergences, e.result, e.reference)
    assert d is not None and (d.rule, d.run, d.step, d.quantity) == ("averaged_twice", "strategy:main", 1, "grad norm")
    assert d.message().startswith("gradients averaged twice: first seen in grad norm at step 1 (strategy:main).")


def test_the_package_exports_the_objects_not_modules_of_the_same_name() -> None:
    # A submodule named like an exported function would shadow it once imported
    # (``from unison.conformance import diagnose`` would give the module).
    import importlib

    import unison.conformance as package

    for name, module in package._EXPORTS.items():
        importlib.import_module(module)
        value = getattr(package, name)
        assert not isinstance(value, types.ModuleType), name
        assert value is getattr(importlib.import_module(module), name)


@pytest.mark.parametrize(
    ("ratio", "world", "rule"),
    [
        (2.0, 4, "hard_coded_divisor"),  # summed over 4, divided by a fixed 2
        (4 / 3, 4, "hard_coded_divisor"),  # ... by a fixed 3
        (2.0, 2, "summed"),  # at world 2 a ratio of 2 is the world size itself
        (2.3, 4, None),  # near miss: no fixed divisor explains it
        (1.0, 4, None),
    ],
)
def test_ratio_pattern_reads_a_fixed_divisor_from_one_world_of_3_or_more(ratio, world, rule):
    found = scale.ratio_pattern(ratio, world, accumulation=1)
    assert (found[0] if found else None) == rule, found


# -- evidence of what the strategy built, sent and reported (diagnosis.reported) -------------------------- #


def test_reduction_dtype_and_param_groups_name_their_own_divergences() -> None:
    low = div("reduction", quantity="gradient reduction dtype", got="bfloat16 x4", note="under bf16-mixed ...")
    assert rule_of(reported.reduction_dtype(evidence("bf16_mixed", [low, div("loss")]))) == "reduction_dtype"
    assert reported.reduction_dtype(evidence("bf16_mixed", [div("loss")])) is None
    groups = div("groups", quantity="parameter groups on rank 0", expected=[{"weight_decay": 0.1}], got=[{}])
    assert rule_of(reported.param_groups(evidence("lr_scheduler", [groups, div("counts")]))) == "param_groups"
    assert reported.param_groups(evidence("lr_scheduler", [div("counts")])) is None


def test_state_dict_keys_names_a_wrapper_prefix() -> None:
    model = {"0.bias": torch.zeros(1), "0.weight": torch.zeros(1)}
    prefixed = {f"module.{k}": v for k, v in model.items()}
    keys = div("state", quantity="state_dict keys", step=None, against="reference:main")
    found = reported.state_dict_keys(evidence("plain", [keys], {"main": _ok(prefixed)}, {"main": _ok(model)}))
    assert rule_of(found) == "state_dict_keys" and "'module.'" in found[2]
    renamed = {"0.weight": torch.zeros(1), "x": torch.zeros(1)}
    e = evidence("plain", [keys], {"main": _ok(renamed)}, {"main": _ok(model)})
    assert "prefix" not in reported.state_dict_keys(e)[2]
    # Near miss: values differ under the same names.
    assert reported.state_dict_keys(evidence("plain", [div("state", quantity="state['0.weight']")])) is None


def _ok(state: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"status": "ok", "steps": steps(), "world_size": 2, "state": state, **kw}


def test_frozen_updated_compares_with_the_initial_frozen_weights() -> None:
    initial = build_model(SCENARIOS_BY_NAME["frozen"].model).state_dict()
    moved = {k: v + 0.01 if k.startswith("0.") else v for k, v in initial.items()}
    found = reported.frozen_updated(evidence("frozen", [div("loss")], {"main": _ok(moved)}, {"main": _ok(initial)}))
    assert rule_of(found) == "frozen_updated" and "0.weight" in found[2]
    # Near miss: the frozen layer kept its values (something else differs).
    kept = {k: v + 0.01 if k.startswith("2.") else v for k, v in initial.items()}
    assert (
        reported.frozen_updated(evidence("frozen", [div("loss")], {"main": _ok(kept)}, {"main": _ok(initial)})) is None
    )


def test_buffers_twice_reads_the_counter() -> None:
    ref = build_model(SCENARIOS_BY_NAME["buffers"].model).state_dict()
    start = int(ref["1.num_batches_tracked"])
    ref["1.num_batches_tracked"] = torch.tensor(start + 12)
    doubled = {**ref, "1.num_batches_tracked": torch.tensor(start + 24)}
    e = evidence("buffers", [div("buffer", quantity="buffer")], {"main": _ok(doubled)}, {"main": _ok(ref)})
    found = reported.buffers_twice(e)
    assert rule_of(found) == "buffers_twice" and "2x" in found[2]
    # Near misses: a counter never updated (0, a multiple of nothing), counts equal.
    stale = {**ref, "1.num_batches_tracked": torch.tensor(start)}
    e = evidence("buffers", [div("buffer", quantity="buffer")], {"main": _ok(stale)}, {"main": _ok(ref)})
    assert reported.buffers_twice(e) is None
    e = evidence("buffers", [div("buffer", quantity="buffer")], {"main": _ok(ref)}, {"main": _ok(ref)})
    assert reported.buffers_twice(e) is None


def test_clip_before_sync_needs_reductions_only_inside_clipping() -> None:
    inside = {"reductions_in_clip": 2, "gradient_sync_per_step": [0, 0]}
    e = evidence("clipping", [div("sync")], {"main": _ok({}, collectives=inside)})
    assert rule_of(reported.clip_before_sync(e)) == "clip_before_sync"
    both = {"reductions_in_clip": 2, "gradient_sync_per_step": [1, 1]}
    assert reported.clip_before_sync(evidence("clipping", [div("sync")], {"main": _ok({}, collectives=both)})) is None


def test_reported_grad_norm_is_the_clip_value_with_the_update_right() -> None:
    clip = SCENARIOS_BY_NAME["clipping"].grad_clip_norm
    assert clip == 2.0
    capped = div("grad_norm", quantity="grad norm", got=float(clip), expected=2.63)
    assert rule_of(reported.reported_grad_norm(evidence("clipping", [capped]))) == "reported_grad_norm"
    # Near miss: the losses differ too (the update is wrong, not only the report).
    assert reported.reported_grad_norm(evidence("clipping", [capped, div("loss", step=2)])) is None
    below = div("grad_norm", quantity="grad norm", got=float(clip), expected=1.5)
    assert reported.reported_grad_norm(evidence("clipping", [below])) is None


def test_sync_off_boundary_names_the_micro_step() -> None:
    early = div("sync", quantity="gradient collectives inside no_sync() on rank 0", got=1, expected=0)
    found = update.sync_off_boundary(evidence("accumulation", [div("rank"), early]))
    assert rule_of(found) == "gradient_sync" and "before the last micro-step" in found[2]
    never = div("sync", quantity="gradient collectives on rank 0", got=0, expected=">= 1")
    assert update.sync_off_boundary(evidence("accumulation", [div("rank"), never])) is None


def test_undeclared_refusal_of_a_resume() -> None:
    error = "Traceback ...\nNotImplementedError: resuming from a checkpoint is not implemented"
    traces = {"resumed": {"status": "error", "error": error, "world_size": 2}}
    e = evidence("resume", [div("run", run="strategy:resumed", quantity="run", step=None)], traces)
    e.result.ownership = {"refuses": {}}
    assert rule_of(declared.undeclared_refusal(e)) == "undeclared_refusal"
    e.result.ownership = {"refuses": {"resume": "not implemented"}}
    assert declared.undeclared_refusal(e) is None
    crash = {"resumed": {"status": "error", "error": "Traceback ...\nRuntimeError: boom", "world_size": 2}}
    e = evidence("resume", [div("run", run="strategy:resumed", quantity="run", step=None)], crash)
    e.result.ownership = {"refuses": {}}
    assert declared.undeclared_refusal(e) is None


def test_accumulation_equal_to_the_world_size_is_decided_by_another_scenario() -> None:
    ambiguous = div("grad_norm", quantity="grad norm", step=0, got=0.5, expected=1.0)
    for plain_ratio, name in ((1.0, "accumulation_scale"), (0.5, "averaged_twice")):
        e = evidence("clipping", [ambiguous])
        e.result.traces["plain"] = {"main": {"status": "ok", "world_size": 2, "steps": steps(norm=plain_ratio)}}
        e.reference["plain"] = {"main": {"status": "ok", "steps": steps()}}
        found = scale.gradient_scale(e)
        assert rule_of(found) == name and "scenario 'plain'" in found[2], found


def test_feature_rng_needs_dropout_and_the_strategy_without_the_feature() -> None:
    against_off = div("loss", run="strategy:on", against="strategy:off")
    found = reported.feature_rng(evidence("activation_checkpointing_rng", [against_off]))
    assert rule_of(found) == "feature_rng" and "activation_checkpointing='full'" in found[2]
    assert "recomputed forward" in found[2]
    compiled = reported.feature_rng(evidence("compile_rng", [against_off]))
    assert rule_of(compiled) == "feature_rng" and "compile=True" in compiled[2] and "fallback_random" in compiled[2]
    # Near misses: the run without the feature diverging; a model without Dropout.
    off = div("loss", run="strategy:off", against="reference:off")
    assert reported.feature_rng(evidence("activation_checkpointing_rng", [off])) is None
    assert reported.feature_rng(evidence("activation_checkpointing", [div("loss", against="reference:main")])) is None


def test_optimizer_state_roundtrip_leaves_missing_entries_to_resume_state() -> None:
    rounded = div("optimizer_state", run="strategy:resumed", step=None, got="exp_avg: sum of |values| 1 saved, 2")
    found = reported.optimizer_state_roundtrip(evidence("resume", [rounded]))
    assert rule_of(found) == "optimizer_state_roundtrip" and "exp_avg" in found[2]
    lost = div("optimizer_state", run="strategy:resumed", step=None, got="momentum_buffer: not restored")
    assert reported.optimizer_state_roundtrip(evidence("resume", [lost])) is None
    assert reported.optimizer_state_roundtrip(evidence("resume", [div("loss")])) is None
    # Replicas apart: one replica's state was written, and the other loads it.
    assert reported.optimizer_state_roundtrip(evidence("resume", [rounded, div("rank")])) is None


def test_roundtrip_differences_name_each_entry() -> None:
    from unison.conformance.checks.reported import roundtrip_differences

    saved = {
        "exp_avg": {"dtypes": ["float32"], "count": 2, "total": 1.5, "scalars": []},
        "step": {"dtypes": ["float32"], "count": 2, "total": 6.0, "scalars": [3.0]},
    }
    assert roundtrip_differences(saved, saved) == []
    rounded = {**saved, "exp_avg": {**saved["exp_avg"], "total": 1.5 * (1 + 1e-6)}}
    assert roundtrip_differences(saved, rounded) == ["exp_avg: sum of |values| 1.5 saved, 1.5000015 loaded"]
    reset = {**saved, "step": {**saved["step"], "scalars": [0.0]}}
    assert roundtrip_differences(saved, reset) == ["step: values [3.0] saved, [0.0] loaded"]
    assert roundtrip_differences(saved, {"step": saved["step"]}) == ["exp_avg: not restored"]
    halved = {**saved, "exp_avg": {**saved["exp_avg"], "dtypes": ["bfloat16"]}}
    assert roundtrip_differences(saved, halved) == ["exp_avg: dtype float32 saved, bfloat16 loaded"]


def test_a_resume_across_world_sizes_compares_the_whole_optimizer_state() -> None:
    from unison.conformance.checks.numeric import Checker
    from unison.conformance.checks.reported import check_optimizer_roundtrip, whole_state
    from unison.conformance.verdict import TOLERANCES

    def entry(total: float, count: int = 1, step: float = 3.0) -> dict[str, Any]:
        return {
            "exp_avg": {
                "dtypes": ["float32"],
                "count": count,
                "total": total,
                "scalars": [total] if count == 1 else [],
            },
            "step": {"dtypes": ["float32"], "count": count, "total": step * count, "scalars": [step]},
        }

    # Two shards written at world 2 and the whole state loaded at world 1 (a flat shard against per-parameter
    # tensors: other entry counts and one-element values); replicas counted once.
    shards = [entry(1.0, count=1), entry(2.0, count=3)]
    whole = entry(3.0, count=2)
    assert whole_state(shards)["exp_avg"]["total"] == 3.0 == whole_state([whole, whole])["exp_avg"]["total"]
    run = SCENARIOS_BY_NAME["reshard"].run("strategy", "resumed")
    part = {"ranks": [{"saved_optimizer_state": {"3": s}} for s in shards]}

    def failures(loaded: list[dict[str, Any]]) -> list[str]:
        c = Checker(SCENARIOS_BY_NAME["reshard"], TOLERANCES["32-true"])
        trace = {"ranks": [{"loaded_optimizer_state": s} for s in loaded], "steps": steps(3)}
        check_optimizer_roundtrip(c, run, "strategy:resumed", trace, part)
        assert any("whole optimizer state" in check for check in c.checks), c.checks
        return [str(d.got) for d in c.divergences]

    assert failures([whole]) == []
    assert failures([entry(1.25), entry(1.75)]) == []  # resharded over two ranks another way
    assert failures([entry(3.0 * (1 + 1e-7))]) == ["exp_avg: sum of |values| 3 saved, 3.0000003 loaded"]
    assert failures([entry(3.0, step=0.0)]) == ["step: values [3.0] saved, [0.0] loaded"]
    assert failures([{"step": whole["step"]}]) == ["exp_avg: not restored"]

    # A part several ranks hold counts once: HSDP at world 4 (two shards, each on two ranks); tensor parallel
    # at world 2 (a layer left whole on both ranks, and a split one).
    def parts(*held: tuple[list[int], list[int], float]) -> dict[str, Any]:
        return {"exp_avg": {"dtypes": ["float32"], "count": len(held), "total": 0.0, "scalars": [], "parts": held}}

    a, b = ([16], [8], 1.0), ([16], [8], 2.0)
    assert whole_state([parts(a), parts(b), parts(a), parts(b)])["exp_avg"]["total"] == 3.0
    head = ([1, 16], [1, 16], 1.5)
    tp = whole_state([parts(head, ([16, 16], [16, 8], 0.25)), parts(head, ([16, 16], [16, 8], 0.5))])
    assert tp["exp_avg"]["total"] == 2.25
    # Two equal parts on one rank are two tensors.
    assert whole_state([parts(a, a), parts(a)])["exp_avg"]["total"] == 2.0


def test_the_reduction_groups_must_join_every_data_parallel_replica() -> None:
    from unison.conformance.checks.numeric import Checker
    from unison.conformance.checks.sync import check_reduction_groups, reduction_components
    from unison.conformance.verdict import TOLERANCES

    def rank(groups: dict[str, list[int]], used: list[str]) -> dict[str, Any]:
        return {"process_groups": groups, "collectives": {"gradient_groups": dict.fromkeys(used, 1)}}

    world = {"0": [0, 1, 2, 3]}
    # HSDP at world 4: a shard group and a replicate group per rank join all four.
    shard = {"1": [0, 1], "2": [2, 3], "3": [0, 2], "4": [1, 3]}
    hsdp = [rank(shard, ["1", "3"]), rank(shard, ["1", "4"]), rank(shard, ["2", "3"]), rank(shard, ["2", "4"])]
    assert reduction_components({"ranks": hsdp}) == [[0, 1, 2, 3]]
    assert reduction_components({"ranks": [rank(world, ["0"])] * 4}) == [[0, 1, 2, 3]]

    def failures(ranks: list[dict[str, Any]], dp: int = 4) -> list[str]:
        c = Checker(SCENARIOS_BY_NAME["plain"], TOLERANCES["32-true"])
        check_reduction_groups(c, "strategy:main", {"ranks": ranks, "data_parallel_size": dp})
        return [d.kind for d in c.divergences]

    assert failures(hsdp) == [] and failures([rank(world, ["0"])] * 4) == []
    nodes = {"1": [0, 1], "2": [2, 3]}
    pairs = [rank(nodes, ["1"]), rank(nodes, ["1"]), rank(nodes, ["2"]), rank(nodes, ["2"])]
    assert failures(pairs) == ["reduction_group"]
    # Two data-parallel replicas of two tensor-parallel ranks: pairs are right.
    assert failures(pairs, dp=2) == []
    # Nothing recorded (one replica, or no flight recorder): no check.
    assert failures([rank({}, [])] * 4) == [] and failures(pairs, dp=1) == []


def test_reduction_group_names_the_ranks_joined() -> None:
    d = div("reduction_group", quantity="gradient reduction groups", step=None, got="ranks joined: [[0, 1], [2, 3]]")
    d.note = "the gradients were reduced over [0, 1] only, not over all 4 data-parallel replicas"
    found = reported.reduction_group(evidence("plain", [div("rank"), d]))
    assert rule_of(found) == "reduction_group" and "[[0, 1], [2, 3]]" in found[2] and "[0, 1] only" in found[2]
    assert reported.reduction_group(evidence("plain", [div("rank")])) is None


def test_param_groups_compare_the_hyperparameters_both_optimizers_have() -> None:
    from unison.conformance.checks.numeric import Checker
    from unison.conformance.checks.reported import check_param_groups
    from unison.conformance.verdict import TOLERANCES

    def failures(groups_per_rank: list[list[dict[str, Any]]]) -> list[str]:
        c = Checker(SCENARIOS_BY_NAME["lr_scheduler"], TOLERANCES["32-true"])
        check_param_groups(c, "strategy:main", {"ranks": [{"param_groups": g} for g in groups_per_rank]}, reference)
        return [d.quantity for d in c.divergences]

    adamw = {"betas": [0.9, 0.999], "eps": 1e-8, "amsgrad": False, "maximize": False}
    reference = {"param_groups": [{**adamw, "weight_decay": 0.1}, {**adamw, "weight_decay": 0.0}]}
    # Another Adam class built from the factory's groups, without amsgrad/maximize: the same groups.
    fused = [
        {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1},
        {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
    ]
    assert failures([fused, fused]) == []
    # Sharded: each rank steps one of the groups; together they are the factory's.
    assert failures([fused[:1], fused[1:]]) == []
    # Rebuilt from module.parameters(): one group with the default decay.
    assert failures([[{**adamw, "weight_decay": 0.01}]] * 2) == ["parameter groups on rank 0"]
    # One group lost on every rank.
    assert failures([fused[:1], fused[:1]]) == ["parameter groups over all ranks"]
    # No optimizer recorded.
    c = Checker(SCENARIOS_BY_NAME["lr_scheduler"], TOLERANCES["32-true"])
    check_param_groups(c, "strategy:main", {"ranks": [{}]}, reference)
    assert [d.quantity for d in c.divergences] == ["parameter groups on rank 0"]
