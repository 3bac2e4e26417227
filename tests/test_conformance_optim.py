"""Resume with optimizer state beyond Adam's: Adagrad (state made in its constructor) and fp16's loss scaler.

One suite run (module fixture, 2-rank gloo worlds) over ``resume_adagrad`` and ``resume_fp16``:

* ``ddp`` and ``zero2`` certify ``resume_adagrad``: DeepSpeed swaps a client ``torch.optim.Adagrad``
  for a copy of its own (one group, the constructor's defaults, the scheduler ignored), which
  unison undoes; before that ZeRO failed from the first step on.
* ``resume_fp16``: a resumed fp16 run equals the uninterrupted one bit for bit under ``single`` and
  ``ddp``, a strategy whose loss scaler ignores the checkpoint's state is caught with a margin of at
  least 10 (``conformance_broken_optim``), its correct control is certified, and ``zero2``, which
  declares fp16 unsupported on CPU, is declared out.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from unison.conformance.certification import certify
from unison.conformance.data import BACKOFF_STEPS
from unison.conformance.mutation import score
from unison.conformance.report import SuiteReport
from unison.conformance.scenarios import SCENARIOS_BY_NAME
from unison.conformance.suite import Suite
from unison.conformance.verdict import DECLARED_OUT, FAIL, PASS

from helpers import suite_report_dir

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

PLUGIN = "conformance_broken_optim"
SCENARIOS = ["resume_adagrad", "resume_fp16"]
STRATEGIES = ["ddp", "zero2", "forgets_scaler_state", "restores_scaler"]


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory) -> Path:
    return suite_report_dir(tmp_path_factory, "optim")


@pytest.fixture(scope="module")
def report(tmp_path_factory, report_dir) -> SuiteReport:
    with Suite(
        world_size=2,
        scenarios=SCENARIOS,
        plugins=[PLUGIN],
        timeout=300,
        workdir=tmp_path_factory.mktemp("conformance-optim"),
    ) as suite:
        return certify(STRATEGIES, suite=suite, report_dir=report_dir)


def _traces(report: SuiteReport, strategy: str) -> dict:
    return next(r for r in report.results if r.name == strategy).traces


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _resumed_numbers(run: dict) -> list[tuple[int, float, float, bool]]:
    return [(s["step"], s["loss"], s["grad_norm"], s["skipped"]) for s in run["steps"]]


def test_adagrad_resumes_under_ddp_and_deepspeed_zero(report):
    for strategy in ("ddp", "zero2"):
        v = report.verdicts[strategy]["resume_adagrad"]
        assert v.status == PASS, (strategy, [str(d) for d in v.divergences])
        # fp32: round-off, far inside the 1e-5 tolerance (measured 3e-8).
        assert v.max_param_deviation is not None and v.max_param_deviation < 1e-6
    # The scenario's premise: Adagrad really holds constructor-made state in two groups.
    opt = SCENARIOS_BY_NAME["resume_adagrad"]
    assert opt.optimizer == "adagrad_groups"


def test_the_fp16_premise_the_scale_backs_off_before_the_checkpoint(report):
    """The reference skips exactly the forced overflows, then trains every step at the backed-off scale."""
    ref = report.reference["resume_fp16"]
    skipped = [s["skipped"] for s in ref["full"]["steps"]]
    assert skipped == [True] * BACKOFF_STEPS + [False] * (len(skipped) - BACKOFF_STEPS)
    assert not any(s["skipped"] for s in ref["resumed"]["steps"])


@pytest.mark.parametrize("strategy", ["ddp", "restores_scaler"])
def test_a_resumed_fp16_run_equals_the_uninterrupted_one_bitwise(report, strategy):
    v = report.verdicts[strategy]["resume_fp16"]
    assert v.status == PASS, [str(d) for d in v.divergences]
    runs = _traces(report, strategy)["resume_fp16"]
    full, resumed = runs["full"], runs["resumed"]
    first = resumed["steps"][0]["step"]
    assert _resumed_numbers(resumed) == [n for n in _resumed_numbers(full) if n[0] >= first]
    assert _same_state(resumed["state"], full["state"])


def test_single_resumes_fp16_bitwise(report):
    ref = report.reference["resume_fp16"]
    first = ref["resumed"]["steps"][0]["step"]
    assert _resumed_numbers(ref["resumed"]) == [n for n in _resumed_numbers(ref["full"]) if n[0] >= first]
    assert _same_state(ref["resumed"]["state"], ref["full"]["state"])


def test_a_scaler_that_forgets_its_state_is_caught_with_margin(report, report_dir):
    verdicts = report.verdicts["forgets_scaler_state"]
    assert verdicts["resume_adagrad"].status == PASS  # the defect is fp16-only
    v = verdicts["resume_fp16"]
    assert v.status == FAIL
    # The restarted scale (2**16) overflows the first resumed step, which the uninterrupted run takes.
    resumed = _traces(report, "forgets_scaler_state")["resume_fp16"]["resumed"]
    assert resumed["steps"][0]["skipped"]
    assert any(d.quantity == "optimizer steps" for d in v.divergences)
    result = score(json.loads((report_dir / "report.json").read_text()), ["forgets_scaler_state"], ["restores_scaler"])
    assert result.ok, result.line()
    margin = result.caught["forgets_scaler_state"]
    assert math.isinf(margin) or margin >= 10, margin


def test_deepspeed_fp16_on_cpu_is_declared_out(report):
    v = report.verdicts["zero2"]["resume_fp16"]
    assert v.status == DECLARED_OUT
    assert "precision:16-mixed" in v.reason and "fp16" in v.reason
