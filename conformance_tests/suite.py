"""The suite for one world size: the reference once, then one world per strategy.

:class:`Suite` runs the phases of :mod:`unison.conformance.worlds` for each strategy and
returns a :class:`StrategyResult` (traces, declarations, wall times); judging and reporting
are :mod:`unison.conformance.compare` and :mod:`unison.conformance.certification`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unison.conformance.data import Sizing, default_alt_world_size
from unison.conformance.execution import REFERENCE, check_precision_declarations, make_plugin_manager
from unison.conformance.scenarios import select
from unison.conformance.worlds import PhaseContext, merge_ranks, phase_runs, run_phase, world_diagnostics
from unison.errors import ConfigurationError, UnisonError


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
        self.scenarios = select(scenarios, self.sizing)
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
        detail = world_diagnostics(self.diagnostics_dir(name), world)
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
            phase_runs(ctx, s)
            for s in self.scenarios
            if s.kind == "train" and (ctx.reshardable or not s.requires_reshardable) and not s.unavailable()
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
            # unison's own errors (a plugin refused at registration, a bad option) say what to do;
            # a traceback is kept for anything else.
            trace = "" if isinstance(exc, UnisonError) else "\n" + traceback.format_exc(limit=8)
            return StrategyResult(
                name=name,
                status="error",
                reason=f"the suite could not run {name!r}: {type(exc).__name__}: {exc}{trace}",
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
                result.traces = merge_ranks(spawn(run_phase, self.world_size, main, timeout=self.timeout))
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

        # New processes of the main size resume the main world's checkpoints: nothing a process caches
        # (a one-time draw, a warmed-up structure) survives into them, as after a real restart.
        fresh = self._ctx(name, "strategy", "fresh", reshardable=reshardable)
        if self._has_runs(fresh) and "main" not in result.world_errors:
            self._later_world(result, fresh, self.world_size)

        needs_alt = self._has_runs(self._ctx(name, "strategy", "alt", reshardable=reshardable))
        if needs_alt and "main" not in result.world_errors:
            self._later_world(result, self._ctx(name, "strategy", "alt"), self.alt_world_size)
        result.wall_s["total"] = sum(result.wall_s.values())
        return result

    def _later_world(self, result: StrategyResult, ctx: PhaseContext, size: int) -> None:
        """A world after the main one (``fresh``, ``alt``): its traces join the main world's; a failure is kept."""
        from unison.launch.torchrun import spawn

        started = time.perf_counter()
        try:
            for scenario, runs in merge_ranks(spawn(run_phase, size, ctx, timeout=self.timeout)).items():
                result.traces.setdefault(scenario, {}).update(runs)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            result.world_errors[ctx.world] = self._world_error(result.name, ctx.world, exc)
        result.wall_s[f"{ctx.world}_world"] = time.perf_counter() - started

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Suite:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
