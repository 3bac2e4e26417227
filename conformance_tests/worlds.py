"""Phases and worlds: which runs execute where, and what a failed world reports.

One strategy is one world: a single :func:`unison.launch.torchrun.spawn` of
``world_size`` ranks runs *every* scenario's strategy runs, one after the
other, in that one process group (starting a world costs seconds; a scenario
costs a fraction of one). The reference (``single``) runs in this process,
before the world, on the same global batches; it is computed once per world
size and shared by every strategy of a suite.

Phases, in order (each depends on the checkpoints of the one before)::

    reference      this process   the reference runs (their checkpoints feed the world)
    world          spawn(N)       the strategy's runs at the main world size
    reference-post this process   reference-backend runs resuming the strategy's checkpoints
    alt-world      spawn(M)       the strategy resuming its own checkpoint at another world
                                  size (only when it declares its state_dict reshardable)
    fresh-world    spawn(N)       the strategy resuming its own checkpoint in new processes of
                                  the main size (nothing a process caches survives into them)

A world's ranks are forked from the fork server of :func:`~unison.launch.torchrun.spawn`, which only
imported libraries: no rank of a later world holds anything an earlier world's ranks ran or cached.
Every phase runs with ``UNISON_CHECK_PLUGIN_RNG=1`` (:func:`rng_guarded`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from unison.checkpointing.checkpointer import Checkpointer
from unison.conformance.data import Sizing
from unison.conformance.execution import REFERENCE, execute_run
from unison.conformance.profiling import enable_flight_recorder
from unison.conformance.scenarios import select
from unison.conformance.spec import Run, Scenario
from unison.plugin.rng_guard import CHECK_RNG_ENV


@dataclass(frozen=True)
class PhaseContext:
    """Everything a phase needs; picklable, so it travels to spawned ranks."""

    strategy: str
    backend: str  # "reference" | "strategy"
    world: str  # "main" | "alt" | "fresh"
    scenarios: tuple[str, ...]
    sizing: Sizing
    plugins: tuple[str, ...]
    #: Root of this phase's own checkpoints.
    checkpoint_root: str
    #: Roots of the other backend's checkpoints, for cross-backend resume.
    reference_root: str
    strategy_root: str
    #: Only runs resuming from the other backend (reference-post phase).
    cross_only: bool = False
    #: The strategy declares its state_dict reshardable; scenarios that need
    #: it are not run otherwise (they are declared out).
    reshardable: bool = True
    #: Where ranks note the run they are in and, after ``dump_stacks_after``
    #: seconds, dump every thread's stack (what a hung world reports).
    diagnostics_dir: str | None = None
    dump_stacks_after: float | None = None


def _checkpoint_root(root: str, scenario: str, run_id: str) -> Path:
    return Path(root) / scenario / run_id


def _resume_source(ctx: PhaseContext, scenario: Scenario, run: Run) -> Path | None:
    if run.resume_from is None:
        return None
    backend, _, run_id = run.resume_from.rpartition(":")
    backend = backend or ctx.backend
    root = ctx.reference_root if backend == "reference" else ctx.strategy_root
    source = Checkpointer(_checkpoint_root(root, scenario.name, run_id)).latest()
    if source is None:
        raise _NotRun(
            f"not run: {backend} run {run_id!r} of scenario {scenario.name!r} left no checkpoint to resume "
            "(it was refused or failed; its own trace says which)"
        )
    return source


class _NotRun(Exception):
    """The run this one resumes from left no checkpoint: this run was never started."""


def phase_runs(ctx: PhaseContext, scenario: Scenario) -> list[Run]:
    runs = []
    for run in scenario.runs:
        if run.backend != ctx.backend or run.world != ctx.world:
            continue
        if ctx.backend == "reference":
            # Reference runs resuming a strategy's checkpoint wait for the world.
            from_strategy = (run.resume_from or "").startswith("strategy:")
            if from_strategy != ctx.cross_only:
                continue
        runs.append(run)
    return runs


def run_phase(ctx: PhaseContext) -> dict[str, dict[str, dict[str, Any]]]:
    """Run every run of this phase, scenario by scenario; ``{scenario: {run_id: trace}}``.

    Module-level so spawned ranks can import it. Rank 0 keeps the canonical
    state in its traces; other ranks drop it (it is compared once).
    """
    enable_flight_recorder()  # before the first fit starts the process group: each collective's group
    dist_on = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if dist_on else 0
    strategy = REFERENCE if ctx.backend == "reference" else ctx.strategy
    out: dict[str, dict[str, dict[str, Any]]] = {}
    with _diagnostics(ctx, rank) as where, rng_guarded():
        for scenario in select(ctx.scenarios, ctx.sizing):
            if scenario.kind != "train" or (scenario.requires_reshardable and not ctx.reshardable):
                continue
            if scenario.unavailable():
                continue  # judged skipped, with the reason
            for run in phase_runs(ctx, scenario):
                where(f"scenario {scenario.name!r}, run {ctx.backend}:{run.id}")
                _run_one(ctx, scenario, run, strategy, rank, out)
    return out


@contextlib.contextmanager
def rng_guarded() -> Iterator[None]:
    """Every run of the suite checks that no lifecycle plugin touches the training RNG states
    (``UNISON_CHECK_PLUGIN_RNG=1``, :mod:`unison.plugin.rng_guard`): a plugin that draws from them fails its
    run with the guard's ``PluginError``. Set around the phase only: the suite's caller keeps its own setting."""
    saved = os.environ.get(CHECK_RNG_ENV)
    os.environ[CHECK_RNG_ENV] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(CHECK_RNG_ENV, None)
        else:
            os.environ[CHECK_RNG_ENV] = saved


@contextlib.contextmanager
def _diagnostics(ctx: PhaseContext, rank: int) -> Iterator[Any]:
    """Note the current run per rank; dump all stacks if the world outlives its budget."""
    if ctx.diagnostics_dir is None:
        yield lambda text: None
        return
    import faulthandler

    base = Path(ctx.diagnostics_dir)
    base.mkdir(parents=True, exist_ok=True)
    where_file = base / f"{ctx.world}-rank{rank}.where"
    started = time.time()

    def where(text: str) -> None:
        where_file.write_text(f"{text} (started {time.time() - started:.1f} s into the world)\n")

    with open(base / f"{ctx.world}-rank{rank}.stacks", "w") as stacks:
        if ctx.dump_stacks_after:
            faulthandler.dump_traceback_later(ctx.dump_stacks_after, exit=False, file=stacks)
        try:
            yield where
        finally:
            faulthandler.cancel_dump_traceback_later()


def world_diagnostics(directory: Path, world: str) -> str:
    """What the ranks of a failed world were doing: their current run and stack dump."""
    lines = []
    for where in sorted(directory.glob(f"{world}-rank*.where")):
        rank = where.stem.split("rank")[-1]
        lines.append(f"rank {rank} was in {where.read_text().strip()}")
        stacks = directory / f"{world}-rank{rank}.stacks"
        if stacks.exists() and stacks.stat().st_size:
            text = stacks.read_text().strip().splitlines()
            # The main thread's stack (faulthandler prints it first), innermost call first.
            main: list[str] = []
            for line in text:
                if line.startswith("Thread") and main:
                    break
                main.append(line)
            lines.append(f"rank {rank} stack when the world ran out of time:\n  " + "\n  ".join(main[:40]))
    return "\n".join(lines)


def _run_one(
    ctx: PhaseContext, scenario: Scenario, run: Run, strategy: str, rank: int, out: dict[str, dict[str, dict[str, Any]]]
) -> None:
    try:
        resume = _resume_source(ctx, scenario, run)
    except _NotRun as exc:  # not this run's failure: the cell is judged on the run before it
        out.setdefault(scenario.name, {})[run.id] = {"status": "not_run", "reason": str(exc), "wall_s": 0.0}
        return
    except BaseException as exc:  # an unreadable checkpoint: this run's failure
        if isinstance(exc, KeyboardInterrupt):
            raise
        out.setdefault(scenario.name, {})[run.id] = {
            "status": "error",
            "error": f"{type(exc).__name__}: {exc}",
            "wall_s": 0.0,
        }
        return
    writes = run.save or scenario.checkpoint_every is not None
    run_root = _checkpoint_root(ctx.checkpoint_root, scenario.name, run.id)
    trace = execute_run(
        scenario,
        run,
        strategy=strategy,
        sizing=ctx.sizing,
        plugins=ctx.plugins,
        checkpoint_dir=run_root if writes else None,
        resume_path=resume,
        root_dir=run_root / "run" if run.defaults else None,
    )
    out.setdefault(scenario.name, {})[run.id] = trace


def merge_ranks(results: list[dict[str, dict[str, dict[str, Any]]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Rank 0's traces, each with ``ranks``: what every rank saw (for per-rank checks)."""
    keys = (
        "status",
        "hooks",
        "collectives",
        "counts",
        "boundaries",
        "steps",
        "state",
        "buffer_snapshots",
        "validations",
        "refusal",
        "error",
        "precision_probe",
        "feature_probe",
        "param_groups",
        "saved_optimizer_state",
        "loaded_optimizer_state",
        "process_groups",
    )
    merged = results[0]
    for scenario, runs in merged.items():
        for run_id, trace in runs.items():
            trace["ranks"] = [{k: r[scenario][run_id].get(k) for k in keys} for r in results]
    return merged
