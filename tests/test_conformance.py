"""The conformance suite itself: it certifies conforming strategies and catches wrong ones.

One suite run (module fixture) certifies ``ddp``, the example third-party
``handwritten_dp``, its every-micro-step sibling ``handwritten_dp_every_step``
and the deliberately wrong ``handwritten_dp_double_avg`` against one shared
reference: four 2-rank gloo worlds plus the 1-rank worlds of the reshard
scenario. The example package is registered by module name
(``PluginManager(plugins=[...])`` in every process), not installed.

"Each scenario can fail" is shown twice: the wrong strategy fails every
scenario, and for every scenario a copy of ddp's real traces with one quantity
broken fails with a divergence naming that quantity and step. Each diagnosis
rule is shown on a broken copy of real traces here, and on deliberately broken
strategies in ``test_conformance_broken.py``. The HTML report is opened in a
real headless browser.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import unison
from unison.conformance.certification import certify
from unison.conformance.compare import judge_scenario
from unison.conformance.report import SuiteReport
from unison.conformance.scenarios import SCENARIOS, SCENARIOS_BY_NAME
from unison.conformance.suite import Suite
from unison.conformance.verdict import DECLARED_OUT, TOLERANCES

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

EXAMPLE_DIR = Path(__file__).resolve().parents[1] / "examples" / "third_party_strategy"
EXAMPLE_MODULE = "unison_handwritten_dp"
THIS_MODULE = Path(__file__).stem
GOOD, WRONG, EVERY = "handwritten_dp", "handwritten_dp_double_avg", "handwritten_dp_every_step"
UNAVAILABLE = "conformance_test_unavailable"
TRAIN = [s for s in SCENARIOS if s.kind == "train"]
#: Scenarios that compare the strategy's runs with each other only (``default_plugins``, ``fresh_resume``,
#: ``activation_checkpointing_rng``, ``compile_rng``: Dropout
#: masks are drawn per rank, so no reference has them): gradients averaged twice change none of their comparisons.
#: Their own broken plugins and strategies fail them (tests/test_conformance_workloads.py).
SELF_COMPARED = {s.name for s in TRAIN if not any(r.twin or r.truth for r in s.runs if r.backend == "strategy")}


# A plugin in this module (registered by name where needed): one strategy that
# is registered but unavailable on this machine.
class _NeverBuilt(unison.Strategy):  # pragma: no cover - never instantiated
    pass


@unison.hookimpl
def unison_strategies() -> list[unison.StrategySpec]:
    return [
        unison.StrategySpec(
            UNAVAILABLE,
            factory=_NeverBuilt,
            description="needs hardware this machine lacks",
            unavailable="needs the 'imaginary-accelerator' package",
        )
    ]


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
    with Suite(
        world_size=2, plugins=[EXAMPLE_MODULE], workdir=tmp_path_factory.mktemp("conformance-work"), timeout=300
    ) as suite:
        rep = certify(["ddp", GOOD, EVERY, WRONG], suite=suite, report_dir=out)
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
    cert = report.certificate("ddp")
    assert cert.certified and cert.label == "certified"
    assert cert.proven == [s.name for s in SCENARIOS] and cert.declared_out == [] and cert.failed == []
    for name, v in verdicts.items():
        scenario = SCENARIOS_BY_NAME[name]
        if scenario.kind == "train":
            assert v.max_param_deviation is not None
            assert v.max_param_deviation <= TOLERANCES[scenario.precision].param


def test_ddp_syncs_gradients_once_per_optimizer_step(report):
    """Declared boundary sync, verified from the C++ reducer's collectives: none before the last micro-step."""
    traces = _result(report, "ddp").traces
    plain, accum = traces["plain"]["main"], traces["accumulation"]["main"]
    steps = SCENARIOS_BY_NAME["accumulation"].max_steps
    assert accum["accumulation_sync"] == "boundary"
    for rank_accum, rank_plain in zip(accum["ranks"], plain["ranks"]):
        a, p = rank_accum["collectives"], rank_plain["collectives"]
        assert a["no_sync_entries"] == 3 * steps  # 4 micro-batches: 3 inside no_sync
        assert a["gradient_sync_in_no_sync"] == 0
        # The tiny model fits one DDP bucket: one all-reduce per optimizer
        # step, at the last micro-step, with 4 micro-batches exactly as with 1.
        assert a["gradient_sync_per_micro_step"] == [[0, 0, 0, 1]] * steps
        assert a["gradient_sync_per_step"] == p["gradient_sync_per_step"] == [1] * steps
    assert accum["hooks"].count("unison_on_before_optimizer_step") == steps
    assert accum["hooks"].count("unison_on_after_backward") == steps


