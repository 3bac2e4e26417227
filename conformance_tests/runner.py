"""Executes the scenario catalogue for one strategy and for the reference.

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

Every run produces a *trace* (a plain dict, JSON-able but for ``state``):

``steps``
    per optimizer step: ``loss``, ``micro_losses``, ``grad_norm``, ``lrs``
    (every parameter group), ``skipped`` — as the trainer reported them to
    ``unison_on_train_step_end`` — plus the grad norm the
    ``unison_on_before_optimizer_step`` hook saw.
``hooks``
    every ``unison_*`` hook called during ``fit``, in order, recorded with
    :meth:`unison.PluginManager.record_hook_calls` (pluggy's hook-call
    monitoring: exactly what plugins see).
``counts``
    the trainer's optimizer and scheduler step counts, and what really
    happened: the optimizer steps in which the optimizer the user's factory
    built was really stepped (an optimizer step post-hook, counted between
    ``unison_on_before_optimizer_step`` and ``unison_on_after_optimizer_step``)
    and the scheduler's ``last_epoch``.
``collectives``
    calls made on the real process group, counted from the ``c10d::*``
    dispatcher operations recorded by ``torch.profiler``. Why the profiler
    and not wrapped ``torch.distributed`` functions: DDP's reducer (and other
    C++ engines) call the ProcessGroup from C++ and never pass through the
    Python functions; every collective, from Python or C++, goes through the
    ``c10d`` dispatcher ops. Counted per kind for the whole fit, per optimizer
    step inside the forward/backward window (``unison_on_train_step_start`` to
    ``unison_on_after_backward``), and inside the strategy's ``no_sync()``.
    Per micro-step too (``gradient_sync_per_micro_step``): each micro-step's
    window runs from the end of the previous micro-step's ``backward`` (or the
    step's start) to the end of its own, so the suite can check the declared
    :class:`~unison.contract.ownership.GradSync` (boundary only, or every micro-step).
``boundaries``
    for engine-owned accumulation, what ``is_accumulation_boundary()``
    answered at every micro-step.
``state``
    ``trainer.full_state_dict()`` after ``fit``, on every rank (so replicas
    that end apart are seen).
``precision_probe``
    in a ``*-mixed`` scenario's strategy runs: the dtypes of every ``Linear``
    output seen inside forward and of the parameters the optimizer updates
    (:class:`~unison.conformance.sensitivity.PrecisionProbe`).
``buffer_snapshots``
    ``{step: canonical buffers}`` taken from ``trainer.full_state_dict()``
    inside ``unison_on_save_checkpoint``, at every checkpoint the run writes.

A run whose Trainer refuses the configuration with a ``ConfigurationError``
*before* ``fit`` starts the process group and the strategy's setup
(``trainer.setup_started`` is still ``False``) is recorded as ``refused``,
with the option, the declared feature (:class:`unison.DeclaredRefusal`) and
the message; the comparison decides whether the declaration allowed it. A
``ConfigurationError`` once setup started, and any other exception, is an
``error`` with the traceback: never a refusal. If a rank fails inside a
collective the other ranks cannot continue: the world then times out and every
strategy run of it is reported with the world's error, which names the run
each rank was in and, for a hang, each rank's stack (dumped by
``faulthandler`` shortly before the world is killed).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import shutil
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import unison
from unison.checkpointing.checkpointer import Checkpointer
from unison.conformance.scenarios import (
    OPTIMIZERS,
    SCHEDULERS,
    Run,
    Scenario,
    Sizing,
    build_model,
    default_alt_world_size,
    loss_fn,
    perturb,
    select,
    training_step,
)
from unison.conformance.sensitivity import PrecisionProbe, probes_apply
from unison.conformance.validation import validation_data
from unison.contract.ownership import STANDARD_PRECISIONS, WorldSizes
from unison.errors import ConfigurationError, DeclaredRefusal

REFERENCE = "single"

STEP_MARK = "unison.conformance::forward_backward"
NO_SYNC_MARK = "unison.conformance::no_sync"
MICRO_MARK = "unison.conformance::backward"

#: ``c10d`` dispatcher op -> collective kind.
COLLECTIVE_KINDS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "broadcast_": "broadcast",
    "reduce_": "reduce",
    "gather_": "gather",
    "scatter_": "scatter",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "barrier": "barrier",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
}
#: The kinds that synchronise gradients (what ``no_sync`` must suppress):
#: all-reduce (DDP), reduce-scatter (FSDP, ZeRO-2/3) and reduce to the
#: owning rank (fairscale ShardedDataParallel).
GRADIENT_SYNC_KINDS = ("all_reduce", "reduce_scatter", "reduce")


# --------------------------------------------------------------------------- #
# Plugins
# --------------------------------------------------------------------------- #


def make_plugin_manager(plugins: Sequence[str] = ()) -> unison.PluginManager:
    """A manager with the entry-point plugins plus ``plugins`` (module names).

    A module that is already registered (installed *and* named) is not
    registered twice.
    """
    pm = unison.PluginManager()
    for name in plugins:
        module = importlib.import_module(name)
        if not pm.is_registered(module):
            pm.register(module, name=name)
    pm.check_pending()
    return pm


# --------------------------------------------------------------------------- #
# Recording one run
# --------------------------------------------------------------------------- #


class TraceRecorder:
    """A plugin recording what the trainer reports at every optimizer step."""

    def __init__(self, buffer_names: Sequence[str] = ()) -> None:
        self.steps: list[dict[str, Any]] = []
        #: Canonical names of the model's buffers (recorded at every checkpoint).
        self.buffer_names = tuple(buffer_names)
        self.buffer_snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.hook_grad_norms: dict[int, float] = {}
        self.start_counts: dict[str, int] | None = None
        self._mark: Any = None
        #: True between ``before_optimizer_step`` and ``after_optimizer_step``:
        #: the only place a real optimizer update belongs. (Loading optimizer
        #: state through torch.distributed.checkpoint.state_dict runs one
        #: zero-lr ``step()`` to materialise the state; that is not an update.)
        self.in_update = False
        #: ``step()`` calls of the user's optimizer per optimizer step. An
        #: engine may call it more than once per update (DeepSpeed ZeRO steps
        #: it once per parameter group, narrowing ``param_groups``), so what is
        #: checked is whether it was called at all, per step.
        self.step_calls: dict[int, int] = {}
        self.current_step: int | None = None
        self.updates_outside_window = 0
        #: ``{"step", "loss"}`` of every validation (``val/loss``).
        self.validations: list[dict[str, Any]] = []

    def count_update(self) -> None:
        if self.in_update and self.current_step is not None:
            self.step_calls[self.current_step] = self.step_calls.get(self.current_step, 0) + 1
        else:
            self.updates_outside_window += 1

    def _close_mark(self) -> None:
        if self._mark is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None

    @unison.hookimpl
    def unison_on_train_step_start(self, trainer: Any, step: int) -> None:
        if self.start_counts is None:
            # After a checkpoint load (which happens after fit_start), so a
            # resumed run's counts start where the checkpoint left them.
            self.start_counts = {
                "optimizer_steps": trainer.progress.optimizer_steps,
                "scheduler_steps": trainer.progress.scheduler_steps,
            }
        self._close_mark()
        self._mark = torch.autograd.profiler.record_function(STEP_MARK)
        self._mark.__enter__()

    @unison.hookimpl
    def unison_on_after_backward(self, step: int) -> None:
        self._close_mark()

    @unison.hookimpl
    def unison_on_before_optimizer_step(self, step: int, grad_norm: float) -> None:
        self.hook_grad_norms[step] = float(grad_norm)
        self.in_update = True
        self.current_step = step

    @unison.hookimpl
    def unison_on_after_optimizer_step(self, step: int, skipped: bool) -> None:
        self.in_update = False

    @unison.hookimpl
    def unison_on_save_checkpoint(self, trainer: Any) -> None:
        # Collective (every rank writes the checkpoint): the canonical state,
        # as a user exporting it at that moment would get it.
        if self.buffer_names:
            state = trainer.full_state_dict()
            self.buffer_snapshots[trainer.progress.global_step] = {k: state[k] for k in self.buffer_names if k in state}

    @unison.hookimpl
    def unison_on_validation_end(self, step: int, metrics: dict[str, float]) -> None:
        self.validations.append({"step": step, "loss": float(metrics["val/loss"])})

    @unison.hookimpl
    def unison_on_train_step_end(self, step: int, output: Any) -> None:
        self.steps.append(
            {
                "step": step,
                "loss": float(output.loss),
                "micro_losses": [float(x) for x in output.micro_losses],
                "grad_norm": float(output.grad_norm),
                "hook_grad_norm": self.hook_grad_norms.get(step),
                "lrs": [float(x) for x in output.lrs],
                "skipped": bool(output.skipped),
                "optimizer_step_calls": self.step_calls.get(step, 0),
            }
        )


def _analyse_collectives(events: Any) -> dict[str, Any]:
    windows: list[tuple[float, float]] = []
    no_sync: list[tuple[float, float]] = []
    backward_ends: list[float] = []
    calls: list[tuple[float, str]] = []
    for e in events:
        name = e.name
        if name == STEP_MARK:
            windows.append((e.time_range.start, e.time_range.end))
        elif name == NO_SYNC_MARK:
            no_sync.append((e.time_range.start, e.time_range.end))
        elif name == MICRO_MARK:
            backward_ends.append(e.time_range.end)
        elif name.startswith("c10d::"):
            op = name[len("c10d::") :]
            calls.append((e.time_range.start, COLLECTIVE_KINDS.get(op, f"other:{op}")))
    windows.sort()
    total = Counter(kind for _, kind in calls)

    def inside(t: float, spans: list[tuple[float, float]]) -> bool:
        return any(a <= t <= b for a, b in spans)

    def grad_syncs(a: float, b: float, *, open_start: bool = False) -> int:
        return sum(
            1 for t, kind in calls if kind in GRADIENT_SYNC_KINDS and (a < t if open_start else a <= t) and t <= b
        )

    per_step = []
    per_micro_step = []
    backward_ends.sort()
    for a, b in windows:
        kinds = Counter(kind for t, kind in calls if a <= t <= b)
        per_step.append(dict(kinds))
        # Micro-step i: from the end of backward i-1 (or the step's start) to the end of backward i.
        ends = [e for e in backward_ends if a <= e <= b]
        micro, start = [], a
        for i, end in enumerate(ends):
            micro.append(grad_syncs(start, end, open_start=i > 0))
            start = end
        per_micro_step.append(micro)
    grad_in_no_sync = sum(1 for t, kind in calls if kind in GRADIENT_SYNC_KINDS and inside(t, no_sync))
    return {
        "total": dict(total),
        "per_step": per_step,
        "gradient_sync_per_step": [sum(s.get(k, 0) for k in GRADIENT_SYNC_KINDS) for s in per_step],
        "gradient_sync_per_micro_step": per_micro_step,
        "gradient_sync_in_no_sync": grad_in_no_sync,
        "no_sync_entries": len(no_sync),
    }


@contextlib.contextmanager
def _profile(enabled: bool) -> Iterator[list[Any]]:
    out: list[Any] = []
    if not enabled:
        yield out
        return
    from torch.profiler import ProfilerActivity, profile

    # Kineto prints two "USDT ... profiler_start/stop" lines per profiled run
    # on stderr; a suite profiles every run on every rank. Read when the
    # profiler starts, so setting it here is enough; a user's setting wins.
    os.environ.setdefault("KINETO_LOG_LEVEL", "99")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False, with_stack=False) as prof:
        yield out
    out.append(prof)


def _instrument(strategy: Any, boundaries: list[bool]) -> None:
    """Observe ``no_sync``, ``backward`` and ``is_accumulation_boundary`` on this strategy instance.

    Instance attributes shadow the methods: the strategy's behaviour is
    unchanged, the suite only marks the time spans and records the answers.
    """
    original_backward = strategy.backward

    def backward(loss: Any) -> None:
        with torch.autograd.profiler.record_function(MICRO_MARK):
            original_backward(loss)

    strategy.backward = backward
    original_no_sync = getattr(strategy, "no_sync", None)
    if original_no_sync is not None:

        @contextlib.contextmanager
        def no_sync() -> Iterator[Any]:
            with torch.autograd.profiler.record_function(NO_SYNC_MARK), original_no_sync() as value:
                yield value

        strategy.no_sync = no_sync
    original_boundary = getattr(strategy, "is_accumulation_boundary", None)
    if original_boundary is None:
        return

    def is_accumulation_boundary() -> bool:
        answer = bool(original_boundary())
        boundaries.append(answer)
        return answer

    strategy.is_accumulation_boundary = is_accumulation_boundary


def execute_run(
    scenario: Scenario,
    run: Run,
    *,
    strategy: str,
    sizing: Sizing,
    plugins: Sequence[str],
    checkpoint_dir: Path | None,
    resume_path: Path | None,
) -> dict[str, Any]:
    """One ``fit`` of ``scenario`` under ``strategy``; returns its trace (on every rank)."""
    started = time.perf_counter()
    dist_on = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if dist_on else 0
    trace: dict[str, Any] = {"status": "ok", "rank": rank}
    trainer: Any = None
    try:
        pm = make_plugin_manager(plugins)
        model = build_model(scenario.model)
        recorder = TraceRecorder(buffer_names=[name for name, _ in model.named_buffers()])
        probe = PrecisionProbe() if run.backend == "strategy" and probes_apply(scenario) else None
        if probe is not None:
            probe.attach(model)
        settings = scenario.trainer_settings(sizing, run)
        if checkpoint_dir is not None:
            settings["checkpoint_dir"] = str(checkpoint_dir)
        trainer = unison.Trainer(
            strategy=strategy, plugin_manager=pm, callbacks=[recorder], loggers=False, **settings
        )  # loggers=False: the suite's runs leave no run directory behind
        boundaries: list[bool] = []
        _instrument(trainer.strategy, boundaries)
        optimizers: list[torch.optim.Optimizer] = []
        schedulers: list[Any] = []

        def make_optimizer(params: Any) -> torch.optim.Optimizer:
            opt = OPTIMIZERS[scenario.optimizer](params)
            optimizers.append(opt)
            opt.register_step_post_hook(lambda *_: recorder.count_update())
            if probe is not None:
                probe.watch(opt)
            return opt

        def make_scheduler(opt: torch.optim.Optimizer) -> Any:
            sched = SCHEDULERS[scenario.scheduler](opt)  # type: ignore[index]
            schedulers.append(sched)
            return sched

        if run.perturb is not None and rank != 0:
            perturb(model, run.perturb, rank)
        data = scenario.dataset(sizing)
        form: dict[str, Any] = {"loss_fn": loss_fn} if scenario.form == "loss_fn" else {"training_step": training_step}
        if scenario.val_every:
            form["val_dataset"] = validation_data()
        with _profile(dist_on) as prof_box, pm.record_hook_calls(prefix="unison_") as hooks:
            progress = trainer.fit(
                model,
                data,
                **form,
                optimizer=make_optimizer,
                lr_scheduler=make_scheduler if scenario.scheduler else None,
                ckpt_path=resume_path,
            )
        recorder._close_mark()
        start = recorder.start_counts or {
            "optimizer_steps": progress.optimizer_steps,
            "scheduler_steps": progress.scheduler_steps,
        }
        trace.update(
            steps=recorder.steps,
            hooks=list(hooks),
            counts={
                "optimizer_steps": progress.optimizer_steps,
                "scheduler_steps": progress.scheduler_steps,
                "optimizer_steps_at_start": start["optimizer_steps"],
                "scheduler_steps_at_start": start["scheduler_steps"],
                # Optimizer steps in which the user's optimizer really stepped.
                "optimizer_updates_observed": sum(1 for n in recorder.step_calls.values() if n > 0),
                "optimizer_steps_outside_update": recorder.updates_outside_window,
                "optimizers_built": len(optimizers),
                "scheduler_last_epoch": schedulers[-1].last_epoch if schedulers else None,
            },
            boundaries=boundaries,
            accumulation_owner=trainer.ownership.grad_accumulation.owner.value,
            accumulation_sync=trainer.ownership.grad_accumulation.sync.value,
            world_size=torch.distributed.get_world_size() if dist_on else 1,
            collectives=_analyse_collectives(prof_box[0].events()) if prof_box else None,
            state=trainer.full_state_dict(),
            buffer_snapshots=recorder.buffer_snapshots,
            validations=recorder.validations,
        )
        if probe is not None:
            trace["precision_probe"] = probe.result()
    except ConfigurationError as exc:
        if trainer is not None and trainer.setup_started:
            # Bad input is refused before the process group and the strategy's
            # setup; a ConfigurationError after that is a failure, never a refusal.
            trace.update(status="error", error=traceback.format_exc(limit=12))
        else:
            trace.update(
                status="refused",
                reason=str(exc),
                refusal={
                    "type": type(exc).__name__,
                    "option": exc.option,
                    "problem": exc.problem,
                    "feature": exc.feature if isinstance(exc, DeclaredRefusal) else None,
                    "message": str(exc),
                    "in_constructor": trainer is None,
                },
            )
    except BaseException as exc:
        # Every failure of a run is a failed cell, upstream BaseException
        # subclasses included (torch.distributed.checkpoint's
        # CheckpointException derives from BaseException); only the user's
        # own interrupt stops the suite.
        if isinstance(exc, KeyboardInterrupt):
            raise
        trace.update(status="error", error=traceback.format_exc(limit=12))
    trace["wall_s"] = time.perf_counter() - started
    return trace


# --------------------------------------------------------------------------- #
# Phases
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class PhaseContext:
    """Everything a phase needs; picklable, so it travels to spawned ranks."""

    strategy: str
    backend: str  # "reference" | "strategy"
    world: str  # "main" | "alt"
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
        raise FileNotFoundError(f"no checkpoint from {backend} run {run_id!r} of scenario {scenario.name!r}")
    return source


def _phase_runs(ctx: PhaseContext, scenario: Scenario) -> list[Run]:
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
    dist_on = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if dist_on else 0
    strategy = REFERENCE if ctx.backend == "reference" else ctx.strategy
    out: dict[str, dict[str, dict[str, Any]]] = {}
    with _diagnostics(ctx, rank) as where:
        for scenario in select(ctx.scenarios):
            if scenario.kind != "train" or (scenario.requires_reshardable and not ctx.reshardable):
                continue
            for run in _phase_runs(ctx, scenario):
                where(f"scenario {scenario.name!r}, run {ctx.backend}:{run.id}")
                _run_one(ctx, scenario, run, strategy, rank, out)
    return out


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


def _world_diagnostics(directory: Path, world: str) -> str:
    """What the ranks of a failed world were doing: their current run and stack dump."""
    lines = []
    for where in sorted(directory.glob(f"{world}-rank*.where")):
        rank = where.stem.split("rank")[-1]
        lines.append(f"rank {rank} was in {where.read_text().strip()}")
        stacks = directory / f"{world}-rank{rank}.stacks"
        if stacks.exists() and stacks.stat().st_size:
            text = stacks.read_text().strip().splitlines()
            # The main thread's stack (faulthandler prints it first), innermost call first.
            main = []
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
    except BaseException as exc:  # a missing or unreadable checkpoint: this run's failure
        if isinstance(exc, KeyboardInterrupt):
            raise
        out.setdefault(scenario.name, {})[run.id] = {
            "status": "error",
            "error": f"{type(exc).__name__}: {exc}",
            "wall_s": 0.0,
        }
        return
    writes = run.save or scenario.checkpoint_every is not None
    trace = execute_run(
        scenario,
        run,
        strategy=strategy,
        sizing=ctx.sizing,
        plugins=ctx.plugins,
        checkpoint_dir=_checkpoint_root(ctx.checkpoint_root, scenario.name, run.id) if writes else None,
        resume_path=resume,
    )
    out.setdefault(scenario.name, {})[run.id] = trace


def _merge_ranks(results: list[dict[str, dict[str, dict[str, Any]]]]) -> dict[str, dict[str, dict[str, Any]]]:
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
    )
    merged = results[0]
    for scenario, runs in merged.items():
        for run_id, trace in runs.items():
            trace["ranks"] = [{k: r[scenario][run_id].get(k) for k in keys} for r in results]
    return merged


# --------------------------------------------------------------------------- #
# Declarations (no training)
# --------------------------------------------------------------------------- #


@contextlib.contextmanager
def _as_rank_zero_of(world_size: int) -> Iterator[None]:
    """Let a Trainer built here see the world size it would be launched at."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(RANK="0", WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def accepted_world_size(world_sizes: WorldSizes, preferred: int) -> int:
    """``preferred`` when the declaration accepts it, else the smallest world size it accepts."""
    if world_sizes.refusal(preferred) is None:
        return preferred
    n = max(world_sizes.minimum, world_sizes.multiple_of)
    while world_sizes.refusal(n) is not None:
        n += 1
    return n


