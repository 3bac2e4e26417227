"""The conformance suite at world 4 (2 replicas x 2 shards) against deliberately broken compositions
(``conformance_broken_composed``): each is ``hsdp`` or ``pipeline_fsdp`` with one mesh-specific defect, must
not be certified, and is diagnosed by name; ``hsdp`` itself is the control (``pipeline_fsdp`` is certified on
every scenario by ``.ci/run``)."""

from __future__ import annotations

import pytest

from unison.conformance.certification import certify
from unison.conformance.report import SuiteReport
from unison.conformance.suite import Suite
from unison.conformance.verdict import FAIL, PASS

from helpers import suite_report_dir

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

PLUGIN = "conformance_broken_composed"


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> SuiteReport:
    with Suite(
        world_size=4,
        scenarios=["plain", "accumulation"],
        plugins=[PLUGIN],
        timeout=300,
        workdir=tmp_path_factory.mktemp("conformance-broken-composed"),
    ) as suite:
        return certify(
            ["hsdp", "hsdp_norm_over_world", "hsdp_defers_replicate_only", "pipeline_fsdp_norm_over_dp"],
            suite=suite,
            report_dir=suite_report_dir(tmp_path_factory, "broken-composed"),
        )


def _statuses(report: SuiteReport, name: str) -> dict[str, str]:
    return {n: v.status for n, v in report.verdicts[name].items()}


def test_the_control_passes(report):
    assert _statuses(report, "hsdp") == {"plain": PASS, "accumulation": PASS}


def test_a_norm_reduced_over_the_replicate_dimension_too_is_diagnosed(report):
    v = report.verdicts["hsdp_norm_over_world"]["plain"]
    assert v.status == FAIL
    assert v.diagnosis.rule == "norm_over_replicated_dim", v.diagnosis.message()
    assert v.diagnosis.step == 0 and "sqrt(2)" in v.diagnosis.explanation and "'replicate'" in v.diagnosis.explanation
    assert not report.certificate("hsdp_norm_over_world").certified


def test_a_reduce_scatter_on_every_micro_step_declared_boundary_only_is_diagnosed(report):
    statuses = _statuses(report, "hsdp_defers_replicate_only")
    assert statuses["plain"] == PASS  # one micro-batch per step: nothing to defer, nothing to see
    v = report.verdicts["hsdp_defers_replicate_only"]["accumulation"]
    assert v.status == FAIL and v.diagnosis.rule == "gradient_sync", v.diagnosis.message()
    assert not report.certificate("hsdp_defers_replicate_only").certified


def test_a_norm_reduced_over_the_data_dimension_only_is_diagnosed(report):
    # Each pipeline stage reports (and clips by) its own stage's norm: the ranks of one world disagree on a
    # number that must be the same everywhere, and every stage's norm is below the model's.
    v = report.verdicts["pipeline_fsdp_norm_over_dp"]["plain"]
    assert v.status == FAIL
    assert v.diagnosis.rule == "replica_desync", v.diagnosis.message()
    assert v.diagnosis.quantity == "per-step numbers on rank 1", v.diagnosis.message()  # stage 1 vs stage 0
    assert not report.certificate("pipeline_fsdp_norm_over_dp").certified
