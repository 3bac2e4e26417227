"""The report a platform team attaches to a review: terminal table, JSON, HTML.

:func:`~unison.conformance.certification.certify` runs the suite for some strategies and returns a
:class:`SuiteReport`; :meth:`SuiteReport.write` produces

* ``report.json``: the certificate of every strategy (``certified`` or ``not
  certified``, the scenarios proven, declared out with the declared reason,
  failed with the diagnosis), the environment (unison, torch and backend
  versions, git revision when available, host, world size), every verdict
  with each divergence (scenario, run, quantity, step, expected, got), the
  tolerances, each strategy's ownership declaration, wall times, and the
  traces without tensors;
* ``report.html``: the same, rendered from a jinja2 template
  (``templates/report.html.j2``): the certificates first, then the matrix, then
  per scenario a matplotlib SVG plot of each strategy's *deviation from the
  reference* per step (relative loss and grad-norm difference, log scale, the
  precision's ceiling drawn in; exact agreement is drawn at the plot's floor),
  the checks made, the divergences found and the diagnosis.

A cell is ``pass`` (proven, with the largest parameter deviation), ``FAIL``
(with the first divergence and the likely broken rule), ``declared out``
(refused, and the declaration says so: with the reason) or ``skipped``
(strategy unavailable on this machine, with the reason) or ``inconclusive``
(every check held, but the scenario's effect is below 10x its tolerance, so it
proves nothing: :mod:`unison.conformance.sensitivity`): never a silent pass.

Plots are :mod:`unison.conformance.plots`; certificates
:mod:`unison.conformance.certificate`.

A strategy is *certified* when it ran, no scenario failed, none was
inconclusive and at least one training scenario was proven; the certificate
lists which scenarios were proven, which were declared out and which were
inconclusive (listed separately: an inconclusive scenario is neither proven nor
failed, and it withholds the certificate).
"""

from __future__ import annotations

import datetime
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unison.conformance.certificate import LEGEND, Certificate, build_certificate, environment
from unison.conformance.execution import REFERENCE
from unison.conformance.plots import COLORS, deviation_plot
from unison.conformance.scenarios import SCENARIOS
from unison.conformance.spec import Scenario
from unison.conformance.suite import StrategyResult
from unison.conformance.verdict import (
    DECLARED_OUT,
    FAIL,
    INCONCLUSIVE,
    PASS,
    SKIPPED,
    TOLERANCES,
    Verdict,
    status_label,
)