def check_precision_declarations(strategy: str, plugins: Sequence[str], sizing: Sizing) -> list[dict[str, Any]]:
    """Build a Trainer for every standard precision and record what happened.

    Runs in this process: nothing here may start a process group, which is
    itself checked (``process_group_started``). The Trainers see the suite's
    world size, or the smallest one the strategy declares it accepts (a
    2-stage pipeline is checked at 2 when the suite runs at 1): the precision
    declarations hold at every accepted size.
    """
    pm = make_plugin_manager(plugins)
    ownership = pm.strategies.create(strategy).ownership
    world_size = accepted_world_size(ownership.world_sizes, sizing.world_size)
    batch = 4 * math.lcm(world_size, sizing.micro_batch)
    outcomes = []
    for precision in STANDARD_PRECISIONS:
        support = ownership.precision_support(precision)
        before = torch.distributed.is_available() and torch.distributed.is_initialized()
        raised = None
        try:
            with _as_rank_zero_of(world_size):
                unison.Trainer(
                    strategy=strategy,
                    plugin_manager=make_plugin_manager(plugins),
                    precision=precision,
                    global_batch_size=batch,
                    max_steps=1,
                    accelerator="cpu",
                    progress="off",
                )
        except BaseException as exc:  # recorded, judged by compare
            if isinstance(exc, KeyboardInterrupt):
                raise
            raised = {
                "type": type(exc).__name__,
                "is_configuration_error": isinstance(exc, ConfigurationError),
                "option": getattr(exc, "option", None),
                "feature": getattr(exc, "feature", None),
                "message": str(exc),
            }
        after = torch.distributed.is_available() and torch.distributed.is_initialized()
        outcomes.append(
            {
                "precision": precision,
                "declared": "supported" if support.supported else "unsupported",
                "owner": support.owner.value,
                "detail": support.detail,
                "raised": raised,
                "world_size": world_size,
                "process_group_started": after and not before,
            }
        )
    return outcomes


