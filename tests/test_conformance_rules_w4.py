"""World 4 sees what world 2 cannot (``conformance_broken_rules``, 4-rank gloo worlds).

A strategy that divides the summed gradients by a fixed 2 and skips the all-reduce and the division at
world size 1 is right at world sizes 1 and 2; at world 4 its gradients are twice the reference's, and the
diagnosis names the fixed divisor from the ratio (world size / 2). The clipping rules are caught here
too, with the clip value of world 4's larger global batches (the ``straddles_clip`` premise holds at
world 4), each by a margin of 10 or more; the correct control is certified on the same scenarios. A
strategy that averages gradients within each pair of ranks (a "node") is right at world 2; at world 4 the
groups its reductions ran on (torch's flight recorder) join two ranks of four, ``reduction_group``.
"""

from __future__ import annotations

import pytest

from unison.conformance.report import SuiteReport
from unison.conformance.verdict import PASS

from helpers import assert_diagnosed, mutation_suite

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1200)]

PLUGIN = "conformance_broken_rules"
SCENARIOS = ["plain", "clipping"]
CONTROL = "rules_control"
#: strategy -> (the scenario that sees it, the rule its diagnosis must name)
EXPECTED = {
    "hard_coded_divisor_guarded": ("plain", "hard_coded_divisor"),
    "uncapped_clip": ("clipping", "uncapped_clip"),
    "per_bucket_clip": ("clipping", "per_bucket_clip"),
    "reduces_within_node": ("plain", "reduction_group"),
}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> SuiteReport:
    return mutation_suite(
        tmp_path_factory,
        "rules-w4",
        [CONTROL, *EXPECTED],
        plugin=PLUGIN,
        scenarios=SCENARIOS,
        world_size=4,
        timeout=600,
    )


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_world_4_names_the_broken_rule_by_a_wide_margin(report, name):
    assert_diagnosed(report, name, *EXPECTED[name])


def test_the_fixed_divisor_is_read_from_the_ratio_at_world_4(report):
    d = report.verdicts["hard_coded_divisor_guarded"]["plain"].diagnosis
    assert "world size / 2 = 4/2" in d.explanation and "fixed 2" in d.explanation, d.message()


def test_the_reduction_groups_are_read_from_the_flight_recorder_at_world_4(report):
    checks = report.verdicts[CONTROL]["plain"].checks
    assert any("join the 4 data-parallel replicas (ranks joined: [[0, 1, 2, 3]])" in c for c in checks), checks
    d = report.verdicts["reduces_within_node"]["plain"].diagnosis
    assert "[[0, 1], [2, 3]]" in d.explanation, d.message()


def test_the_control_is_certified_at_world_4_and_clipping_straddles_there(report):
    statuses = {n: v.status for n, v in report.verdicts[CONTROL].items()}
    assert statuses == dict.fromkeys(SCENARIOS, PASS)
    checks = report.verdicts[CONTROL]["clipping"].checks
    assert any("exceeds 1.5 at 3 steps or more and stays below it" in c for c in checks), checks
