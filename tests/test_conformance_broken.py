"""The conformance suite against deliberately broken strategies (``conformance_broken_strategies``).

One suite run (module fixture, 2-rank gloo worlds) certifies six strategies,
each plain data parallel with one defect, on the scenarios that can see it. A
certificate must mean exactly what it says: every broken one is "not certified"
with a diagnosis naming its defect, and the control (the same refusals,
declared) is certified with those scenarios listed as declared out.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unison.conformance.certification import certify
from unison.conformance.data import Sizing
from unison.conformance.execution import execute_run
from unison.conformance.report import SuiteReport
from unison.conformance.scenarios import SCENARIOS_BY_NAME
from unison.conformance.suite import Suite
from unison.conformance.verdict import DECLARED_OUT, FAIL, PASS

from helpers import mutation_suite, suite_report_dir

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

PLUGIN = "conformance_broken_strategies"
SCENARIOS = ["plain", "validation", "accumulation", "buffers", "replica_init", "resume", "resume_sgd"]
BROKEN = [
    "refuses_quietly",
    "refuses_declared",
    "skips_broadcast",
    "stale_buffers",
    "every_step_claims_boundary",
    "forgets_optimizer_state",
    "per_rank_val_mean",
    "batch_mean_over_replicas",
    "forgets_momentum",
]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> SuiteReport:
    return mutation_suite(tmp_path_factory, "broken", BROKEN, plugin=PLUGIN, scenarios=SCENARIOS)


def _statuses(report: SuiteReport, name: str) -> dict[str, str]:
    return {n: v.status for n, v in report.verdicts[name].items()}


def test_an_undeclared_refusal_fails(report):
    v = report.verdicts["refuses_quietly"]
    statuses = _statuses(report, "refuses_quietly")
    assert statuses["plain"] == statuses["replica_init"] == PASS
    accumulation, buffers = v["accumulation"], v["buffers"]
    # The resume scenario's model has buffers too (they are checked across the resume).
    assert statuses["resume"] == FAIL and v["resume"].diagnosis.rule == "undeclared_refusal"
    assert accumulation.status == FAIL and buffers.status == FAIL
    assert accumulation.diagnosis.rule == "undeclared_refusal"
    assert "refused accumulate_grad_batches although it declares it supported" in accumulation.diagnosis.explanation
    assert "accumulation is not implemented beyond 2" in accumulation.divergences[0].got
    # A model-level refusal (the strategy's own validate_model), undeclared.
    assert "refused model although it declares it supported" in buffers.diagnosis.explanation
    cert = report.certificate("refuses_quietly")
    assert not cert.certified and {n for n, _ in cert.failed} == {"accumulation", "buffers", "resume"}
    assert report.exit_code == 1


def test_the_same_refusal_declared_is_declared_out(report):
    statuses = _statuses(report, "refuses_declared")
    assert statuses == {
        "plain": PASS,
        "validation": PASS,
        "accumulation": DECLARED_OUT,
        "buffers": DECLARED_OUT,
        "replica_init": DECLARED_OUT,
        "resume": DECLARED_OUT,
        "resume_sgd": DECLARED_OUT,
    }
    v = report.verdicts["refuses_declared"]
    assert "gradient_accumulation refused: accumulation is not implemented" in v["accumulation"].reason
    assert "buffers refused: models with buffers are not implemented" in v["buffers"].reason
    cert = report.certificate("refuses_declared")
    assert cert.certified and cert.proven == ["plain", "validation"]
    assert [n for n, _ in cert.declared_out] == ["accumulation", "buffers", "replica_init", "resume", "resume_sgd"]
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


def _margin(v) -> float:
    """The deciding check's deviation over its tolerance."""
    d = v.divergences[0]
    return d.deviation / d.tolerance


