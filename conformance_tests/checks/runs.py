"""One run against another: bit for bit (``exact_as``), against the full-batch reference, against its
twin of the same shape in the reference, against a ground truth; and the error line of a run that failed.

:func:`unison.conformance.compare.judge_scenario` calls these for each run of a scenario.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from unison.conformance.checks.numeric import Checker, run_label
from unison.conformance.spec import Run, Scenario
from unison.conformance.validation import check_validations
from unison.conformance.verdict import Tolerance

_EXCEPTION_LINE = re.compile(r"^[\w.]+(Exception|Error|Exit|Interrupt|Warning)\b.*")


def error_line(trace: dict[str, Any]) -> str:
    """The error's last line; with the outermost exception first when it wraps another
    (``CheckpointException`` holds each rank's failure)."""
    text = (trace.get("error") or trace.get("reason") or "").strip()
    if not text:
        return "unknown error"
    last = text.splitlines()[-1]
    raised = [line for line in text.splitlines() if _EXCEPTION_LINE.match(line)]
    if raised and raised[0] != last and raised[0].split(":")[0] not in last:
        return f"{raised[0]} ... {last}"
    return last


#: Hooks whose number of calls depends on the world size by design: one per
#: validation batch of this replica (the reference runs more, smaller-world
#: strategies fewer, each over more samples).
_PER_REPLICA_BATCH_HOOKS = ("unison_validation_progress",)

#: Hooks a strategy asks about the user's model, outside the lifecycle order every backend shares: only a
#: tensor-parallel strategy asks for the plan of a model without one (once per submodule, at its checks
#: and again when it shards), the reference never does.
_STRATEGY_QUERY_HOOKS = ("unison_tensor_parallel_plan",)


def _comparable_hooks(hooks: list[str]) -> list[str]:
    return [h for h in hooks if h not in _PER_REPLICA_BATCH_HOOKS and h not in _STRATEGY_QUERY_HOOKS]


#: Tolerance 0: what must change nothing at all changes no bit.
EXACT = Tolerance(param=0.0, loss=0.0, grad_norm=0.0, lr=0.0)


def compare_exactly(
    c: Checker, label: str, t: dict[str, Any], other: dict[str, Any] | None, against: str, buffers: Iterable[str]
) -> None:
    """Every per-step number and the final state of ``t`` equal ``other``'s bit for bit."""
    if other is None or other.get("status") != "ok":
        c.fail(label, "exact_as", note=f"{against} missing", kind="run")
        return
    exact = Checker(c.scenario, EXACT)
    exact.steps(label, t, other, against, exact_range=False)
    exact.state(label, t.get("state"), other.get("state"), against, buffers=buffers)
    if exact.max_param is not None:  # the scenario's deviation: 0.0 when bit for bit
        c.max_param = exact.max_param if c.max_param is None else max(c.max_param, exact.max_param)
    for d in exact.divergences:
        d.note = "; ".join(filter(None, [d.note, "must be equal bit for bit"]))
    c.divergences.extend(exact.divergences)


def compare_to_full_batch(
    c: Checker,
    scenario: Scenario,
    label: str,
    t: dict[str, Any],
    ref_runs: dict[str, dict[str, Any]],
    buffers: Iterable[str],
) -> None:
    """Per-step loss and grad norm and the final state of ``t`` equal the full-batch reference's (accumulation 1;
    the micro-batch losses differ by design: one micro-batch there)."""
    if scenario.full_batch is None:
        return
    full = ref_runs.get(scenario.full_batch)
    against = run_label("reference", scenario.full_batch)
    if full is None or full.get("status") != "ok":
        c.fail(label, "full-batch reference", note=f"{against} missing", kind="run")
        return
    want = {s["step"]: s for s in full.get("steps", [])}
    for s in t.get("steps", []):
        w = want.get(s["step"])
        if w is None:
            note = "the reference has no such step"
            c.fail(label, "steps run", step=s["step"], against=against, note=note, kind="counts")
            continue
        c.close(label, against, "loss", s["step"], s["loss"], w["loss"], c.tol.loss, "loss", track_loss=True)
        c.close(label, against, "grad_norm", s["step"], s["grad_norm"], w["grad_norm"], c.tol.grad_norm, "grad_norm")
    c.state(label, t.get("state"), full.get("state"), against, buffers=buffers)


def compare_to_twin(
    c: Checker,
    scenario: Scenario,
    run: Run,
    label: str,
    t: dict[str, Any],
    ref_runs: dict[str, dict[str, Any]],
    buffers: list[str],
) -> None:
    """Against the reference run of the same shape: hooks, step counts, per-step numbers, buffers, final state."""
    twin = ref_runs.get(run.twin or "")
    against = run_label("reference", run.twin or "")
    if twin is None or twin["status"] != "ok":
        c.fail(label, "twin", note=f"reference run {run.twin!r} missing", kind="run")
        return
    hooks, twin_hooks = _comparable_hooks(t["hooks"]), _comparable_hooks(twin["hooks"])
    if hooks != twin_hooks:
        first = _first_difference(twin_hooks, hooks)
        c.fail(
            label,
            "hook sequence",
            expected=first[0],
            got=first[1],
            against=against,
            kind="hooks",
            note=f"first difference at call {first[2]}",
        )
    for key in ("optimizer_steps", "scheduler_steps"):
        if t["counts"][key] != twin["counts"][key]:
            c.fail(
                label,
                key.replace("_", " "),
                expected=twin["counts"][key],
                got=t["counts"][key],
                against=against,
                kind="counts",
            )
    c.steps(label, t, twin, against, exact_range=True)
    if scenario.val_every:
        check_validations(c, label, t, twin, against)
    c.buffer_snapshots(label, t.get("buffer_snapshots"), twin.get("buffer_snapshots"), against)
    c.state(label, t.get("state"), twin.get("state"), against, buffers=buffers)


def compare_to_truth(
    c: Checker, run: Run, label: str, t: dict[str, Any], ref_runs: dict[str, dict[str, Any]], buffers: Iterable[str]
) -> None:
    truth = ref_runs.get(run.truth or "")
    against = run_label("reference", run.truth or "?")
    if truth is None or truth["status"] != "ok":
        c.fail(label, "truth", note=f"reference run {run.truth!r} missing", kind="run")
        return
    if t.get("status") != "ok":
        c.fail(label, "run", note=f"{t.get('status')}: {error_line(t)}", kind="run")
        return
    c.steps(label, t, truth, against, exact_range=False)
    last = max((s["step"] for s in t.get("steps", [])), default=None)
    truth_last = max((s["step"] for s in truth.get("steps", [])), default=None)
    if last is not None and last == truth_last:
        c.state(label, t.get("state"), truth.get("state"), against, buffers=buffers)


def _first_difference(a: list[str], b: list[str]) -> tuple[Any, Any, int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return x, y, i
    n = min(len(a), len(b))
    return (a[n] if n < len(a) else "(end)"), (b[n] if n < len(b) else "(end)"), n