@dataclass
class SuiteReport:
    world_size: int
    alt_world_size: int
    scenarios: tuple[Scenario, ...]
    results: list[StrategyResult]
    verdicts: dict[str, dict[str, Verdict]]
    reference: dict[str, dict[str, dict[str, Any]]]
    reference_wall_s: float
    wall_s: float
    created: str = field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    )
    env: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.env is None:
            self.env = environment(self.world_size, self.alt_world_size)

    # -- outcome ------------------------------------------------------------ #
    def failures(self, *, include_declared: bool = False) -> list[Verdict]:
        """Failed verdicts; those of strategies declared non-conformant only when asked."""
        out = []
        for r in self.results:
            if r.non_conformant and not include_declared:
                continue
            out += [v for v in self.verdicts[r.name].values() if v.status == FAIL]
        return out

    @property
    def exit_code(self) -> int:
        """0 when no strategy claiming conformance failed (skips and declared-out scenarios allowed)."""
        return 1 if self.failures() else 0

    def certificate(self, strategy: str) -> Certificate:
        result = next(r for r in self.results if r.name == strategy)
        return build_certificate(result, self.verdicts[strategy], self.world_size)

    def certificates(self) -> list[Certificate]:
        return [self.certificate(r.name) for r in self.results]

    def certified(self, strategy: str) -> bool:
        """Ran, no scenario failed, at least one training scenario proven (declared-out ones are listed, not failed)."""
        return self.certificate(strategy).certified

    # -- terminal ----------------------------------------------------------- #
    def print_table(self, console: Any = None) -> None:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        console = console or Console()
        for cert in self.certificates():
            style = ("bold yellow" if cert.partial else "bold green") if cert.certified else "bold red"
            label = cert.label.upper() if not (cert.certified and cert.partial) else "PARTIAL" + cert.label[7:]
            console.print(f"[{style}]{escape(cert.strategy)}: {label}[/{style}] – {escape(cert.summary)}")
            if cert.gradient_reductions:
                shown = "; ".join(f"{p}: {', '.join(d)}" for p, d in cert.gradient_reductions.items())
                console.print(f"  gradient reductions carried {escape(shown)}", highlight=False)
        table = Table(title=f"unison conformance (world size {self.world_size}; reference: {REFERENCE})")
        table.add_column("scenario", style="bold", no_wrap=True)
        for r in self.results:
            title = r.name + (" (declared non-conformant)" if r.non_conformant else "")
            table.add_column(escape(title), overflow="fold")
        for s in self.scenarios:
            cells = []
            for r in self.results:
                v = self.verdicts[r.name][s.name]
                cells.append(_rich_cell(v))
            table.add_row(s.name, *cells)
        table.add_row("wall time", *[f"{r.wall_s.get('total', 0.0):.1f} s" for r in self.results])
        console.print(table)
        for r in self.results:
            if r.world_errors:
                for world, err in r.world_errors.items():
                    first = err.splitlines()[0] if err else ""
                    console.print(f"[red]{r.name}: the {world} world failed:[/red] {first}")
        notes = self._not_proven_notes()
        if notes:
            console.print("[bold]Declared out and skipped, with the reasons:[/bold]")
            for line in notes:
                console.print(line, markup=False, highlight=False)
        fails = self.failures(include_declared=True)
        if fails:
            console.print("[bold]First divergence and likely cause per failed cell:[/bold]")
            for v in fails:
                console.print(f"  {v.strategy} / {v.scenario}: {v.summary()[6:]}", markup=False, highlight=False)
                if v.diagnosis is not None:
                    console.print(f"    diagnosis: {v.diagnosis.message()}", markup=False, highlight=False)

    def _not_proven_notes(self) -> list[str]:
        """One line per strategy and reason for cells declared out, skipped or inconclusive."""
        notes = []
        for r in self.results:
            seen = set()
            for v in self.verdicts[r.name].values():
                if v.status in (DECLARED_OUT, SKIPPED, INCONCLUSIVE) and v.reason not in seen:
                    seen.add(v.reason)
                    scenarios = [n for n, w in self.verdicts[r.name].items() if w.reason == v.reason]
                    notes.append(f"  {r.name} {status_label(v.status)} ({', '.join(scenarios)}): {v.reason}")
        return notes

    # -- files -------------------------------------------------------------- #
    def to_dict(self) -> dict[str, Any]:
        return {
            "created": self.created,
            "environment": self.env,
            "world_size": self.world_size,
            "alt_world_size": self.alt_world_size,
            "reference": REFERENCE,
            "wall_s": self.wall_s,
            "reference_wall_s": self.reference_wall_s,
            "exit_code": self.exit_code,
            "certificates": [c.to_dict() for c in self.certificates()],
            "tolerances": {k: vars(v) for k, v in TOLERANCES.items()},
            "scenarios": [
                {
                    "name": s.name,
                    "description": s.description,
                    "model": s.model,
                    "precision": s.precision,
                    "accumulate_grad_batches": s.accumulate_grad_batches,
                    "grad_clip_norm": s.grad_clip_norm,
                    "optimizer": s.optimizer,
                    "scheduler": s.scheduler,
                    "max_steps": s.max_steps,
                    "form": s.form,
                }
                for s in self.scenarios
            ],
            "strategies": [
                {
                    "name": r.name,
                    "status": r.status,
                    "reason": r.reason,
                    "certified": self.certificate(r.name).to_dict()["certified"],
                    "non_conformant": r.non_conformant,
                    "ownership": r.ownership,
                    "wall_s": r.wall_s,
                    "world_errors": r.world_errors,
                    "declarations": r.declarations,
                    "verdicts": {name: v.to_dict() for name, v in self.verdicts[r.name].items()},
                    "traces": _json_traces(r.traces),
                    "reference_traces": _json_traces(r.reference_traces),
                }
                for r in self.results
            ],
            "reference_traces": _json_traces(self.reference),
        }

    def write(self, directory: str | os.PathLike[str]) -> Path:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(_sanitize(self.to_dict()), indent=2, default=str, allow_nan=False))
        (out / "report.html").write_text(self.to_html())
        return out

    def to_html(self) -> str:
        import jinja2

        env = jinja2.Environment(
            loader=jinja2.PackageLoader("unison.conformance", "templates"),
            autoescape=jinja2.select_autoescape(["html", "j2"]),
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        env.filters["status_label"] = status_label
        env.filters["sci"] = lambda x, digits=2: "–" if x is None else f"{x:.{digits}g}"
        template = env.get_template("report.html.j2")
        strategies = []
        for i, r in enumerate(self.results):
            strategies.append(
                {
                    "result": r,
                    "certificate": self.certificate(r.name),
                    "colour": COLORS[i % len(COLORS)],
                    "ownership_json": json.dumps(r.ownership, indent=2) if r.ownership else None,
                }
            )
        scenarios = []
        for s in self.scenarios:
            scenarios.append(
                {
                    "scenario": s,
                    "plot": jinja2_markup(deviation_plot(self, s)) if s.kind == "train" else None,
                    "verdicts": [(r, self.verdicts[r.name][s.name]) for r in self.results],
                }
            )
        ran = {s.name for s in self.scenarios}
        return template.render(
            report=self,
            reshard_ran=any(r.world == "alt" for s in self.scenarios for r in s.runs),
            partial=len(ran) < len(SCENARIOS),
            scenarios_total=len(SCENARIOS),
            PARTIAL_LEGEND=LEGEND,
            env=self.env,
            strategies=strategies,
            scenarios=scenarios,
            tolerances=TOLERANCES,
            reference_name=REFERENCE,
            cell=_cell,
            PASS=PASS,
            FAIL=FAIL,
        )


def jinja2_markup(text: str) -> Any:
    import markupsafe

    return markupsafe.Markup(text)


def _cell(v: Verdict) -> str:
    """The short cell text (terminal and HTML matrix); reasons go below the table."""
    if v.status == PASS:
        return "pass" if v.max_param_deviation is None else f"pass {v.max_param_deviation:.1e}"
    if v.status == INCONCLUSIVE and v.sensitivity:
        ratio = v.sensitivity.get("ratio")
        return "inconclusive" + (f" (effect {ratio:.2g}x tol)" if ratio is not None else "")
    if v.status == FAIL:
        d = v.divergences[0] if v.divergences else None
        if d is None:
            return "FAIL"
        where = d.quantity if len(d.quantity) <= 24 else d.quantity[:23] + "…"
        return (
            f"FAIL {where}"
            + (f"@{d.step}" if d.step is not None else "")
            + (f" ({d.deviation:.1e})" if d.deviation is not None else "")
        )
    return status_label(v.status)


def _rich_cell(v: Verdict) -> str:
    from rich.markup import escape

    text = escape(_cell(v))
    style = {PASS: "green", FAIL: "bold red", DECLARED_OUT: "dim", SKIPPED: "yellow", INCONCLUSIVE: "bold yellow"}.get(
        v.status, ""
    )
    return f"[{style}]{text}[/{style}]" if style else text


def _json_traces(traces: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for scenario, runs in traces.items():
        out[scenario] = {}
        for run_id, t in runs.items():
            d = {k: v for k, v in t.items() if k not in ("state", "ranks", "buffer_snapshots")}
            if "ranks" in t:
                d["ranks"] = [{"collectives": r.get("collectives"), "counts": r.get("counts")} for r in t["ranks"]]
            if t.get("buffer_snapshots"):
                d["buffer_snapshot_steps"] = sorted(t["buffer_snapshots"])
            out[scenario][run_id] = d
    return out


def _sanitize(value: Any) -> Any:
    """Strict JSON: non-finite floats (fp16 overflow steps) become the strings "nan"/"inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _sanitize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_sanitize(v) for v in value]
    if hasattr(value, "to_dict"):
        return _sanitize(value.to_dict())
    return value
