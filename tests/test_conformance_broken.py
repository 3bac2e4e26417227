"""The conformance suite against deliberately broken strategies (``conformance_broken_strategies``).

One suite run (module fixture, 2-rank gloo worlds) certifies six strategies,
each plain data parallel with one defect, on the scenarios that can see it. A
certificate must mean exactly what it says: every broken one is "not certified"
with a diagnosis naming its defect, and the control (the same refusals,
declared) is certified with those scenarios listed as declared out.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from unison.conformance.compare import DECLARED_OUT, FAIL, PASS
from unison.conformance.report import SuiteReport, certify
from unison.conformance.runner import Suite, execute_run
from unison.conformance.scenarios import SCENARIOS_BY_NAME, Sizing

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

PLUGIN = "conformance_broken_strategies"
SCENARIOS = ["plain", "accumulation", "buffers", "replica_init", "resume"]
BROKEN = [
    "refuses_quietly",
    "refuses_declared",
    "skips_broadcast",
    "stale_buffers",
    "every_step_claims_boundary",
    "forgets_optimizer_state",
]


@pytest.fixture(scope="module", autouse=True)
def plugin_on_path():
    here = str(Path(__file__).resolve().parent)
    added = here not in sys.path
    if added:
        sys.path.insert(0, here)
    yield
    if added:
        sys.path.remove(here)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> SuiteReport:
    with Suite(
        world_size=2,
        scenarios=SCENARIOS,
        plugins=[PLUGIN],
        timeout=300,
        workdir=tmp_path_factory.mktemp("conformance-broken"),
    ) as suite:
        return certify(BROKEN, suite=suite, report_dir=tmp_path_factory.mktemp("conformance-broken-report"))


def _statuses(report: SuiteReport, name: str) -> dict[str, str]:
    return {n: v.status for n, v in report.verdicts[name].items()}


def test_an_undeclared_refusal_fails(report):
    v = report.verdicts["refuses_quietly"]
    statuses = _statuses(report, "refuses_quietly")
    assert statuses["plain"] == statuses["replica_init"] == statuses["resume"] == PASS
    accumulation, buffers = v["accumulation"], v["buffers"]
    assert accumulation.status == FAIL and buffers.status == FAIL
    assert accumulation.diagnosis.rule == "undeclared_refusal"
    assert "refused accumulate_grad_batches although it declares it supported" in accumulation.diagnosis.explanation
    assert "accumulation is not implemented beyond 2" in accumulation.divergences[0].got
    # A model-level refusal (the strategy's own validate_model), undeclared.
    assert "refused model although it declares it supported" in buffers.diagnosis.explanation
    cert = report.certificate("refuses_quietly")
    assert not cert.certified and {n for n, _ in cert.failed} == {"accumulation", "buffers"}
    assert report.exit_code == 1


def test_the_same_refusal_declared_is_declared_out(report):
    statuses = _statuses(report, "refuses_declared")
    assert statuses == {
        "plain": PASS,
        "accumulation": DECLARED_OUT,
        "buffers": DECLARED_OUT,
        "replica_init": DECLARED_OUT,
        "resume": DECLARED_OUT,
    }
    v = report.verdicts["refuses_declared"]
    assert "gradient_accumulation refused: accumulation is not implemented" in v["accumulation"].reason
    assert "buffers refused: models with buffers are not implemented" in v["buffers"].reason
    cert = report.certificate("refuses_declared")
    assert cert.certified and cert.proven == ["plain"]
    assert [n for n, _ in cert.declared_out] == ["accumulation", "buffers", "replica_init", "resume"]
    # The trainer refused accumulation from the declaration itself, before the strategy's validate ran.
    trace = next(r for r in report.results if r.name == "refuses_declared").traces["accumulation"]["main"]
    assert trace["refusal"]["type"] == "DeclaredRefusal" and trace["refusal"]["feature"] == "gradient_accumulation"


def test_skipping_the_initial_broadcast_fails_the_perturbed_init_check(report):
    statuses = _statuses(report, "skips_broadcast")
    # Every rank builds the same seeded model, so only the perturbed start shows the defect.
    assert statuses["plain"] == PASS and statuses["accumulation"] == PASS
    v = report.verdicts["skips_broadcast"]["replica_init"]
    assert v.status == FAIL
    assert v.diagnosis.rule == "initial_weights" and v.diagnosis.step == 0
    assert "Ownership.replica_init" in v.diagnosis.explanation
    assert any(d.quantity == "final state on rank 1" for d in v.divergences)  # and the replicas end apart
    assert not report.certificate("skips_broadcast").certified


def test_forgetting_buffer_updates_fails_buffers(report):
    statuses = _statuses(report, "stale_buffers")
    assert statuses["plain"] == PASS and statuses["buffers"] == FAIL
    v = report.verdicts["stale_buffers"]["buffers"]
    assert v.diagnosis.rule == "buffers", v.diagnosis.message()
    assert v.diagnosis.step == 0 and v.diagnosis.quantity == "micro-batch 1 loss"
    assert "still hold their initial values" in v.diagnosis.explanation
    assert any(d.kind == "buffer" and "at checkpoint" in d.quantity for d in v.divergences)


def test_every_micro_step_sync_declared_as_boundary_fails(report):
    statuses = _statuses(report, "every_step_claims_boundary")
    assert statuses["plain"] == PASS  # numerically right
    v = report.verdicts["every_step_claims_boundary"]["accumulation"]
    assert v.status == FAIL and v.max_param_deviation is not None and v.max_param_deviation < 1e-5
    assert v.diagnosis.rule == "gradient_sync"
    assert any("inside no_sync()" in d.quantity for d in v.divergences)
    assert any("before the last micro-step" in d.quantity for d in v.divergences)


def test_divergence_only_after_resume(report):
    statuses = _statuses(report, "forgets_optimizer_state")
    assert statuses["plain"] == PASS and statuses["resume"] == FAIL
    v = report.verdicts["forgets_optimizer_state"]["resume"]
    assert v.diagnosis.rule == "resume_state", v.diagnosis.message()
    # The first resumed step (3) already uses another lr: the optimizer's param groups carry it.
    assert v.diagnosis.run == "strategy:resumed" and v.diagnosis.step == 3
    assert v.diagnosis.quantity == "lr (group 0)" and "optimizer state" in v.diagnosis.explanation


def test_report_lists_proven_and_declared_out(report, tmp_path):
    report.write(tmp_path)
    html = (tmp_path / "report.html").read_text()
    assert 'id="certificate-refuses_declared"' in html
    assert "Declared out (4)" in html and "Proven (1)" in html
    assert "Likely cause: replicas did not start from the reference&#39;s weights" in html


# --------------------------------------------------------------------------- #
# The runner's classification, in this process
# --------------------------------------------------------------------------- #


def test_a_configuration_error_after_setup_is_an_error_not_a_refusal(monkeypatch):
    """Once fit has started the process group and the strategy's setup, a ConfigurationError is a failure."""
    import conformance_broken_strategies as broken

    from unison.errors import ConfigurationError

    def setup(self, *args, **kwargs):
        raise ConfigurationError("strategy", "cannot set up here", "nothing")

    monkeypatch.setattr(broken.RefusesQuietly, "setup", setup)
    scenario = SCENARIOS_BY_NAME["plain"]
    trace = execute_run(
        scenario,
        scenario.run("strategy", "main"),
        strategy="refuses_quietly",
        sizing=Sizing(1, 2),
        plugins=[PLUGIN],
        checkpoint_dir=None,
        resume_path=None,
    )
    assert trace["status"] == "error" and "cannot set up here" in trace["error"]
    # The same error before setup (the strategy's validate_model) is a refusal, for the comparison to judge.
    buffers = SCENARIOS_BY_NAME["buffers"]
    trace = execute_run(
        buffers,
        buffers.run("strategy", "main"),
        strategy="refuses_quietly",
        sizing=Sizing(1, 2),
        plugins=[PLUGIN],
        checkpoint_dir=None,
        resume_path=None,
    )
    assert trace["status"] == "refused" and trace["refusal"]["option"] == "model"
    assert trace["refusal"]["feature"] is None and not trace["refusal"]["in_constructor"]


def test_the_suites_runs_print_no_progress(capfd):
    """Every run's Trainer is built with progress="off": the suite's output is its report."""
    scenario = SCENARIOS_BY_NAME["plain"]
    run = scenario.run("reference", "main")
    assert scenario.trainer_settings(Sizing(1, 2), run)["progress"] == "off"
    trace = execute_run(
        scenario, run, strategy="single", sizing=Sizing(1, 2), plugins=[], checkpoint_dir=None, resume_path=None
    )
    assert trace["status"] == "ok" and len(trace["steps"]) == scenario.max_steps
    out, err = capfd.readouterr()
    # Without it, plain progress prints "train step k/6 | loss ..." lines here (not a terminal).
    assert "train step" not in out + err