def test_every_micro_step_strategy_is_certified_when_it_declares_so(report):
    cert = report.certificate(EVERY)
    assert cert.certified, {n: v.summary() for n, v in report.verdicts[EVERY].items() if v.status != "pass"}
    accum = _result(report, EVERY).traces["accumulation"]["main"]
    assert accum["accumulation_sync"] == "every-micro-step"
    steps = SCENARIOS_BY_NAME["accumulation"].max_steps
    for rank in accum["ranks"]:
        assert rank["collectives"]["no_sync_entries"] == 0
        assert rank["collectives"]["gradient_sync_per_micro_step"] == [[1, 1, 1, 1]] * steps
    checks = " ".join(report.verdicts[EVERY]["accumulation"].checks)
    assert "every-micro-step" in checks


def test_buffers_change_every_step_and_are_compared_at_checkpoints(report):
    ref = report.reference["buffers"]["main"]
    assert sorted(ref["buffer_snapshots"]) == [2, 4, 6]
    counts = [int(ref["buffer_snapshots"][k]["1.num_batches_tracked"]) for k in (2, 4, 6)]
    assert counts == [7 + 4, 7 + 8, 7 + 12]  # 2 micro-batches per step, counted in every training forward
    means = [ref["buffer_snapshots"][k]["1.running_mean"] for k in (2, 4, 6)]
    assert float((means[1] - means[0]).abs().max()) > 1e-3 and float((means[2] - means[1]).abs().max()) > 1e-3
    ddp = _result(report, "ddp").traces["buffers"]["main"]
    for rank in ddp["ranks"]:
        assert sorted(rank["buffer_snapshots"]) == [2, 4, 6]
    assert any(c.startswith("premise: every buffer") for c in report.verdicts["ddp"]["buffers"].checks)


def test_replicas_started_apart_end_equal(report):
    """Every rank but 0 was perturbed (weights, then buffers); DDP's constructor broadcast made them equal."""
    for name in ("replica_init", "replica_init_buffers"):
        trace = _result(report, "ddp").traces[name]["main"]
        states = [r["state"] for r in trace["ranks"]]
        assert all(float((states[1][k].double() - states[0][k].double()).abs().max()) == 0 for k in states[0])
        assert report.verdicts["ddp"][name].status == "pass"
        assert report.verdicts[GOOD][name].status == "pass"  # the trainer broadcasts for it (replica_init=trainer)


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
    assert outcome["raised"]["feature"] == "precision:bf16-true"
    assert not outcome["process_group_started"]


# --------------------------------------------------------------------------- #
# Wrong strategies fail, pointing at the divergence and its likely cause
# --------------------------------------------------------------------------- #