def test_a_per_replica_validation_mean_fails_validation_with_its_rule(report):
    statuses = _statuses(report, "per_rank_val_mean")
    # Training is untouched: only the validation scenario can see it.
    assert statuses["plain"] == statuses["accumulation"] == statuses["resume"] == PASS
    v = report.verdicts["per_rank_val_mean"]["validation"]
    assert v.status == FAIL and v.diagnosis.rule == "validation", v.diagnosis.message()
    assert v.divergences[0].quantity == "val/loss" and v.divergences[0].step == 2
    assert _margin(v) >= 10, _margin(v)
    assert not report.certificate("per_rank_val_mean").certified


def test_a_batch_mean_over_replicas_fails_validation_on_the_uneven_short_batch(report):
    """Each batch's loss averaged over the replicas equals the per-sample mean on every full chunk; only the
    short last chunk, split 3 + 2, tells them apart (a one-sample last chunk did not: it was certified)."""
    statuses = _statuses(report, "batch_mean_over_replicas")
    assert statuses["plain"] == statuses["accumulation"] == statuses["resume"] == PASS
    v = report.verdicts["batch_mean_over_replicas"]["validation"]
    assert v.status == FAIL and v.diagnosis.rule == "validation", v.diagnosis.message()
    assert [d.step for d in v.divergences if d.quantity == "val/loss"] == [2, 4, 6]  # every validation
    assert _margin(v) >= 10, _margin(v)
    assert any("splits 3+2 over 2 replicas (unevenly" in c for c in v.checks), v.checks
    assert not report.certificate("batch_mean_over_replicas").certified


def test_momentum_lost_on_resume_fails_resume_sgd_only(report):
    statuses = _statuses(report, "forgets_momentum")
    assert statuses["plain"] == statuses["resume"] == PASS  # AdamW's state keys are all restored
    v = report.verdicts["forgets_momentum"]["resume_sgd"]
    assert v.status == FAIL and v.diagnosis.rule == "resume_state", v.diagnosis.message()
    assert v.diagnosis.run == "strategy:resumed" and v.diagnosis.step == 4, v.diagnosis.message()
    assert "optimizer state" in v.diagnosis.explanation
    assert _margin(v) >= 10, _margin(v)
    assert not report.certificate("forgets_momentum").certified


def test_a_partial_run_says_so_and_certifies_nothing(report, tmp_path):
    """Fewer scenarios than the full set: "PARTIAL: n of N scenarios", never "CERTIFIED"."""
    import io

    from rich.console import Console

    from unison.conformance.scenarios import SCENARIOS as ALL

    n, total = len(SCENARIOS), len(ALL)
    cert = report.certificate("refuses_declared")
    assert cert.partial and cert.label == f"partial: {n} of {total} scenarios"
    assert cert.to_dict()["certified"] is False and cert.to_dict()["passed"] is True
    assert cert.world_sizes == [2] and "proven at world size 2" in cert.summary
    buf = io.StringIO()
    report.print_table(Console(file=buf, width=300))
    text = buf.getvalue()
    assert f"refuses_declared: PARTIAL: {n} of {total} scenarios" in text
    assert "CERTIFIED" not in text.replace("NOT CERTIFIED", "")
    report.write(tmp_path)
    html = (tmp_path / "report.html").read_text()
    assert f"PARTIAL: {n} of {total} scenarios ran." in html and "Legend" in html
    # No reshard scenario ran: the page claims no other world size.
    assert "resharding checked at" not in html and "also resumed at" not in html


def test_report_lists_proven_and_declared_out(report, tmp_path):
    report.write(tmp_path)
    html = (tmp_path / "report.html").read_text()
    assert 'id="certificate-refuses_declared"' in html
    assert "Declared out (5)" in html and "Proven (2)" in html
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


# --------------------------------------------------------------------------- #
# Checkpoint formats: one single cannot load, one declared not reshardable
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def checkpoint_report(tmp_path_factory) -> tuple[SuiteReport, Path]:
    report_dir = suite_report_dir(tmp_path_factory, "checkpoints")
    with Suite(
        world_size=2,
        scenarios=["resume", "cross_resume", "reshard"],
        plugins=[PLUGIN],
        timeout=300,
        workdir=tmp_path_factory.mktemp("conformance-checkpoints"),
    ) as suite:
        report = certify(["renamed_checkpoint", "not_reshardable"], suite=suite, report_dir=report_dir)
    return report, report_dir


