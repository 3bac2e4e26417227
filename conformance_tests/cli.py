"""``unison conformance``: certify strategies from the command line.

This module is a plugin (entry point ``conformance`` of the ``unison`` group):
it implements ``unison_add_cli_commands`` so the core CLI never imports the
suite. Importing it is cheap on purpose (every plugin manager loads it); the
suite itself is imported only when the command runs.

Example::

    unison conformance --strategy ddp,fsdp --world-size 2 --report ./conformance-report

The first lines printed are the certificates: ``certified`` (every scenario
ran, none failed, at least one training scenario was proven), ``PARTIAL: n of N
scenarios`` (``--scenario`` chose fewer than the full set and none of those
failed: no certificate) or ``not certified`` with the reason. The last line
names the report written (``./conformance-report`` unless ``--report`` says
otherwise).

Exit status: 0 when no strategy that claims conformance failed a scenario; 1
when any such scenario failed. A refusal counts only when the strategy's
declaration refuses something the scenario needs ("declared out"); any other
refusal is a failure. Strategies unavailable here are reported as skipped, and
failures of strategies whose ownership declares them non-conformant are shown
but do not change the exit status. ``--require-certified`` also exits 1 when a
strategy that ran is not certified (e.g. nothing proven: every scenario
declared out); on a partial run it asks that none of the scenarios run failed
and that one was proven.
"""

from __future__ import annotations

import os
from typing import Any

from unison.plugin import hookimpl


def _split(values: tuple[str, ...]) -> list[str]:
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def _load(modules: tuple[str, ...]) -> list[Any]:
    import importlib

    return [importlib.import_module(m) for m in _split(modules)]


def _command() -> Any:
    import click

    @click.command("conformance")
    @click.option(
        "--strategy",
        "strategies",
        multiple=True,
        required=True,
        help="Strategy name(s) to certify, comma-separated or repeated; 'all' for every registered one.",
    )
    @click.option(
        "--world-size", type=click.IntRange(1), default=2, show_default=True, help="Ranks of each strategy's world."
    )
    @click.option(
        "--report",
        "report_dir",
        type=click.Path(file_okay=False),
        default="conformance-report",
        show_default=True,
        help="Write report.json and report.html into this directory (always written; its path is printed).",
    )
    @click.option(
        "--scenario",
        "scenarios",
        multiple=True,
        help="Only these scenarios (comma-separated or repeated); all by default.",
    )
    @click.option(
        "--plugin",
        "plugins",
        multiple=True,
        help="Import and register these modules as plugins (third-party strategies not installed).",
    )
    @click.option(
        "--timeout",
        type=float,
        default=300.0,
        show_default=True,
        help="Seconds one world may take before it is killed.",
    )
    @click.option(
        "--require-certified",
        is_flag=True,
        help="Exit 1 unless every strategy that ran is certified (not only when one failed).",
    )
    def conformance(
        strategies: tuple[str, ...],
        world_size: int,
        report_dir: str,
        scenarios: tuple[str, ...],
        plugins: tuple[str, ...],
        timeout: float,
        require_certified: bool,
    ) -> None:
        """Run the conformance suite: each strategy against the single-process reference."""
        from rich.console import Console

        from unison.conformance.certification import certify

        # One thread per rank: the ranks of a world share this machine's cores.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        names = _split(strategies)
        if names == ["all"]:
            # Every registered strategy but the reference itself; unavailable
            # ones are reported as skipped with their reason.
            from unison.plugin.manager import PluginManager

            names = [s.name for s in PluginManager(plugins=_load(plugins)).strategies.specs() if s.name != "single"]
        try:
            report = certify(
                names,
                world_size=world_size,
                scenarios=_split(scenarios) or None,
                plugins=_split(plugins),
                report_dir=report_dir,
                timeout=timeout,
            )
        except KeyError as exc:  # an unknown scenario name
            raise click.BadParameter(str(exc.args[0]), param_hint="--scenario") from None
        # Wide enough for one readable column per strategy, also in a CI log
        # (rich would otherwise squeeze a dozen strategies into 80 columns).
        width = max(Console().width, 26 + 16 * len(names))
        console = Console(width=width)
        report.print_table(console)
        console.print(f"report: {os.path.join(report_dir, 'report.html')} and report.json")
        code = report.exit_code
        if require_certified:
            uncertified = [c.strategy for c in report.certificates() if not c.certified and c.skipped is None]
            if uncertified:
                console.print(f"[red]not certified: {', '.join(uncertified)}[/red]")
                code = 1
        raise SystemExit(code)

    return conformance


@hookimpl
def unison_add_cli_commands(cli: Any) -> None:
    cli.add_command(_command())
