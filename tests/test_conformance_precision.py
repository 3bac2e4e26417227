"""The precision scenario proves its precision is applied (``conformance_broken_precision``).

One suite run (module fixture, 2-rank gloo worlds) certifies two strategies
that declare bf16-mixed supported and get it wrong, and ``ddp`` as the control,
on ``bf16_mixed``. The scenario measures its own sensitivity (the bf16
reference against its fp32 control run, in the same run) and probes the dtypes
a strategy really computes and updates in. A scenario whose effect is below
10x its tolerance is inconclusive, never passed: the original bf16 setup
(plain regression targets, where bf16 moves training only ~1.5e-3) is run here
in one process to show it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from unison.conformance.certificate import build_certificate
from unison.conformance.certification import certify
from unison.conformance.compare import judge_scenario
from unison.conformance.data import Sizing
from unison.conformance.execution import execute_run, make_plugin_manager
from unison.conformance.mutation import score
from unison.conformance.report import SuiteReport
from unison.conformance.scenarios import PRECISION_CONTROL, SCENARIOS_BY_NAME
from unison.conformance.sensitivity import SENSITIVITY_MIN
from unison.conformance.suite import StrategyResult, Suite
from unison.conformance.verdict import FAIL, INCONCLUSIVE, PASS, tolerance_for

from helpers import suite_report_dir

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

PLUGIN = "conformance_broken_precision"
SCENARIO = "bf16_mixed"
BROKEN = ["trains_fp32", "bf16_no_masters"]
CONTROL = "ddp"


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory) -> Path:
    return suite_report_dir(tmp_path_factory, "precision")


@pytest.fixture(scope="module")
def report(tmp_path_factory, report_dir) -> SuiteReport:
    with Suite(
        world_size=2,
        scenarios=[SCENARIO],
        plugins=[PLUGIN],
        timeout=300,
        workdir=tmp_path_factory.mktemp("conformance-precision"),
    ) as suite:
        return certify([*BROKEN, CONTROL], suite=suite, report_dir=report_dir)


def _result(report: SuiteReport, name: str) -> StrategyResult:
    return next(r for r in report.results if r.name == name)


def test_the_precision_scenario_sees_bf16_far_beyond_its_tolerance(report):
    v = report.verdicts[CONTROL][SCENARIO]
    sens = v.sensitivity
    tol = tolerance_for("bf16-mixed")
    # Measured in this run: the bf16 reference against its fp32 control run.
    assert sens["conclusive"] and sens["ratio"] >= SENSITIVITY_MIN
    assert sens["effect_param"] >= SENSITIVITY_MIN * tol.param
    assert sens["tolerance_param"] == tol.param
    assert any(c.startswith("sensitivity: bf16-mixed moves the reference") for c in v.checks)


def test_training_in_fp32_instead_of_bf16_is_not_certified(report):
    v = report.verdicts["trains_fp32"][SCENARIO]
    assert v.status == FAIL
    assert v.diagnosis.rule == "precision_not_applied"
    assert v.margin >= 10
    first = v.divergences[0]
    assert first.kind == "precision" and first.quantity == "Linear output dtype inside forward on rank 0"
    assert first.expected == "torch.bfloat16" and first.got.startswith("torch.float32")
    assert "never applied it" in v.diagnosis.explanation
    # The numeric comparison alone catches it too, with the same margin the sensitivity promises.
    state = [d for d in v.divergences if d.kind == "state"]
    assert state and max(d.deviation / d.tolerance for d in state) >= 10
    # The probe on every rank: every Linear output in fp32, no bf16 forward at all.
    for rank in _result(report, "trains_fp32").traces[SCENARIO]["main"]["ranks"]:
        assert set(rank["precision_probe"]["linear_outputs"]) == {"torch.float32"}
    assert not report.certificate("trains_fp32").certified


def test_bf16_weights_without_fp32_masters_are_not_certified(report):
    v = report.verdicts["bf16_no_masters"][SCENARIO]
    assert v.status == FAIL
    assert v.diagnosis.rule == "precision_not_applied"
    assert v.margin >= 10
    masters = [d for d in v.divergences if d.kind == "precision"]
    assert masters and all("fp32 master weights" in d.quantity for d in masters)
    assert masters[0].got == "torch.bfloat16 (433 of 433 elements)"
    assert "instead of fp32 master weights" in v.diagnosis.explanation
    for rank in _result(report, "bf16_no_masters").traces[SCENARIO]["main"]["ranks"]:
        probe = rank["precision_probe"]
        # Its forward is bf16 (the dtype probe alone would pass): only the masters probe sees it.
        assert set(probe["linear_outputs"]) == {"torch.bfloat16"}
        assert probe["optimizer_params"] == {"torch.bfloat16": 433}
    assert not report.certificate("bf16_no_masters").certified


def test_the_correct_control_is_certified_with_its_margins(report):
    v = report.verdicts[CONTROL][SCENARIO]
    assert v.status == PASS
    # Far inside the tolerance, while the effect is far outside it.
    assert v.deviation_ratio < 0.2
    assert v.sensitivity["effect_param"] >= 50 * v.max_param_deviation
    cert = report.certificate(CONTROL)
    assert cert.certified and cert.proven == [SCENARIO] and not cert.inconclusive
    assert cert.deviation_ratios[SCENARIO] == v.deviation_ratio
    for rank in _result(report, CONTROL).traces[SCENARIO]["main"]["ranks"]:
        probe = rank["precision_probe"]
        assert set(probe["linear_outputs"]) == {"torch.bfloat16"}  # autocast, inside forward
        assert set(probe["optimizer_params"]) == {"torch.float32"}  # fp32 masters


def test_report_json_html_and_mutation_score(report, report_dir):
    data = json.loads((report_dir / "report.json").read_text())
    verdicts = {s["name"]: s["verdicts"] for s in data["strategies"]}
    assert verdicts[CONTROL][SCENARIO]["sensitivity"]["conclusive"] is True
    assert verdicts["trains_fp32"][SCENARIO]["diagnosis"]["rule"] == "precision_not_applied"
    certs = {c["strategy"]: c for c in data["certificates"]}
    assert certs[CONTROL]["inconclusive"] == [] and certs[CONTROL]["passed"]
    result = score(data, BROKEN, [CONTROL])
    assert result.ok and set(result.caught) == set(BROKEN) and min(result.caught.values()) >= 10
    html = (report_dir / "report.html").read_text()
    assert "sensitivity: bf16-mixed moves the reference" in html


def test_a_scenario_whose_effect_is_below_ten_times_its_tolerance_is_inconclusive(tmp_path):
    """The original bf16 setup (plain regression targets): bf16 moves it only ~1.5e-3 from fp32, under a 5e-3
    tolerance. Run for real in this process (reference, its fp32 control, and ``single`` as the strategy)."""
    scenario = dataclasses.replace(
        SCENARIOS_BY_NAME[SCENARIO], name="bf16_mixed_plain_targets", model="mlp", data="regression"
    )
    sizing = Sizing(1, 2)
    reference, strategy = {}, {}
    for run in scenario.runs:
        trace = execute_run(
            scenario, run, strategy="single", sizing=sizing, plugins=(), checkpoint_dir=None, resume_path=None
        )
        assert trace["status"] == "ok", trace.get("error")
        (reference if run.backend == "reference" else strategy)[run.id] = trace
    ownership = make_plugin_manager().strategies.create("single").ownership
    result = StrategyResult(
        name="single",
        status="ran",
        ownership=ownership.to_dict(),
        world_size=1,
        alt_world_size=2,
        traces={scenario.name: strategy},
    )
    v = judge_scenario(scenario, result, {scenario.name: reference})
    # Every check held (single is the reference), yet nothing is proven.
    assert not v.divergences
    assert v.status == INCONCLUSIVE
    assert not v.sensitivity["conclusive"] and v.sensitivity["ratio"] < SENSITIVITY_MIN
    assert "inconclusive: the effect the scenario exists to see is only" in v.reason
    assert PRECISION_CONTROL in v.sensitivity["control"]
    cert = build_certificate(result, {scenario.name: v}, 1)
    assert not cert.certified and cert.label == "not certified"
    assert [n for n, _ in cert.inconclusive] == [scenario.name] and not cert.proven and not cert.failed
    assert "inconclusive" in cert.summary
    # The mutation score: a control with an inconclusive scenario fails as a control; a "broken" strategy
    # whose only non-pass is inconclusive is not caught.
    data = {
        "certificates": [{**cert.to_dict(), "strategy": "single"}],
        "strategies": [{"name": "single", "verdicts": {scenario.name: v.to_dict()}}],
    }
    assert score(data, [], ["single"]).controls_failed == ["single"]
    missed = score(data, ["single"])
    assert missed.missed == ["single"] and missed.inconclusive == ["single"]
    assert "not caught, only inconclusive: single" in missed.line()