def test_a_reference_run_raising_a_base_exception_is_a_failed_cell_with_a_written_report(checkpoint_report):
    """single cannot load the strategy's checkpoint: torch.distributed.checkpoint raises CheckpointException,
    a BaseException subclass. The suite reports the cell and writes its report instead of crashing."""
    from torch.distributed.checkpoint.api import CheckpointException

    assert not issubclass(CheckpointException, Exception)  # the premise: `except Exception` would not catch it
    report, report_dir = checkpoint_report
    result = next(r for r in report.results if r.name == "renamed_checkpoint")
    trace = result.reference_traces["cross_resume"]["from_strategy"]
    assert trace["status"] == "error" and "CheckpointException" in trace["error"]
    assert "Missing key in checkpoint state_dict" in trace["error"]
    v = report.verdicts["renamed_checkpoint"]["cross_resume"]
    assert v.status == FAIL and v.diagnosis is not None
    assert any(d.run == "reference:from_strategy" and "CheckpointException" in (d.note or "") for d in v.divergences)
    # Its own checkpoints resume exactly: only the cross-backend cells fail.
    assert report.verdicts["renamed_checkpoint"]["resume"].status == PASS
    assert not report.certificate("renamed_checkpoint").certified and report.exit_code == 1
    written = json.loads((report_dir / "report.json").read_text())
    cell = next(s for s in written["strategies"] if s["name"] == "renamed_checkpoint")["verdicts"]["cross_resume"]
    assert cell["status"] == FAIL and "CheckpointException" in json.dumps(cell)
    assert 'id="certificate-renamed_checkpoint"' in (report_dir / "report.html").read_text()


def test_a_strategy_declaring_its_checkpoint_not_reshardable_is_certified_with_cross_world_declared_out(
    checkpoint_report,
):
    report, _ = checkpoint_report
    statuses = _statuses(report, "not_reshardable")
    assert statuses == {"resume": PASS, "cross_resume": DECLARED_OUT, "reshard": DECLARED_OUT}
    cert = report.certificate("not_reshardable")
    assert cert.certified and cert.proven == ["resume"]
    assert [n for n, _ in cert.declared_out] == ["cross_resume", "reshard"]
    assert all("not reshardable (torch.save per rank)" in why for _, why in cert.declared_out)
    # Declared out means not run: no strategy world resumed another world size's checkpoint.
    result = next(r for r in report.results if r.name == "not_reshardable")
    assert set(result.traces) == {"resume"} and not result.reference_traces
    # Buffers are checked across the same-world resume: the final state includes the BatchNorm buffers.
    assert any("running_mean" in k for k in result.traces["resume"]["resumed"]["state"])


def test_mutation_score_every_broken_strategy_caught_by_a_wide_margin(report, capsys):
    """The suite's own mutation score: "N of N caught, smallest margin M", the control certified."""
    from unison.conformance.mutation import score
    from unison.conformance.report import _sanitize

    broken = [n for n in BROKEN if n != "refuses_declared"]
    result = score(_sanitize(report.to_dict()), broken, controls=["refuses_declared"])
    line = result.line()
    print(line)
    assert result.ok and len(result.caught) == len(broken), line
    assert line.startswith(f"{len(broken)} of {len(broken)} caught, smallest margin")
    _, margin = result.smallest_margin
    assert margin >= 10, line
    # A broken strategy certified fails the score (and CI with it).
    forged = _sanitize(report.to_dict())
    forged["certificates"] = [
        {**c, "failed": []} if c["strategy"] == "stale_buffers" else c for c in forged["certificates"]
    ]
    missed = score(forged, broken, controls=["refuses_declared"])
    assert not missed.ok and missed.missed == ["stale_buffers"] and "CERTIFIED although broken" in missed.line()
