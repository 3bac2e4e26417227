"""Diagnoses decided by direct evidence (``conformance_broken_diagnoses``), with a correct control.

One suite run (module fixture, 2-rank gloo worlds) certifies eleven strategies, each plain data parallel
with one defect the suite used to name wrongly or did not see, and the control. Every broken one is not certified and
its diagnosis names its rule; the deciding check is categorical (collectives, key sets, parameter
groups, an error) or falls at least 10x outside its tolerance. Evidence: where the
reductions ran and in which dtype (the process group's own record), the state-dict key sets, the
optimizer's parameter groups, a scenario at another accumulation (accumulation = world size = 2 is
ambiguous), the counter of a buffer, the grad norm against the clip value, the error of a resume. A
second suite compiles (a compile path that draws from the training generator, a warm-up forward, against
the same strategy uncompiled, on a model with dropout) and reshards (the whole optimizer state a resume at
another world size gives back).
"""

from __future__ import annotations

import pytest

from unison.conformance.report import SuiteReport
from unison.conformance.verdict import FAIL, PASS

from helpers import assert_diagnosed, assert_mutation_score, mutation_suite

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

PLUGIN = "conformance_broken_diagnoses"
SCENARIOS = [
    "plain",
    "accumulation",
    "clipping",
    "buffers",
    "bf16_mixed",
    "resume",
    "activation_checkpointing_rng",
]
CONTROL = "diagnoses_control"
#: strategy -> (the scenario that sees it, the rule its diagnosis must name)
EXPECTED = {
    "clips_local_norm": ("clipping", "clip_before_sync"),
    "prefixed_state_dict": ("plain", "state_dict_keys"),
    "loss_divided_twice": ("clipping", "accumulation_scale"),
    "recomputes_forward": ("buffers", "buffers_twice"),
    "refuses_resume": ("resume", "undeclared_refusal"),
    "reports_clipped_norm": ("clipping", "reported_grad_norm"),
    "syncs_first_micro_step": ("accumulation", "gradient_sync"),
    # SGD's momentum 0.9 from the factory; the rebuilt optimizer has the class default, 0.
    "rebuilds_optimizer": ("plain", "param_groups"),
    "reduces_in_bf16": ("bf16_mixed", "reduction_dtype"),
    "recomputes_without_rng": ("activation_checkpointing_rng", "feature_rng"),
    "rounds_optimizer_state": ("resume", "optimizer_state_roundtrip"),
}
#: Compiled runs and a resume at another world size cost seconds per strategy: the mutants they are for and
#: the control have a suite of their own.
MORE = {
    "warms_up_compiled_forward": ("compile_rng", "feature_rng"),
    "rounds_optimizer_state": ("reshard", "optimizer_state_roundtrip"),
}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> SuiteReport:
    return mutation_suite(tmp_path_factory, "diagnoses", [CONTROL, *EXPECTED], plugin=PLUGIN, scenarios=SCENARIOS)


@pytest.fixture(scope="module")
def more_report(tmp_path_factory) -> SuiteReport:
    return mutation_suite(
        tmp_path_factory, "diagnoses-more", [CONTROL, *MORE], plugin=PLUGIN, scenarios=["compile_rng", "reshard"]
    )


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_diagnosis_names_the_rule_from_direct_evidence(report, name):
    # Categorical (no numeric divergence decides) or at least 10x outside the tolerance.
    assert_diagnosed(report, name, *EXPECTED[name], categorical=True)


def test_accumulation_equal_to_the_world_size_is_decided_by_another_scenario(report):
    verdicts = report.verdicts["loss_divided_twice"]
    failed = {n: v for n, v in verdicts.items() if v.status == FAIL}
    # Every failed scenario at accumulation 2 = world size 2 names the accumulation, never "averaged twice".
    rules = {n: v.diagnosis.rule for n, v in failed.items()}
    assert set(rules.values()) == {"accumulation_scale"}, rules
    assert "scenario 'plain'" in failed["clipping"].diagnosis.explanation or (
        "scenario 'accumulation'" in failed["clipping"].diagnosis.explanation
    )
    # At accumulation 1 dividing twice divides by 1: plain is proven.
    assert verdicts["plain"].status == PASS


def test_the_reduction_dtype_is_observed_for_the_control(report):
    checks = report.verdicts[CONTROL]["bf16_mixed"].checks
    assert any("every gradient reduction in fp32 (seen: float32" in c for c in checks), checks
    v = report.verdicts["reduces_in_bf16"]["bf16_mixed"]
    assert "bfloat16" in str(v.diagnosis.explanation)
    # Only bf16-mixed reduces in bf16: fp32 scenarios are proven.
    assert report.verdicts["reduces_in_bf16"]["plain"].status == PASS
    # The certificate shows what the reductions carried, per precision (report.json, terminal, HTML).
    assert report.certificate(CONTROL).gradient_reductions == {"32-true": ["float32"], "bf16-mixed": ["float32"]}
    assert "bfloat16" in report.certificate("reduces_in_bf16").gradient_reductions["bf16-mixed"]
    assert "gradient reductions carried 32-true: float32; bf16-mixed: float32" in report.to_html()


def test_the_correct_control_is_certified_on_the_same_scenarios(report):
    statuses = {n: v.status for n, v in report.verdicts[CONTROL].items()}
    assert statuses == dict.fromkeys(SCENARIOS, PASS)


def test_mutation_score_names_every_rule(report):
    from unison.conformance.mutation import score
    from unison.conformance.report import _sanitize

    assert_mutation_score(report, EXPECTED, CONTROL)
    # A wrong expectation is reported and fails the score.
    rules = {name: rule for name, (_, rule) in EXPECTED.items()}
    wrong = score(_sanitize(report.to_dict()), list(EXPECTED), controls=[CONTROL], rules={**rules, "x": "y"})
    assert not wrong.ok and "x diagnosed nothing, not y" in wrong.line()


def test_a_compile_path_that_draws_from_the_training_generator_is_seen(more_report):
    # The control compiled equals itself uncompiled up to fused rounding (the suite compiles onto eager's
    # generator, so the masks are the same); the warm-up forward shifts every later dropout mask (3e-2).
    control = more_report.verdicts[CONTROL]["compile_rng"]
    assert control.status == PASS and control.max_param_deviation < 1e-6, control.summary()
    assert_diagnosed(more_report, "warms_up_compiled_forward", *MORE["warms_up_compiled_forward"])
    d = more_report.verdicts["warms_up_compiled_forward"]["compile_rng"].diagnosis
    assert "compile=True" in d.explanation and "fallback_random" in d.explanation, d.message()


def test_a_resume_at_another_world_size_gives_back_the_whole_optimizer_state(more_report):
    # The control resharded 2 -> 1 and resumed under single: the whole state (parts held by several ranks
    # counted once) as written; moments written rounded to bf16 are seen at 1e-9 by a wide margin.
    checks = more_report.verdicts[CONTROL]["reshard"].checks
    assert any("whole optimizer state it resumed with (1 ranks) is the state the 2 ranks saved" in c for c in checks)
    assert more_report.verdicts[CONTROL]["reshard"].status == PASS
    assert_diagnosed(more_report, "rounds_optimizer_state", *MORE["rounds_optimizer_state"])
    assert_mutation_score(more_report, MORE, CONTROL)