# --------------------------------------------------------------------------- #
# The suite
# --------------------------------------------------------------------------- #


@dataclass
class StrategyResult:
    """Everything measured for one strategy (input of :mod:`~unison.conformance.compare`)."""

    name: str
    #: ``"ran"``, ``"skipped"`` (unavailable here) or ``"error"`` (could not be built).
    status: str
    reason: str | None = None
    ownership: dict[str, Any] | None = None
    non_conformant: str | None = None
    world_size: int = 0
    alt_world_size: int = 0
    #: ``{scenario: {run_id: trace}}`` of the strategy's runs (main and alt worlds).
    traces: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    #: Reference-backend runs that resumed this strategy's checkpoints.
    reference_traces: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    declarations: list[dict[str, Any]] = field(default_factory=list)
    world_errors: dict[str, str] = field(default_factory=dict)
    wall_s: dict[str, float] = field(default_factory=dict)


class Suite:
    """The conformance suite for a set of scenarios at one world size.

    Args:
        world_size: ranks of each strategy's world.
        scenarios: scenario names (all by default).
        plugins: module names registered on every plugin manager, in this
            process and in the ranks (third-party strategies not installed as
            entry points; ``UNISON_PLUGINS`` works too).
        workdir: where checkpoints go (a temporary directory by default).
        timeout: seconds one world may take before it is killed.
    """

    def __init__(
        self,
        world_size: int = 2,
        scenarios: Sequence[str] | None = None,
        plugins: Sequence[str] = (),
        workdir: str | os.PathLike[str] | None = None,
        timeout: float = 300.0,
        alt_world_size: int | None = None,
    ) -> None:
        self.world_size = world_size
        self.alt_world_size = alt_world_size or default_alt_world_size(world_size)
        self.sizing = Sizing(world_size, self.alt_world_size)
        self.scenarios = select(scenarios)
        self.scenario_names = tuple(s.name for s in self.scenarios)
        self.plugins = tuple(plugins)
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="unison-conformance-")
            workdir = self._tmp.name
        self.workdir = Path(workdir)
        self.timeout = timeout
        self._reference: dict[str, dict[str, dict[str, Any]]] | None = None
        self.reference_wall_s = 0.0

    @property
    def reference_root(self) -> Path:
        return self.workdir / "checkpoints" / f"reference-w{self.world_size}"

    def strategy_root(self, name: str) -> Path:
        return self.workdir / "checkpoints" / f"{name}-w{self.world_size}"

    def diagnostics_dir(self, name: str) -> Path:
        return self.workdir / "diagnostics" / f"{name}-w{self.world_size}"

    def _world_error(self, name: str, world: str, exc: BaseException) -> str:
        detail = _world_diagnostics(self.diagnostics_dir(name), world)
        return f"{type(exc).__name__}: {exc}" + (f"\n{detail}" if detail else "")

    def _ctx(
        self, strategy: str, backend: str, world: str, *, cross_only: bool = False, reshardable: bool = True
    ) -> PhaseContext:
        return PhaseContext(
            strategy=strategy,
            backend=backend,
            world=world,
            scenarios=self.scenario_names,
            sizing=self.sizing,
            plugins=self.plugins,
            checkpoint_root=str(self.reference_root if backend == "reference" else self.strategy_root(strategy)),
            reference_root=str(self.reference_root),
            strategy_root=str(self.strategy_root(strategy)),
            cross_only=cross_only,
            reshardable=reshardable,
            # Spawned worlds only (the parent's faulthandler timer belongs to its host, e.g. pytest):
            # stacks are dumped shortly before the world is killed, so a hang names its place.
            diagnostics_dir=str(self.diagnostics_dir(strategy)) if backend == "strategy" else None,
            dump_stacks_after=max(5.0, self.timeout - 20.0),
        )

    def _has_runs(self, ctx: PhaseContext) -> bool:
        return any(
            _phase_runs(ctx, s)
            for s in self.scenarios
            if s.kind == "train" and (ctx.reshardable or not s.requires_reshardable)
        )

    def reference(self) -> dict[str, dict[str, dict[str, Any]]]:
        """The reference traces (computed once, in this process)."""
        if self._reference is None:
            shutil.rmtree(self.reference_root, ignore_errors=True)
            started = time.perf_counter()
            self._reference = run_phase(self._ctx(REFERENCE, "reference", "main"))
            self.reference_wall_s = time.perf_counter() - started
        return self._reference

    def run_strategy(self, name: str) -> StrategyResult:
        """Run every phase for strategy ``name``; never raises (but on ``KeyboardInterrupt``).

        A failure outside any single run (the reference, a phase, the suite
        itself) makes the strategy's result an ``error`` naming it, so the
        report is still written and every scenario of it is a failed cell.
        """
        try:
            return self._run_strategy(name)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            return StrategyResult(
                name=name,
                status="error",
                reason=f"the suite could not run {name!r}: {type(exc).__name__}: {exc}\n"
                + traceback.format_exc(limit=8),
                world_size=self.world_size,
                alt_world_size=self.alt_world_size,
            )

    def _run_strategy(self, name: str) -> StrategyResult:
        from unison.launch.torchrun import spawn

        result = StrategyResult(name=name, status="ran", world_size=self.world_size, alt_world_size=self.alt_world_size)
        pm = make_plugin_manager(self.plugins)
        try:
            spec, _ = pm.strategies.resolve(name)
        except ConfigurationError as exc:
            result.status, result.reason = "error", str(exc)
            return result
        if spec.unavailable:
            result.status, result.reason = "skipped", f"unavailable here: {spec.unavailable}"
            return result
        try:
            ownership = pm.strategies.create(name).ownership
        except Exception as exc:  # a strategy that cannot even be built
            result.status, result.reason = "error", f"could not build strategy {name!r}: {exc}"
            return result
        result.ownership = ownership.to_dict()
        result.non_conformant = ownership.non_conformant
        # The world resumes the reference's checkpoints: the reference first.
        self.reference()

        started = time.perf_counter()
        if any(s.kind == "declarations" for s in self.scenarios):
            result.declarations = check_precision_declarations(name, self.plugins, self.sizing)
        result.wall_s["declarations"] = time.perf_counter() - started

        shutil.rmtree(self.strategy_root(name), ignore_errors=True)
        shutil.rmtree(self.diagnostics_dir(name), ignore_errors=True)
        # No world is started for a phase without runs (e.g. only the
        # declarations scenario was selected).
        reshardable = bool(ownership.state_dict.reshardable)
        main = self._ctx(name, "strategy", "main", reshardable=reshardable)
        if self._has_runs(main):
            started = time.perf_counter()
            try:
                result.traces = _merge_ranks(spawn(run_phase, self.world_size, main, timeout=self.timeout))
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt):
                    raise
                result.world_errors["main"] = self._world_error(name, "main", exc)
            result.wall_s["world"] = time.perf_counter() - started

        post = self._ctx(name, "reference", "main", cross_only=True, reshardable=reshardable)
        if self._has_runs(post):
            started = time.perf_counter()
            result.reference_traces = run_phase(post)
            result.wall_s["reference_post"] = time.perf_counter() - started

        needs_alt = self._has_runs(self._ctx(name, "strategy", "alt", reshardable=reshardable))
        if needs_alt and "main" not in result.world_errors:
            started = time.perf_counter()
            try:
                alt = _merge_ranks(
                    spawn(run_phase, self.alt_world_size, self._ctx(name, "strategy", "alt"), timeout=self.timeout)
                )
                for scenario, runs in alt.items():
                    result.traces.setdefault(scenario, {}).update(runs)
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt):
                    raise
                result.world_errors["alt"] = self._world_error(name, "alt", exc)
            result.wall_s["alt_world"] = time.perf_counter() - started
        result.wall_s["total"] = sum(result.wall_s.values())
        return result

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Suite:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["REFERENCE", "StrategyResult", "Suite", "check_precision_declarations", "execute_run", "run_phase"]