def test_wrong_strategy_fails_every_scenario_with_a_pointer(report):
    verdicts = report.verdicts[WRONG]
    cert = report.certificate(WRONG)
    assert {"default_plugins", "fresh_resume", "activation_checkpointing_rng", "compile_rng"} == SELF_COMPARED
    assert not cert.certified and cert.label == "not certified"
    assert len(cert.failed) == len(SCENARIOS) - len(SELF_COMPARED)
    assert report.exit_code == 1
    for name, v in verdicts.items():
        if name in SELF_COMPARED:
            assert v.status == "pass", (name, v.summary())
            continue
        assert v.status == "fail", (name, v.summary())
        first = v.divergences[0]
        assert first.scenario == name
        message = first.message()
        assert f"scenario {name!r}" in message
        if SCENARIOS_BY_NAME[name].kind == "train":
            # Gradients averaged twice: the global norm is half at the first step that trains (a scenario
            # whose first steps overflow in fp16 skips them: their norms are not finite on both sides).
            steps = report.reference[name][first.run.split(":", 1)[-1]]["steps"]
            trained = next(s["step"] for s in steps if not s.get("skipped"))
            assert first.quantity == "grad_norm" and first.step == trained, message
            assert first.got == pytest.approx(first.expected / 2, rel=2e-2)
            assert v.diagnosis.rule == "averaged_twice", (name, v.diagnosis.message())
            assert v.diagnosis.step == trained and "1/world size = 1/2" in v.diagnosis.explanation
        else:
            assert "bf16-true" in message and "declared-supported" in message
            assert v.diagnosis.rule == "undeclared_refusal"
            assert "refused bf16-true although it declares it supported" in v.diagnosis.explanation


