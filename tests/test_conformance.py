"""The conformance suite itself: it certifies conforming strategies and catches wrong ones.

One suite run (module fixture) certifies ``ddp``, the example third-party
``handwritten_dp`` and its deliberately wrong twin ``handwritten_dp_double_avg``
against one shared reference: three 2-rank gloo worlds plus the 1-rank worlds
of the reshard scenario. The example package is registered by module name
(``PluginManager(plugins=[...])`` in every process), not installed.

"Each scenario can fail" is shown twice: the wrong strategy fails every
scenario, and for every scenario a copy of ddp's real traces with one quantity
broken fails with a divergence naming that quantity and step.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import unison
from unison.conformance.compare import TOLERANCES, judge_scenario
from unison.conformance.report import SuiteReport, certify
from unison.conformance.runner import Suite
from unison.conformance.scenarios import SCENARIOS, SCENARIOS_BY_NAME

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

EXAMPLE_DIR = Path(__file__).resolve().parents[1] / "examples" / "third_party_strategy"
EXAMPLE_MODULE = "unison_handwritten_dp"
THIS_MODULE = Path(__file__).stem
GOOD, WRONG = "handwritten_dp", "handwritten_dp_double_avg"
UNAVAILABLE = "conformance_test_unavailable"


# A plugin in this module (registered by name where needed): one strategy that
# is registered but unavailable on this machine.
class _NeverBuilt(unison.Strategy):  # pragma: no cover - never instantiated
    pass


@unison.hookimpl
def unison_strategies() -> list[unison.StrategySpec]:
    return [unison.StrategySpec(UNAVAILABLE, factory=_NeverBuilt, description="needs hardware this machine lacks",
                                unavailable="needs the 'imaginary-accelerator' package")]


@pytest.fixture(scope="module", autouse=True)
def example_on_path():
    """Make the example package and this module importable here and in spawned ranks (sys.path is inherited)."""
    added = []
    for path in (EXAMPLE_DIR, Path(__file__).resolve().parent):
        if importlib.util.find_spec(EXAMPLE_MODULE if path == EXAMPLE_DIR else THIS_MODULE) is None:
            sys.path.insert(0, str(path))
            added.append(str(path))
    yield
    for path in added:
        sys.path.remove(path)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> SuiteReport:
    out = tmp_path_factory.mktemp("conformance-report")
    with Suite(world_size=2, plugins=[EXAMPLE_MODULE], workdir=tmp_path_factory.mktemp("conformance-work"),
               timeout=300) as suite:
        rep = certify(["ddp", GOOD, WRONG], suite=suite, report_dir=out)
    rep.report_dir = out  # type: ignore[attr-defined]
    return rep


def _result(report: SuiteReport, name: str):
    return next(r for r in report.results if r.name == name)


# --------------------------------------------------------------------------- #
# Conforming strategies are certified
# --------------------------------------------------------------------------- #


def test_ddp_passes_every_scenario(report):
    verdicts = report.verdicts["ddp"]
    assert [v.status for v in verdicts.values()] == ["pass"] * len(SCENARIOS), {
        n: v.summary() for n, v in verdicts.items() if v.status != "pass"
    }
    assert report.certified("ddp")
    for name, v in verdicts.items():
        scenario = SCENARIOS_BY_NAME[name]
        if scenario.kind == "train":
            assert v.max_param_deviation is not None
            assert v.max_param_deviation <= TOLERANCES[scenario.precision].param
            if scenario.precision == "32-true":
                assert v.max_param_deviation <= 1e-5


def test_ddp_syncs_gradients_once_per_optimizer_step(report):
    """Trainer-owned accumulation, verified: no all-reduce inside no_sync, one bucket set per step."""
    traces = _result(report, "ddp").traces
    plain, accum = traces["plain"]["main"], traces["accumulation"]["main"]
    steps = SCENARIOS_BY_NAME["accumulation"].max_steps
    for rank_accum, rank_plain in zip(accum["ranks"], plain["ranks"]):
        a, p = rank_accum["collectives"], rank_plain["collectives"]
        assert a["no_sync_entries"] == 3 * steps  # 4 micro-batches: 3 inside no_sync
        assert a["gradient_sync_in_no_sync"] == 0
        # The tiny model fits one DDP bucket: one all-reduce per optimizer
        # step, with 4 micro-batches exactly as with 1.
        assert a["gradient_sync_per_step"] == p["gradient_sync_per_step"] == [1] * steps
    assert accum["hooks"].count("unison_on_before_optimizer_step") == steps
    assert accum["hooks"].count("unison_on_after_backward") == steps


def test_fp16_overflow_skips_the_step_and_holds_the_scheduler(report):
    trace = _result(report, "ddp").traces["fp16_overflow"]["main"]
    skipped = [s["step"] for s in trace["steps"] if s["skipped"]]
    assert skipped == [2]
    assert not math.isfinite(trace["steps"][2]["grad_norm"])
    assert trace["counts"]["optimizer_steps"] == trace["counts"]["scheduler_steps"] == 5
    assert trace["counts"]["optimizer_updates_observed"] == 5
    lrs = [s["lrs"][0] for s in trace["steps"]]
    assert lrs[3] == lrs[2]  # the skipped step did not advance the warmup


def test_reshard_resumes_at_world_one(report):
    result = _result(report, "ddp")
    resumed = result.traces["reshard"]["resumed"]
    assert resumed["world_size"] == 1 and result.traces["reshard"]["part"]["world_size"] == 2
    assert report.verdicts["ddp"]["reshard"].status == "pass"
    assert result.ownership["state_dict"]["reshardable"] is True


def test_third_party_strategy_is_certified(report):
    verdicts = report.verdicts[GOOD]
    assert report.certified(GOOD), {n: v.summary() for n, v in verdicts.items() if v.status != "pass"}
    assert all(v.status == "pass" for v in verdicts.values())
    # It declares bf16-true unsupported: the Trainer refuses it, naming it.
    outcome = next(o for o in _result(report, GOOD).declarations if o["precision"] == "bf16-true")
    assert outcome["declared"] == "unsupported"
    assert outcome["raised"]["is_configuration_error"] and "bf16-true" in outcome["raised"]["message"]
    assert not outcome["process_group_started"]


# --------------------------------------------------------------------------- #
# Wrong strategies fail, pointing at the divergence
# --------------------------------------------------------------------------- #


def test_wrong_strategy_fails_every_scenario_with_a_pointer(report):
    verdicts = report.verdicts[WRONG]
    assert not report.certified(WRONG)
    assert report.exit_code == 1
    for name, v in verdicts.items():
        assert v.status == "fail", (name, v.summary())
        first = v.divergences[0]
        assert first.scenario == name
        message = first.message()
        assert f"scenario {name!r}" in message
        if SCENARIOS_BY_NAME[name].kind == "train":
            # Gradients averaged twice: the global norm is half at the first step.
            assert first.quantity == "grad_norm" and first.step == 0, message
            assert "at step 0" in message and "grad_norm" in message
            assert first.got == pytest.approx(first.expected / 2, rel=2e-2)
        else:
            assert "bf16-true" in message and "declared-supported" in message


def test_terminal_table_and_files(report, capsys):
    from rich.console import Console

    console = Console(record=True, width=200)
    report.print_table(console)
    text = console.export_text()
    assert "plain" in text and "reshard" in text and "FAIL grad_norm@0 (5.0e-01)" in text and "pass " in text
    data = json.loads((report.report_dir / "report.json").read_text())
    assert {s["name"] for s in data["strategies"]} == {"ddp", GOOD, WRONG}
    wrong = next(s for s in data["strategies"] if s["name"] == WRONG)
    assert wrong["verdicts"]["plain"]["divergences"][0]["quantity"] == "grad_norm"
    assert data["tolerances"]["32-true"]["param"] == 1e-5
    html = (report.report_dir / "report.html").read_text()
    train = [s for s in SCENARIOS if s.kind == "train"]
    assert html.count("<svg") == len(train)
    import xml.etree.ElementTree as ET

    for chunk in html.split("<svg")[1:]:
        svg = ET.fromstring("<svg" + chunk.split("</svg>")[0] + "</svg>")
        assert len(svg.findall("{http://www.w3.org/2000/svg}polyline")) >= 4  # reference + 3 strategies
    assert "wall time" in html and "declared" in html


# --------------------------------------------------------------------------- #
# Every scenario can fail: broken comparison inputs
# --------------------------------------------------------------------------- #


def _first_strategy_run(name: str) -> str:
    return next(r.id for r in SCENARIOS_BY_NAME[name].runs if r.backend == "strategy")


@pytest.mark.parametrize("name", [s.name for s in SCENARIOS])
def test_a_broken_input_fails_each_scenario(report, name):
    scenario = SCENARIOS_BY_NAME[name]
    result = copy.deepcopy(_result(report, "ddp"))
    reference = report.reference
    assert judge_scenario(scenario, result, reference).status == "pass"
    if scenario.kind == "declarations":
        # A precision declared unsupported that the Trainer accepted.
        result.declarations[1] = {**result.declarations[1], "declared": "unsupported", "raised": None}
        v = judge_scenario(scenario, result, reference)
        assert v.status == "fail" and "declared-unsupported precision" in v.divergences[0].message()
        return
    run_id = _first_strategy_run(name)
    trace = result.traces[name][run_id]
    last = trace["steps"][-1]
    last["loss"] *= 1.1  # beyond every precision's loss tolerance
    v = judge_scenario(scenario, result, reference)
    assert v.status == "fail"
    assert any(d.quantity == "loss" and d.step == last["step"] for d in v.divergences), v.summary()


def test_broken_state_hooks_counts_and_sync_fail(report):
    base = _result(report, "ddp")
    reference = report.reference
    scenario = SCENARIOS_BY_NAME["accumulation"]

    def judge(mutate):
        result = copy.deepcopy(base)
        mutate(result.traces["accumulation"]["main"])
        return judge_scenario(scenario, result, reference)

    def state(t):
        t["state"]["0.weight"] = t["state"]["0.weight"] + 1e-4
    v = judge(state)
    assert v.status == "fail" and "final parameter '0.weight'" in v.reason

    v = judge(lambda t: t["hooks"].remove("unison_on_after_backward"))
    assert any(d.quantity == "hook sequence" for d in v.divergences)

    def counts(t):
        t["counts"]["scheduler_steps"] += 1
    assert any(d.quantity == "scheduler steps" for d in judge(counts).divergences)

    def sync_in_no_sync(t):
        t["ranks"][1]["collectives"]["gradient_sync_in_no_sync"] = 3
    v = judge(sync_in_no_sync)
    assert any("inside no_sync() on rank 1" in d.quantity for d in v.divergences)

    def sync_per_micro_step(t):
        for r in t["ranks"]:
            r["collectives"]["gradient_sync_per_step"] = [4] * len(r["collectives"]["gradient_sync_per_step"])
    v = judge(sync_per_micro_step)
    assert any("per optimizer step" in d.quantity for d in v.divergences)

    def engine_boundary(t):
        t["accumulation_owner"] = "engine"
        for r in t["ranks"]:
            r["boundaries"] = [False, False, True, False] * 6
    v = judge(engine_boundary)
    assert any("is_accumulation_boundary" in d.quantity for d in v.divergences)

    def lost_updates(t):
        t["ranks"][0]["counts"]["optimizer_updates_observed"] -= 1
    assert any("real optimizer updates" in d.quantity for d in judge(lost_updates).divergences)


def test_premises_and_cross_runs_can_fail(report):
    base = _result(report, "ddp")
    # Clipping that does not clip: the reference's control run ends where the clipped one does.
    reference = copy.deepcopy(report.reference)
    reference["clipping"]["unclipped"]["state"] = reference["clipping"]["main"]["state"]
    v = judge_scenario(SCENARIOS_BY_NAME["clipping"], base, reference)
    assert v.status == "fail" and "premise: clipping changes the update" in v.reason
    # A strategy checkpoint that single resumes wrongly.
    result = copy.deepcopy(base)
    result.reference_traces["cross_resume"]["from_strategy"]["steps"][0]["grad_norm"] *= 2
    v = judge_scenario(SCENARIOS_BY_NAME["cross_resume"], result, report.reference)
    assert v.status == "fail" and v.divergences[0].run == "reference:from_strategy"
    # A reshardable declaration whose other-world resume never happened.
    result = copy.deepcopy(base)
    del result.traces["reshard"]["resumed"]
    result.world_errors["alt"] = "WorldError: rank 0 failed"
    v = judge_scenario(SCENARIOS_BY_NAME["reshard"], result, report.reference)
    assert v.status == "fail" and "rank 0 failed" in v.reason


# --------------------------------------------------------------------------- #
# Skipped, unsupported and declared non-conformant are never "passed"
# --------------------------------------------------------------------------- #


def test_unavailable_strategy_is_skipped_with_its_reason(tmp_path):
    rep = certify([UNAVAILABLE], plugins=[THIS_MODULE], report_dir=tmp_path)
    assert {v.status for v in rep.verdicts[UNAVAILABLE].values()} == {"skipped"}
    assert "imaginary-accelerator" in rep.verdicts[UNAVAILABLE]["plain"].reason
    assert not rep.certified(UNAVAILABLE)
    assert rep.exit_code == 0
    assert json.loads((tmp_path / "report.json").read_text())["strategies"][0]["status"] == "skipped"


def test_declared_non_conformant_is_run_and_its_failures_shown(report):
    wrong = copy.deepcopy(_result(report, WRONG))
    wrong.non_conformant = "averages gradients twice (known)"
    rep = SuiteReport(world_size=2, alt_world_size=1, scenarios=report.scenarios, results=[wrong],
                      verdicts={WRONG: report.verdicts[WRONG]}, reference=report.reference,
                      reference_wall_s=0.0, wall_s=0.0)
    assert rep.exit_code == 0  # declared: shown, not gating
    assert len(rep.failures(include_declared=True)) == len(SCENARIOS)
    assert not rep.certified(WRONG)
    from rich.console import Console

    console = Console(record=True, width=200)
    rep.print_table(console)
    text = console.export_text()
    assert "declared non-conformant" in text and "FAIL" in text


def test_unsupported_precision_is_reported_unsupported(report):
    """A scenario in a precision the strategy declares unsupported is 'unsupported', not run, not passed."""
    result = copy.deepcopy(_result(report, GOOD))
    result.ownership["precision"]["bf16-mixed"] = {"owner": "unsupported", "detail": "no bf16 here"}
    v = judge_scenario(SCENARIOS_BY_NAME["bf16_mixed"], result, report.reference)
    assert v.status == "unsupported" and "no bf16 here" in v.reason


# --------------------------------------------------------------------------- #
# Entry points
# --------------------------------------------------------------------------- #


def test_cli_command_is_added_through_the_hook(tmp_path):
    from click.testing import CliRunner
    from unison.cli import cli

    pm = unison.PluginManager()
    if "conformance" not in cli.commands:
        pm.hook.unison_add_cli_commands(cli=cli)
    runner = CliRunner()
    out = runner.invoke(cli, ["conformance", "--strategy", UNAVAILABLE, "--plugin", THIS_MODULE,
                              "--report", str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert "skipped" in out.output
    assert (tmp_path / "report.html").exists()
    # Declarations only: no world is started, and the wrong strategy fails with exit status 1.
    out = runner.invoke(cli, ["conformance", "--strategy", WRONG, "--plugin", EXAMPLE_MODULE,
                              "--scenario", "unsupported_precision"])
    assert out.exit_code == 1, out.output
    assert "FAIL" in out.output


def test_pytest_plugin(pytester, monkeypatch):
    """One pytest session: unavailable -> skipped, conforming -> passed, wrong -> failed (no world needed)."""
    paths = [str(EXAMPLE_DIR), str(Path(__file__).resolve().parent)]
    monkeypatch.setenv("PYTHONPATH", ":".join(paths + [p for p in sys.path if p]))
    result = pytester.runpytest_subprocess(
        "-p", "unison.conformance.pytest_plugin", "--pyargs", "unison.conformance", "-p", "no:cacheprovider",
        "--unison-strategy", f"{UNAVAILABLE},{GOOD},{WRONG}", "--unison-plugin", f"{THIS_MODULE},{EXAMPLE_MODULE}",
        "--unison-scenario", "unsupported_precision", "-rA",
    )
    result.assert_outcomes(passed=1, failed=1, skipped=1)
    result.stdout.fnmatch_lines(["*imaginary-accelerator*"])
    result.stdout.fnmatch_lines(["*declared-supported precision*bf16-true*"])


pytest_plugins = ["pytester"]

