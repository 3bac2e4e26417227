"""The unison conformance suite: every strategy must train like one process.

Shipped in the wheel so third parties can certify their own strategies::

    unison conformance --strategy NAME[,NAME...] [--world-size N] --report DIR
    pytest -p unison.conformance.pytest_plugin --pyargs unison.conformance --unison-strategy NAME

or from Python::

    from unison.conformance import certify
    report = certify(["ddp"], world_size=2, report_dir="conformance-report")
    report.print_table()

Modules: :mod:`~unison.conformance.scenarios` (what is trained),
:mod:`~unison.conformance.runner` (one world per strategy, the reference in
this process, traces), :mod:`~unison.conformance.compare` (tolerances and
checks, declared refusals), :mod:`~unison.conformance.diagnose` (the likely
broken rule of a failed scenario), :mod:`~unison.conformance.report`
(certificates, table, JSON, HTML from a template with SVG plots),
:mod:`~unison.conformance.cli` and :mod:`~unison.conformance.pytest_plugin`
(entry points).

Strategies are found only through the plugin registry
(``unison.PluginManager().strategies``), never imported by name, so a newly
installed strategy is certified exactly like a built-in one.

This package is imported by every plugin manager (its ``cli`` module is an
entry point), so importing it stays cheap: the names below load on first use.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "certify": "unison.conformance.report",
    "SuiteReport": "unison.conformance.report",
    "Suite": "unison.conformance.runner",
    "StrategyResult": "unison.conformance.runner",
    "judge": "unison.conformance.compare",
    "Verdict": "unison.conformance.compare",
    "Divergence": "unison.conformance.compare",
    "TOLERANCES": "unison.conformance.compare",
    "Diagnosis": "unison.conformance.diagnose",
    "diagnose": "unison.conformance.diagnose",
    "Certificate": "unison.conformance.report",
    "SCENARIOS": "unison.conformance.scenarios",
    "Scenario": "unison.conformance.scenarios",
}

__all__ = list(sorted(_EXPORTS))


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'unison.conformance' has no attribute {name!r}")