def test_terminal_table_and_files(report):
    from rich.console import Console

    console = Console(record=True, width=220)
    report.print_table(console)
    text = console.export_text()
    assert text.index("ddp: CERTIFIED") < text.index("unison conformance (world size 2")
    assert f"{WRONG}: NOT CERTIFIED" in text
    assert "plain" in text and "reshard" in text and "FAIL grad_norm@0 (5.0e-01)" in text and "pass " in text
    assert "diagnosis: gradients averaged twice" in text
    data = json.loads((report.report_dir / "report.json").read_text())
    assert {s["name"] for s in data["strategies"]} == {"ddp", GOOD, EVERY, WRONG}
    certs = {c["strategy"]: c for c in data["certificates"]}
    assert certs["ddp"]["label"] == "certified" and certs[WRONG]["label"] == "not certified"
    assert certs["ddp"]["proven"] == [s.name for s in SCENARIOS]
    env = data["environment"]
    assert env["world_size"] == 2 and env["versions"]["torch"].startswith("2.13") and env["host"]
    assert "unison" in env["versions"] and "python" in env["versions"]
    assert env["git"] is None or len(env["git"]["commit"]) == 40
    wrong = next(s for s in data["strategies"] if s["name"] == WRONG)
    assert wrong["verdicts"]["plain"]["divergences"][0]["quantity"] == "grad_norm"
    assert wrong["verdicts"]["plain"]["diagnosis"]["rule"] == "averaged_twice"
    assert data["tolerances"]["32-true"]["param"] == 1e-5

    html = (report.report_dir / "report.html").read_text()
    assert html.count("<svg") == len(TRAIN) - len(SELF_COMPARED)
    assert "fresh_resume: the strategy's runs are compared with each other (bit for bit)" in html
    import xml.etree.ElementTree as ET

    ns = "{http://www.w3.org/2000/svg}"
    for chunk in html.split("<svg")[1:]:
        svg = ET.fromstring("<svg" + chunk.split("</svg>")[0] + "</svg>")
        texts = " ".join("".join(t.itertext()) for t in svg.iter(f"{ns}text"))
        # Axis titles, the log-scale quantity and one legend entry per strategy (the legend is inside the figure).
        assert "optimizer step" in texts and "relative deviation" in texts
        for name in ("ddp", GOOD, EVERY, WRONG):
            assert f"{name} (" in texts, name
    assert "wall time" in html and "declared" in html


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def test_report_opens_in_a_headless_browser(report, tmp_path):
    """The HTML is rendered by a real browser: the certificates are in the page and on the screenshot."""
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium on this machine (Debian: apt-get install -y chromium); CI installs it")
    page = (report.report_dir / "report.html").as_uri()
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1280,1600",
    ]
    dom = subprocess.run([browser, *flags, "--dump-dom", page], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    from html.parser import HTMLParser

    class Certificates(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.found: dict[str, tuple[str, str]] = {}
            self._current: str | None = None

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if (a.get("id") or "").startswith("certificate-"):
                self._current = a["id"][len("certificate-") :]
                self.found[self._current] = (a.get("class", ""), "")

        def handle_data(self, data):
            if self._current and data.strip() in ("certified", "not certified"):
                self.found[self._current] = (self.found[self._current][0], data.strip())
                self._current = None

    parser = Certificates()
    parser.feed(dom.stdout)
    assert parser.found["ddp"] == ("certificate certified", "certified")
    assert parser.found[EVERY][1] == "certified"
    assert parser.found[WRONG] == ("certificate not-certified", "not certified")

    shot = tmp_path / "report.png"
    run = subprocess.run([browser, *flags, f"--screenshot={shot}", page], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    from matplotlib.image import imread

    pixels = imread(str(shot))[..., :3]
    assert pixels.shape[0] == 1600 and pixels.shape[1] == 1280
    # The certified banner's green border (#1e8e3e) and the failed one's red (#c5221f) were painted.
    green = (
        (abs(pixels[..., 0] - 0x1E / 255) < 0.03)
        & (abs(pixels[..., 1] - 0x8E / 255) < 0.03)
        & (abs(pixels[..., 2] - 0x3E / 255) < 0.03)
    )
    red = (
        (abs(pixels[..., 0] - 0xC5 / 255) < 0.03)
        & (abs(pixels[..., 1] - 0x22 / 255) < 0.03)
        & (abs(pixels[..., 2] - 0x1F / 255) < 0.03)
    )
    assert green[:600].sum() > 200 and red[:600].sum() > 200, (green.sum(), red.sum())


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
        assert v.diagnosis.rule == "declaration"
        return
    run_id = _first_strategy_run(name)
    trace = result.traces[name][run_id]
    last = trace["steps"][-1]
    last["loss"] *= 1.1  # beyond every precision's loss tolerance
    v = judge_scenario(scenario, result, reference)
    assert v.status == "fail"
    assert any(d.quantity == "loss" and d.step == last["step"] for d in v.divergences), v.summary()
    assert v.diagnosis is not None


def _each_rank(trace, key):
    """``trace[key]`` of every rank, each object once (rank 0's is shared with the trace itself)."""
    seen = {}
    for holder in [trace, *trace.get("ranks", [])]:
        value = holder.get(key)
        if value is not None:
            seen.setdefault(id(value), value)
    return list(seen.values())


def _judge_mutated(report, scenario_name, mutate, strategy="ddp"):
    result = copy.deepcopy(_result(report, strategy))
    mutate(result.traces[scenario_name])
    return judge_scenario(SCENARIOS_BY_NAME[scenario_name], result, report.reference)


def test_broken_state_hooks_counts_and_sync_fail(report):
    def judge(mutate):
        return _judge_mutated(report, "accumulation", lambda runs: mutate(runs["main"]))

    def state(t):
        for st in _each_rank(t, "state"):
            st["0.weight"] = st["0.weight"] + 1e-4

    v = judge(state)
    assert v.status == "fail" and "final parameter '0.weight'" in v.reason

    def hooks(t):
        for calls in _each_rank(t, "hooks"):
            calls.remove("unison_on_after_backward")

    v = judge(hooks)
    assert any(d.quantity == "hook sequence" for d in v.divergences)
    assert v.diagnosis.rule == "hooks"

    def counts(t):
        t["counts"]["scheduler_steps"] += 1

    assert any(d.quantity == "scheduler steps" for d in judge(counts).divergences)

    def sync_in_no_sync(t):
        t["ranks"][1]["collectives"]["gradient_sync_in_no_sync"] = 3

    v = judge(sync_in_no_sync)
    assert any("inside no_sync() on rank 1" in d.quantity for d in v.divergences)
    assert v.diagnosis.rule == "gradient_sync"

    def sync_per_micro_step(t):
        for r in t["ranks"]:
            r["collectives"]["gradient_sync_per_step"] = [4] * len(r["collectives"]["gradient_sync_per_step"])
            r["collectives"]["gradient_sync_per_micro_step"] = [[1, 1, 1, 1]] * len(r["collectives"]["per_step"])

    v = judge(sync_per_micro_step)
    assert any("per optimizer step" in d.quantity for d in v.divergences)
    assert any("before the last micro-step" in d.quantity for d in v.divergences)

    def declared_every_step_but_deferred(t):
        t["accumulation_sync"] = "every-micro-step"

    v = judge(declared_every_step_but_deferred)
    assert any("no_sync() entries" in d.quantity for d in v.divergences)
    assert any("per micro-step" in d.quantity for d in v.divergences)

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
    assert v.diagnosis.rule == "premise"
    # Buffers that do not change: the premise of the buffers scenario.
    reference = copy.deepcopy(report.reference)
    snaps = reference["buffers"]["main"]["buffer_snapshots"]
    snaps[4] = copy.deepcopy(snaps[2])
    v = judge_scenario(SCENARIOS_BY_NAME["buffers"], base, reference)
    assert v.status == "fail" and any("premise: buffer" in d.quantity for d in v.divergences)
    # A strategy checkpoint that single resumes wrongly.
    result = copy.deepcopy(base)
    result.reference_traces["cross_resume"]["from_strategy"]["steps"][0]["grad_norm"] *= 2
    v = judge_scenario(SCENARIOS_BY_NAME["cross_resume"], result, report.reference)
    assert v.status == "fail" and v.divergences[0].run == "reference:from_strategy"
    assert v.diagnosis.rule == "resume_state" and "checkpoint the strategy wrote" in v.diagnosis.explanation
    # A reshardable declaration whose other-world resume never happened.
    result = copy.deepcopy(base)
    del result.traces["reshard"]["resumed"]
    result.world_errors["alt"] = "WorldError: rank 0 failed"
    v = judge_scenario(SCENARIOS_BY_NAME["reshard"], result, report.reference)
    assert v.status == "fail" and "rank 0 failed" in v.reason
    assert v.diagnosis.rule == "error"


# --------------------------------------------------------------------------- #
# Each diagnosis, on a deliberately broken copy of real traces
# --------------------------------------------------------------------------- #


def test_diagnosis_summed_gradients(report):
    """Grad-norm ratio = world size with the loss equal: summed, not averaged."""

    def summed(runs):
        for steps in _each_rank(runs["main"], "steps"):
            for s in steps:
                s["grad_norm"] *= 2
                s["hook_grad_norm"] *= 2

    v = _judge_mutated(report, "plain", summed)
    assert v.diagnosis.rule == "summed" and v.diagnosis.step == 0 and v.diagnosis.quantity == "grad_norm"
    assert "summed over replicas" in v.diagnosis.explanation


def test_diagnosis_optimizer_when_loss_matches_but_parameters_do_not(report):
    def wrong_update(runs):
        for st in _each_rank(runs["main"], "state"):
            for name in list(st):
                st[name] = st[name] + 1e-3

    v = _judge_mutated(report, "plain", wrong_update)
    assert v.diagnosis.rule == "optimizer", v.diagnosis.message()
    assert "every per-step loss and grad norm matches" in v.diagnosis.explanation

    def later_loss(runs):
        for steps in _each_rank(runs["main"], "steps"):
            for s in steps[2:]:
                s["loss"] *= 1.01
                s["micro_losses"] = [x * 1.01 for x in s["micro_losses"]]

    v = _judge_mutated(report, "plain", later_loss)
    assert v.diagnosis.rule == "optimizer" and v.diagnosis.step == 2
    assert "match up to step 1" in v.diagnosis.explanation


def test_diagnosis_replica_desync(report):
    def rank_one_apart(runs):
        state = runs["main"]["ranks"][1]["state"]
        state["2.weight"] = state["2.weight"] + 1e-2

    v = _judge_mutated(report, "plain", rank_one_apart)
    assert v.status == "fail" and v.diagnosis.rule == "replica_desync"
    assert "final state on rank 1" in v.diagnosis.quantity


def test_diagnosis_resume_restores_nothing_of_the_optimizer(report):
    def drift_after_resume(runs):
        for steps in _each_rank(runs["resumed"], "steps"):
            for s in steps[1:]:
                s["loss"] *= 1.01
                s["micro_losses"] = [x * 1.01 for x in s["micro_losses"]]

    v = _judge_mutated(report, "resume", drift_after_resume)
    assert v.diagnosis.rule == "resume_state", v.diagnosis.message()
    assert "optimizer state" in v.diagnosis.explanation and "full, part" in v.diagnosis.explanation

    def scheduler_not_restored(runs):
        for steps in _each_rank(runs["resumed"], "steps"):
            for s in steps:
                s["lrs"] = [lr * 3 for lr in s["lrs"]]

    v = _judge_mutated(report, "resume", scheduler_not_restored)
    assert v.diagnosis.rule == "resume_state" and "scheduler state" in v.diagnosis.explanation


def test_diagnosis_initial_weights(report):
    def first_forward_differs(runs):
        for steps in _each_rank(runs["main"], "steps"):
            s = steps[0]
            s["micro_losses"][0] *= 1.05
            s["loss"] = sum(s["micro_losses"]) / len(s["micro_losses"])

    v = _judge_mutated(report, "replica_init", first_forward_differs)
    assert v.diagnosis.rule == "initial_weights" and v.diagnosis.step == 0
    assert "perturbed the weights of every rank but 0" in v.diagnosis.explanation


# --------------------------------------------------------------------------- #
# Skipped, declared out and declared non-conformant are never "passed"
# --------------------------------------------------------------------------- #


def test_unavailable_strategy_is_skipped_with_its_reason(tmp_path):
    rep = certify([UNAVAILABLE], plugins=[THIS_MODULE], report_dir=tmp_path)
    assert {v.status for v in rep.verdicts[UNAVAILABLE].values()} == {"skipped"}
    assert "imaginary-accelerator" in rep.verdicts[UNAVAILABLE]["plain"].reason
    assert not rep.certified(UNAVAILABLE)
    assert rep.exit_code == 0
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["strategies"][0]["status"] == "skipped"
    assert data["certificates"][0]["label"] == "not certified" and "imaginary" in data["certificates"][0]["summary"]


def test_declared_non_conformant_is_run_and_its_failures_shown(report):
    wrong = copy.deepcopy(_result(report, WRONG))
    wrong.non_conformant = "averages gradients twice (known)"
    rep = SuiteReport(
        world_size=2,
        alt_world_size=1,
        scenarios=report.scenarios,
        results=[wrong],
        verdicts={WRONG: report.verdicts[WRONG]},
        reference=report.reference,
        reference_wall_s=0.0,
        wall_s=0.0,
    )
    assert rep.exit_code == 0  # declared: shown, not gating
    assert len(rep.failures(include_declared=True)) == len(SCENARIOS) - len(SELF_COMPARED)
    assert not rep.certified(WRONG)
    from rich.console import Console

    console = Console(record=True, width=200)
    rep.print_table(console)
    text = console.export_text()
    assert "declared non-conformant" in text and "FAIL" in text


def test_declared_unsupported_precision_is_declared_out_only_when_refused(report):
    """A precision declared unsupported: the run's refusal (DeclaredRefusal) makes the scenario declared out."""
    result = copy.deepcopy(_result(report, GOOD))
    result.ownership["precision"]["bf16-mixed"] = {"owner": "unsupported", "detail": "no bf16 here"}
    result.traces["bf16_mixed"]["main"] = {
        "status": "refused",
        "reason": "precision: ...",
        "refusal": {
            "type": "DeclaredRefusal",
            "option": "precision",
            "feature": "precision:bf16-mixed",
            "message": "precision: strategy does not support precision 'bf16-mixed': no bf16 here",
        },
    }
    v = judge_scenario(SCENARIOS_BY_NAME["bf16_mixed"], result, report.reference)
    assert v.status == DECLARED_OUT and "no bf16 here" in v.reason
    # The same refusal without the declaration is a failure.
    result.ownership["precision"]["bf16-mixed"] = {"owner": "trainer", "detail": "autocast"}
    v = judge_scenario(SCENARIOS_BY_NAME["bf16_mixed"], result, report.reference)
    assert v.status == "fail" and v.diagnosis.rule == "undeclared_refusal"


def test_an_optimizer_refusal_is_declared_out_only_under_a_declared_optimizer_restriction(report):
    """A strategy that accepts only some optimizer classes declares Feature.ANY_OPTIMIZER refused; an unrelated
    declared refusal does not cover a refusal of the optimizer."""
    result = copy.deepcopy(_result(report, GOOD))
    result.traces["plain"]["main"] = {
        "status": "refused",
        "reason": "optimizer: ...",
        "refusal": {
            "type": "ConfigurationError",
            "option": "optimizer",
            "feature": None,
            "message": "optimizer: strategy trains with an Adam optimizer; the factory returned torch.optim.SGD",
        },
    }
    result.ownership["refuses"] = {"any_optimizer": "Adam optimizers only"}
    v = judge_scenario(SCENARIOS_BY_NAME["plain"], result, report.reference)
    assert v.status == DECLARED_OUT and "any_optimizer refused: Adam optimizers only" in v.reason
    # Declaring something else the run needs (its loss_fn batch form) does not cover the optimizer refusal.
    result.ownership["refuses"] = {"loss_fn": "training_step only"}
    v = judge_scenario(SCENARIOS_BY_NAME["plain"], result, report.reference)
    assert v.status == "fail" and v.diagnosis.rule == "undeclared_refusal"
    assert "refused optimizer although it declares it supported" in v.diagnosis.explanation


def test_an_error_after_setup_is_never_declared_out(report):
    result = copy.deepcopy(_result(report, GOOD))
    result.ownership["refuses"] = {"gradient_accumulation": "declared"}
    result.traces["accumulation"]["main"] = {
        "status": "error",
        "error": "unison.errors.ConfigurationError: accumulate_grad_batches: no. Fix: ...",
    }
    v = judge_scenario(SCENARIOS_BY_NAME["accumulation"], result, report.reference)
    assert v.status == "fail" and v.diagnosis.rule == "error"


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
    out = runner.invoke(
        cli, ["conformance", "--strategy", UNAVAILABLE, "--plugin", THIS_MODULE, "--report", str(tmp_path)]
    )
    assert out.exit_code == 0, out.output
    assert "skipped" in out.output and "NOT CERTIFIED" in out.output
    assert (tmp_path / "report.html").exists()
    # Declarations only: no world is started, and the wrong strategy fails with exit status 1.
    # Without --report the report is still written, to ./conformance-report, and its path printed.
    with runner.isolated_filesystem(temp_dir=tmp_path):
        out = runner.invoke(
            cli,
            ["conformance", "--strategy", WRONG, "--plugin", EXAMPLE_MODULE, "--scenario", "unsupported_precision"],
        )
        assert out.exit_code == 1, out.output
        assert "FAIL" in out.output
        assert "report: conformance-report/report.html" in out.output.replace("\n", "")
        assert Path("conformance-report/report.html").exists() and Path("conformance-report/report.json").exists()


def test_pytest_plugin(pytester, monkeypatch):
    """One pytest session: unavailable -> skipped, conforming -> passed, wrong -> failed (no world needed)."""
    paths = [str(EXAMPLE_DIR), str(Path(__file__).resolve().parent)]
    monkeypatch.setenv("PYTHONPATH", ":".join(paths + [p for p in sys.path if p]))
    result = pytester.runpytest_subprocess(
        "-p",
        "unison.conformance.pytest_plugin",
        "--pyargs",
        "unison.conformance",
        "-p",
        "no:cacheprovider",
        "--unison-strategy",
        f"{UNAVAILABLE},{GOOD},{WRONG}",
        "--unison-plugin",
        f"{THIS_MODULE},{EXAMPLE_MODULE}",
        "--unison-scenario",
        "unsupported_precision",
        "-rA",
    )
    result.assert_outcomes(passed=1, failed=1, skipped=1)
    result.stdout.fnmatch_lines(["*imaginary-accelerator*"])
    result.stdout.fnmatch_lines(["*declared-supported precision*bf16-true*"])
    result.stdout.fnmatch_lines(["*likely cause: refused something it declares supported*"])


pytest_plugins = ["pytester"]
