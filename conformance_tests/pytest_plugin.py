"""Run the conformance suite from pytest: one test per (strategy, scenario).

For third parties certifying a strategy in their own CI::

    pytest -p unison.conformance.pytest_plugin --pyargs unison.conformance \\
        --unison-strategy my_strategy [--unison-world-size 2] [--unison-report DIR]

``-p`` loads this plugin (its options); ``--pyargs unison.conformance``
collects the suite's test module shipped inside the package. When unison
publishes this module under the ``pytest11`` entry-point group the ``-p`` part
is unnecessary. A strategy not installed as an entry point can be named with
``--unison-plugin module`` (or ``UNISON_PLUGINS=module``).

Outcomes: a passing scenario passes; a failing one fails with every divergence
(scenario, run, quantity, step, expected, got) and the likely broken rule; a
scenario the strategy refused and declares refused ("declared out"), or a
strategy unavailable on the machine, is *skipped* with the reason (never
passed); an *inconclusive* scenario (its effect below 10x its tolerance, see
:mod:`unison.conformance.sensitivity`) fails with the measured effect; a strategy whose ownership declares it
non-conformant is still run, and its failures are reported as ``xfail`` with
the divergence as the reason.

Each strategy's world runs once per session, on the first test that needs it
(all its scenarios in one process group); the reference runs once.
"""

from __future__ import annotations

import io
import os
from typing import Any

import pytest

_STASH_KEY = pytest.StashKey["ConformanceSession"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("unison-conformance", "unison strategy conformance suite")
    group.addoption(
        "--unison-strategy",
        action="append",
        default=[],
        metavar="NAME",
        help="strategy to certify (repeat or comma-separate)",
    )
    group.addoption("--unison-world-size", type=int, default=2, metavar="N", help="ranks per strategy world")
    group.addoption(
        "--unison-scenario", action="append", default=[], metavar="NAME", help="only these scenarios (default: all)"
    )
    group.addoption(
        "--unison-plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="register these modules as unison plugins (strategies not installed)",
    )
    group.addoption("--unison-report", default=None, metavar="DIR", help="write report.json and report.html here")
    group.addoption("--unison-timeout", type=float, default=300.0, metavar="S", help="seconds per world")


def _split(values: list[str]) -> list[str]:
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


class ConformanceSession:
    """Lazily runs each strategy's world once and hands out verdicts."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.strategies = _split(config.getoption("unison_strategy"))
        self.world_size = int(config.getoption("unison_world_size"))
        self.scenario_names = _split(config.getoption("unison_scenario")) or None
        self.plugins = _split(config.getoption("unison_plugin"))
        self.report_dir = config.getoption("unison_report")
        self.timeout = float(config.getoption("unison_timeout"))
        self._suite: Any = None
        self.results: dict[str, Any] = {}
        self.verdicts: dict[str, dict[str, Any]] = {}

    @property
    def suite(self) -> Any:
        if self._suite is None:
            from unison.conformance.suite import Suite

            os.environ.setdefault("OMP_NUM_THREADS", "1")
            self._suite = Suite(
                world_size=self.world_size, scenarios=self.scenario_names, plugins=self.plugins, timeout=self.timeout
            )
        return self._suite

    def verdict(self, strategy: str, scenario: str) -> Any:
        if strategy not in self.results:
            from unison.conformance.compare import judge

            result = self.suite.run_strategy(strategy)
            self.results[strategy] = result
            self.verdicts[strategy] = judge(result, self.suite.reference(), self.suite.scenarios)
        return self.verdicts[strategy][scenario]

    def check(self, strategy: str, scenario: str) -> None:
        """Turn one verdict into a pytest outcome."""
        v = self.verdict(strategy, scenario)
        result = self.results[strategy]
        if v.status == "skipped":
            pytest.skip(f"strategy {strategy!r} skipped: {v.reason}")
        if v.status == "declared_out":
            pytest.skip(f"declared out by {strategy!r}: {v.reason}")
        if v.status == "inconclusive":
            # Not proven: the scenario cannot see what it exists to see (never a silent pass).
            pytest.fail(f"{strategy} / {scenario}: {v.reason}", pytrace=False)
        if v.status == "fail":
            lines = [d.message() for d in v.divergences] or [v.reason or "failed"]
            text = f"{strategy} / {scenario}: {len(lines)} divergence(s)\n  " + "\n  ".join(lines[:30])
            if v.diagnosis is not None:
                text += f"\nlikely cause: {v.diagnosis.message()}"
            if result.non_conformant:
                pytest.xfail(f"declared non-conformant ({result.non_conformant}); {lines[0]}")
            pytest.fail(text, pytrace=False)

    def report(self) -> Any:
        from unison.conformance.report import SuiteReport

        results = [self.results[s] for s in self.strategies if s in self.results]
        return SuiteReport(
            world_size=self.suite.world_size,
            alt_world_size=self.suite.alt_world_size,
            scenarios=self.suite.scenarios,
            results=results,
            verdicts={r.name: self.verdicts[r.name] for r in results},
            reference=self.suite.reference(),
            reference_wall_s=self.suite.reference_wall_s,
            wall_s=self.suite.reference_wall_s + sum(r.wall_s.get("total", 0.0) for r in results),
        )

    def close(self) -> None:
        if self._suite is not None:
            self._suite.close()


def _session(config: pytest.Config) -> ConformanceSession:
    if _STASH_KEY not in config.stash:
        config.stash[_STASH_KEY] = ConformanceSession(config)
    return config.stash[_STASH_KEY]


def generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``unison_case`` with every (strategy, scenario) pair."""
    if "unison_case" not in metafunc.fixturenames:
        return
    try:
        strategies = _split(metafunc.config.getoption("unison_strategy"))
    except ValueError:  # the plugin's options are not registered
        strategies = None
    if not strategies:
        why = (
            "load the plugin: pytest -p unison.conformance.pytest_plugin"
            if strategies is None
            else "no --unison-strategy given"
        )
        metafunc.parametrize("unison_case", [pytest.param(None, marks=pytest.mark.skip(reason=why))], ids=["none"])
        return
    from unison.conformance.scenarios import select

    names = _split(metafunc.config.getoption("unison_scenario")) or None
    cases = [(st, sc.name) for st in strategies for sc in select(names)]
    metafunc.parametrize("unison_case", cases, ids=[f"{st}-{sc}" for st, sc in cases])


@pytest.fixture(scope="session")
def unison_conformance(request: pytest.FixtureRequest) -> ConformanceSession:
    """The session's conformance runs (one world per strategy, run on first use)."""
    return _session(request.config)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if _STASH_KEY not in config.stash:
        return
    session = config.stash[_STASH_KEY]
    if not session.results:
        return
    from rich.console import Console

    report = session.report()
    console = Console(
        record=True, width=max(100, terminalreporter.config.get_terminal_writer().fullwidth), file=io.StringIO()
    )
    report.print_table(console)
    terminalreporter.write_line(console.export_text())
    if session.report_dir:
        report.write(session.report_dir)
        terminalreporter.write_line(f"unison conformance report: {os.path.join(session.report_dir, 'report.html')}")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _STASH_KEY in config.stash:
        config.stash[_STASH_KEY].close()
