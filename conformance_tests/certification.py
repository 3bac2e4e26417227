"""Certifying strategies: run the suite, judge every scenario, build the report.

:func:`certify` orchestrates :class:`~unison.conformance.suite.Suite`,
:func:`~unison.conformance.compare.judge` and
:class:`~unison.conformance.report.SuiteReport` (written to a directory when asked).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from unison.conformance.compare import judge
from unison.conformance.report import SuiteReport
from unison.conformance.suite import Suite


def _reference_or_empty(suite: Suite) -> dict[str, dict[str, dict[str, Any]]]:
    """The reference traces; empty when computing them failed (each strategy's result names why)."""
    try:
        return suite.reference()
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        return {}


def certify(
    strategies: Sequence[str],
    *,
    world_size: int = 2,
    scenarios: Sequence[str] | None = None,
    plugins: Sequence[str] = (),
    report_dir: str | os.PathLike[str] | None = None,
    timeout: float = 300.0,
    suite: Suite | None = None,
) -> SuiteReport:
    """Run the suite for ``strategies`` and build the report (written when ``report_dir`` is set).

    Pass a ``suite`` to reuse its reference across calls (same world size and
    scenarios).
    """
    started = time.perf_counter()
    own_suite = suite is None
    suite = suite or Suite(world_size=world_size, scenarios=scenarios, plugins=plugins, timeout=timeout)
    try:
        results = [suite.run_strategy(name) for name in strategies]
        # Computed (once) by the first strategy that ran; not at all when
        # every strategy was skipped.
        reference = _reference_or_empty(suite) if any(r.status == "ran" for r in results) else {}
        verdicts = {r.name: judge(r, reference, suite.scenarios) for r in results}
        report = SuiteReport(
            world_size=suite.world_size,
            alt_world_size=suite.alt_world_size,
            scenarios=suite.scenarios,
            results=results,
            verdicts=verdicts,
            reference=reference,
            reference_wall_s=suite.reference_wall_s,
            wall_s=time.perf_counter() - started,
        )
    finally:
        if own_suite:
            suite.close()
    if report_dir is not None:
        report.write(report_dir)
    return report
