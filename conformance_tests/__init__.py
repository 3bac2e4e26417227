"""The unison conformance suite: every strategy must train like one process.

Shipped in the wheel so third parties can certify their own strategies::

    unison conformance --strategy NAME[,NAME...] [--world-size N] --report DIR
    pytest -p unison.conformance.pytest_plugin --pyargs unison.conformance --unison-strategy NAME

or from Python::

    from unison.conformance import certify
    report = certify(["ddp"], world_size=2, report_dir="conformance-report")
    report.print_table()

Modules: :mod:`~unison.conformance.scenarios` (the scenario table; what a
scenario is in :mod:`~unison.conformance.spec`, its models and data in
:mod:`~unison.conformance.models` and :mod:`~unison.conformance.data`),
:mod:`~unison.conformance.suite` (one world per strategy, the reference in this
process; phases in :mod:`~unison.conformance.worlds`, one fit in
:mod:`~unison.conformance.execution`, traces in :mod:`~unison.conformance.trace`, collectives in
:mod:`~unison.conformance.profiling`),
:mod:`~unison.conformance.compare` (judging a scenario; the checks in
:mod:`~unison.conformance.checks`, tolerances and verdicts in
:mod:`~unison.conformance.verdict`), :mod:`~unison.conformance.diagnosis.table` (the
likely broken rule of a failed scenario), :mod:`~unison.conformance.certification`
(run, judge, report), :mod:`~unison.conformance.report` (table, JSON, HTML from a
template; certificates in :mod:`~unison.conformance.certificate`, SVG plots in
:mod:`~unison.conformance.plots`), :mod:`~unison.conformance.cli` and
:mod:`~unison.conformance.pytest_plugin` (entry points).

Strategies are found only through the plugin registry
(``unison.PluginManager().strategies``), never imported by name, so a newly
installed strategy is certified exactly like a built-in one.

This package is imported by every plugin manager (its ``cli`` module is an
entry point), so importing it stays cheap: the names below load on first use.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "certify": "unison.conformance.certification",
    "SuiteReport": "unison.conformance.report",
    "Suite": "unison.conformance.suite",
    "StrategyResult": "unison.conformance.suite",
    "judge": "unison.conformance.compare",
    "Verdict": "unison.conformance.verdict",
    "Divergence": "unison.conformance.verdict",
    "TOLERANCES": "unison.conformance.verdict",
    "Diagnosis": "unison.conformance.diagnosis.table",
    "diagnose": "unison.conformance.diagnosis.table",
    "Certificate": "unison.conformance.certificate",
    "SCENARIOS": "unison.conformance.scenarios",
    "Scenario": "unison.conformance.spec",
}

__all__ = list(sorted(_EXPORTS))


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'unison.conformance' has no attribute {name!r}")
