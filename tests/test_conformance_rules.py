"""Diagnoses that name the broken rule, by a wide margin (``conformance_broken_rules``).

One suite run (module fixture, 2-rank gloo worlds, the reshard runs at world
size 1) certifies seven strategies, each plain data parallel with one defect, and
the correct control, on the scenarios that can see them. Every broken one is
"not certified", its diagnosis names its rule, and the deciding check falls at
least 10x outside its tolerance; the control is certified on the same scenarios.
"""

from __future__ import annotations

import pytest

from unison.conformance.report import SuiteReport
from unison.conformance.verdict import FAIL, PASS

from helpers import assert_diagnosed, assert_mutation_score, mutation_suite

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

PLUGIN = "conformance_broken_rules"
SCENARIOS = ["clipping", "tied_weights", "frozen", "resume", "cross_resume", "reshard"]
CONTROL = "rules_control"
#: strategy -> (the scenario that sees it, the rule its diagnosis must name)
EXPECTED = {
    "per_bucket_clip": ("clipping", "per_bucket_clip"),
    "uncapped_clip": ("clipping", "uncapped_clip"),
    "hard_coded_divisor": ("reshard", "hard_coded_divisor"),
    "tied_weight_twice": ("tied_weights", "tied_weight_twice"),
    # Weight decay on a frozen parameter: the frozen weights moved while the reference kept them.
    "decays_frozen": ("frozen", "frozen_updated"),
    "drops_buffers_on_resume": ("resume", "buffers_on_resume"),
    "partial_optimizer_state": ("cross_resume", "partial_optimizer_state"),
}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> SuiteReport:
    return mutation_suite(tmp_path_factory, "rules", [CONTROL, *EXPECTED], plugin=PLUGIN, scenarios=SCENARIOS)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_diagnosis_names_the_broken_rule_by_a_wide_margin(report, name):
    assert_diagnosed(report, name, *EXPECTED[name])


def test_the_correct_control_is_certified_on_the_same_scenarios(report):
    statuses = {n: v.status for n, v in report.verdicts[CONTROL].items()}
    assert statuses == dict.fromkeys(SCENARIOS, PASS)
    # The clipping scenario's premise: clipped and unclipped steps, several of each, on the reference.
    assert any("at 3 steps or more and stays below it" in c for c in report.verdicts[CONTROL]["clipping"].checks)


def test_clipping_rules_point_at_the_step_that_shows_them(report):
    uncapped = report.verdicts["uncapped_clip"]["clipping"].diagnosis
    # Steps 0 and 1 are clipped (their updates match); step 2's pre-clip norm is below the clip value.
    assert uncapped.step == 3 and "below the clip" in uncapped.explanation, uncapped.message()
    assert "clipped updates before it (steps [0, 1]) match" in uncapped.explanation
    per_bucket = report.verdicts["per_bucket_clip"]["clipping"].diagnosis
    assert per_bucket.step == 1 and "own norm" in per_bucket.explanation, per_bucket.message()


def test_a_fixed_divisor_is_named_from_two_world_sizes(report):
    v = report.verdicts["hard_coded_divisor"]["reshard"]
    # Right at world 2 (the fixed 2 is the world size there): only the world-1 resume shows it.
    assert v.diagnosis.run == "strategy:resumed" and "world 2: matches" in v.diagnosis.explanation
    assert "world 1: 0.5x" in v.diagnosis.explanation and "fixed 2" in v.diagnosis.explanation
    statuses = {n: s.status for n, s in report.verdicts["hard_coded_divisor"].items()}
    assert statuses["clipping"] == statuses["resume"] == PASS


def test_mutation_score_every_rule_caught_by_a_wide_margin(report):
    result = assert_mutation_score(report, EXPECTED, CONTROL)
    _, margin = result.smallest_margin
    assert margin >= 10, result.line()


def test_a_clipping_reference_that_never_stays_under_the_clip_value_breaks_the_premise(report):
    """The clipping scenario proves nothing about the cap at 1 unless some steps stay under the clip value."""
    import copy

    from unison.conformance.compare import judge_scenario
    from unison.conformance.scenarios import SCENARIOS_BY_NAME

    scenario = SCENARIOS_BY_NAME["clipping"]
    result = next(r for r in report.results if r.name == CONTROL)
    reference = copy.deepcopy(report.reference)
    for s in reference["clipping"]["main"]["steps"]:
        s["grad_norm"] = max(s["grad_norm"], 1.5 * scenario.grad_clip_norm)
    v = judge_scenario(scenario, result, reference)
    assert v.status == FAIL and v.diagnosis.rule == "premise", v.summary()
    assert any(d.quantity == "premise: clipping straddles the clip value" for d in v.divergences)
