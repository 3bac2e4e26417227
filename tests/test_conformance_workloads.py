"""The workload scenarios against deliberately broken strategies and plugins (``conformance_broken_workloads``).

One suite run (module fixture, 2-rank gloo worlds) over ``plain``, ``token_loss``, ``default_plugins`` and
``fresh_resume``: ``ddp`` (the control) is certified, bit for bit where the scenario asks for it; each
broken one is not certified, with a margin of at least 10 on the deciding check (or a categorical
failure), a diagnosis naming its rule, and only the scenario that exists to see it fails (``plain`` runs
first in every world, as in the full matrix: it absorbs a once-per-process draw there).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from unison.conformance.certification import certify
from unison.conformance.mutation import score
from unison.conformance.report import SuiteReport
from unison.conformance.suite import Suite
from unison.conformance.verdict import FAIL, PASS

from helpers import suite_report_dir

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

PLUGIN = "conformance_broken_workloads"
SCENARIOS = ["plain", "token_loss", "default_plugins", "fresh_resume"]
BROKEN = ["misstates_replica_reduction", "callback_draws_rng", "once_per_process_draw"]
CONTROL = "ddp"


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory) -> Path:
    return suite_report_dir(tmp_path_factory, "workloads")


@pytest.fixture(scope="module")
def report(tmp_path_factory, report_dir) -> SuiteReport:
    with Suite(
        world_size=2,
        scenarios=SCENARIOS,
        plugins=[PLUGIN],
        timeout=300,
        workdir=tmp_path_factory.mktemp("conformance-workloads"),
    ) as suite:
        return certify([CONTROL, *BROKEN], suite=suite, report_dir=report_dir)


def _statuses(report: SuiteReport, name: str) -> dict[str, str]:
    return {n: v.status for n, v in report.verdicts[name].items()}


def _traces(report: SuiteReport, strategy: str) -> dict:
    return next(r for r in report.results if r.name == strategy).traces


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ddp_is_certified_bit_for_bit_where_asked(report):
    assert _statuses(report, CONTROL) == dict.fromkeys(SCENARIOS, PASS)
    token = report.verdicts[CONTROL]["token_loss"]
    assert token.max_param_deviation is not None and token.max_param_deviation < 1e-6  # measured 1.5e-8
    # The control run (each slice's own token mean) ends far from the reference: the scenario is not vacuous.
    assert token.sensitivity is not None and token.sensitivity["conclusive"] and token.sensitivity["ratio"] >= 10
    runs = _traces(report, CONTROL)
    on, off = runs["default_plugins"]["on"], runs["default_plugins"]["off"]
    assert _same_state(on["state"], off["state"])
    fresh = runs["fresh_resume"]
    assert _same_state(fresh["resumed"]["state"], fresh["resumed_here"]["state"])
    assert _same_state(fresh["resumed"]["state"], fresh["full"]["state"])  # ddp resumes bit for bit


def test_the_reference_is_split_independent_and_defaults_change_nothing(report):
    ref = report.reference
    main, full_batch = ref["token_loss"]["main"], ref["token_loss"]["full_batch"]
    # Accumulation 2 against the whole global batch in one micro-batch: the same loss, to round-off.
    for a, b in zip(main["steps"], full_batch["steps"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(b["loss"])
    assert len(main["steps"][0]["micro_losses"]) == 2 and len(full_batch["steps"][0]["micro_losses"]) == 1
    assert _same_state(ref["default_plugins"]["on"]["state"], ref["default_plugins"]["off"]["state"])


def test_a_misstated_replica_reduction_is_seen_only_by_the_token_scenario(report):
    statuses = _statuses(report, "misstates_replica_reduction")
    assert statuses == {**dict.fromkeys(SCENARIOS, PASS), "token_loss": FAIL}
    v = report.verdicts["misstates_replica_reduction"]["token_loss"]
    assert v.diagnosis.rule == "loss_normalisation", v.diagnosis.message()
    d = v.divergences[0]
    assert d.quantity == "grad_norm" and d.step == 0
    assert abs(d.got / d.expected - 0.5) < 1e-4  # declared summed, averaged over 2 replicas
    assert "replicas: sum" in v.diagnosis.explanation


def test_a_callback_drawing_from_the_global_rng_fails_every_run_with_the_guard(report):
    v = report.verdicts["callback_draws_rng"]
    assert {n: x.status for n, x in v.items()} == dict.fromkeys(SCENARIOS, FAIL)
    for verdict in v.values():
        assert verdict.diagnosis.rule == "plugin_rng", verdict.diagnosis.message()
        assert "UNISON_CHECK_PLUGIN_RNG=1" in verdict.diagnosis.explanation
        assert "conformance_broken_workloads.SampledLogging" in verdict.diagnosis.explanation


def test_a_once_per_process_draw_is_seen_only_by_a_resume_in_new_processes(report):
    statuses = _statuses(report, "once_per_process_draw")
    assert statuses == {**dict.fromkeys(SCENARIOS, PASS), "fresh_resume": FAIL}
    v = report.verdicts["once_per_process_draw"]["fresh_resume"]
    assert v.diagnosis.rule == "fresh_process_resume", v.diagnosis.message()
    assert {d.run for d in v.divergences} == {"strategy:resumed"}
    runs = _traces(report, "once_per_process_draw")["fresh_resume"]
    # Resumed in the process that saved, the checkpoint is exact: only the new processes draw again.
    assert _same_state(runs["resumed_here"]["state"], runs["full"]["state"])


def test_the_mutation_score(report, report_dir):
    result = score(json.loads((report_dir / "report.json").read_text()), BROKEN, [CONTROL])
    assert result.ok, result.line()
    for name, margin in result.caught.items():
        assert math.isinf(margin) or margin >= 10, (name, margin)
