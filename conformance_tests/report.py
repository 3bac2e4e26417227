"""The report a platform team attaches to a review: terminal table, JSON, HTML.

:func:`certify` runs the suite for some strategies and returns a
:class:`SuiteReport`; :meth:`SuiteReport.write` produces

* ``report.json``: every verdict (with each divergence: scenario, run,
  quantity, step, expected, got), the tolerances, each strategy's ownership
  declaration, wall times, and the traces without tensors;
* ``report.html``: the same table, then per scenario an inline SVG plot of the
  per-step loss of every backend overlaid on the reference (generated here,
  no plotting library, so the file is self-contained and the report works in
  a minimal environment), the checks made and the divergences found.

A cell is ``pass`` (with the largest parameter deviation), ``FAIL`` (with the
first divergence), ``unsupported`` (declared, with the reason) or ``skipped``
(strategy unavailable on this machine, with the reason): never a silent pass.
"""

from __future__ import annotations

import datetime
import html
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from unison.conformance.compare import TOLERANCES, Verdict, judge
from unison.conformance.runner import REFERENCE, StrategyResult, Suite
from unison.conformance.scenarios import Scenario

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


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
    created: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))

    # -- outcome ------------------------------------------------------------ #
    def failures(self, *, include_declared: bool = False) -> list[Verdict]:
        """Failed verdicts; those of strategies declared non-conformant only when asked."""
        out = []
        for r in self.results:
            if r.non_conformant and not include_declared:
                continue
            out += [v for v in self.verdicts[r.name].values() if v.status == "fail"]
        return out

    @property
    def exit_code(self) -> int:
        """0 when every strategy claiming conformance passed (skips and declared unsupported allowed)."""
        return 1 if self.failures() else 0

    def certified(self, strategy: str) -> bool:
        """Ran, and no scenario failed (unsupported scenarios are declared, not failed)."""
        result = next(r for r in self.results if r.name == strategy)
        return result.status == "ran" and all(v.status in ("pass", "unsupported") for v in self.verdicts[strategy].values())

    # -- terminal ----------------------------------------------------------- #
    def print_table(self, console: Any = None) -> None:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        console = console or Console()
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
                    console.print(f"[red]{r.name}: the {world} world failed:[/red] {err.splitlines()[0] if err else ''}")
        notes = []
        for r in self.results:
            seen = set()
            for name, v in self.verdicts[r.name].items():
                if v.status in ("unsupported", "skipped") and v.reason not in seen:
                    seen.add(v.reason)
                    scenarios = [n for n, w in self.verdicts[r.name].items() if w.reason == v.reason]
                    notes.append(f"  {r.name} {v.status} ({', '.join(scenarios)}): {v.reason}")
        if notes:
            console.print("[bold]Unsupported and skipped, with the reasons:[/bold]")
            for line in notes:
                console.print(line, markup=False, highlight=False)
        fails = self.failures(include_declared=True)
        if fails:
            console.print("[bold]First divergence per failed cell:[/bold]")
            for v in fails:
                console.print(f"  {v.strategy} / {v.scenario}: {v.summary()[6:]}", markup=False, highlight=False)

    # -- files -------------------------------------------------------------- #
    def to_dict(self) -> dict[str, Any]:
        return {
            "created": self.created,
            "world_size": self.world_size,
            "alt_world_size": self.alt_world_size,
            "reference": REFERENCE,
            "wall_s": self.wall_s,
            "reference_wall_s": self.reference_wall_s,
            "exit_code": self.exit_code,
            "tolerances": {k: vars(v) for k, v in TOLERANCES.items()},
            "scenarios": [
                {"name": s.name, "description": s.description, "model": s.model, "precision": s.precision,
                 "accumulate_grad_batches": s.accumulate_grad_batches, "grad_clip_norm": s.grad_clip_norm,
                 "optimizer": s.optimizer, "scheduler": s.scheduler, "max_steps": s.max_steps}
                for s in self.scenarios
            ],
            "strategies": [
                {
                    "name": r.name,
                    "status": r.status,
                    "reason": r.reason,
                    "certified": self.certified(r.name),
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
        esc = html.escape
        parts = [
            "<!doctype html><html><head><meta charset='utf-8'><title>unison conformance</title><style>",
            "body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;font-size:13px}"
            ".pass{background:#e6f4ea}.fail{background:#fde8e8}.unsupported{background:#f1f1f1}"
            ".skipped{background:#fff6dd}code{font-size:12px}svg{background:#fff;border:1px solid #ddd}",
            "</style></head><body>",
            f"<h1>unison conformance</h1><p>{esc(self.created)} &middot; world size {self.world_size} "
            f"(reshard at {self.alt_world_size}) &middot; reference <code>{REFERENCE}</code> &middot; "
            f"total wall time {self.wall_s:.1f} s (reference {self.reference_wall_s:.1f} s)</p>",
            "<table><tr><th>scenario</th>",
        ]
        for r in self.results:
            flag = "<br><small>declared non-conformant</small>" if r.non_conformant else ""
            parts.append(f"<th>{esc(r.name)}{flag}</th>")
        parts.append("</tr>")
        for s in self.scenarios:
            parts.append(f"<tr><td><a href='#{esc(s.name)}'>{esc(s.name)}</a></td>")
            for r in self.results:
                v = self.verdicts[r.name][s.name]
                parts.append(f"<td class='{v.status}'>{esc(_short(v))}</td>")
            parts.append("</tr>")
        parts.append("<tr><td>wall time</td>")
        for r in self.results:
            detail = ", ".join(f"{k} {v:.1f} s" for k, v in r.wall_s.items() if k != "total")
            parts.append(f"<td>{r.wall_s.get('total', 0.0):.1f} s<br><small>{esc(detail)}</small></td>")
        parts.append("</tr></table>")

        parts.append("<h2>Tolerances</h2><table><tr><th>precision</th><th>param (abs)</th><th>loss (rel)</th>"
                     "<th>grad norm (rel)</th><th>lr (rel)</th></tr>")
        for name, t in TOLERANCES.items():
            parts.append(f"<tr><td>{name}</td><td>{t.param:g}</td><td>{t.loss:g}</td><td>{t.grad_norm:g}</td>"
                         f"<td>{t.lr:g}</td></tr>")
        parts.append("</table>")

        for r in self.results:
            parts.append(f"<h2>Strategy <code>{esc(r.name)}</code>: {esc(r.status)}</h2>")
            if r.reason:
                parts.append(f"<p>{esc(r.reason)}</p>")
            if r.non_conformant:
                parts.append(f"<p><b>Declared non-conformant:</b> {esc(r.non_conformant)}</p>")
            if r.ownership:
                parts.append(f"<details><summary>ownership declaration</summary><pre>"
                             f"{esc(json.dumps(r.ownership, indent=2))}</pre></details>")
            for world, err in r.world_errors.items():
                parts.append(f"<details open><summary>{esc(world)} world failed</summary><pre>{esc(err)}</pre></details>")

        for s in self.scenarios:
            parts.append(f"<h2 id='{esc(s.name)}'>{esc(s.name)}</h2><p>{esc(s.description)}</p>")
            parts.append(f"<p><small>model {esc(s.model)}, {esc(s.precision)}, accumulation "
                         f"{s.accumulate_grad_batches}, clip {s.grad_clip_norm}, optimizer {esc(s.optimizer)}, "
                         f"scheduler {s.scheduler}, {s.max_steps} steps</small></p>")
            if s.kind == "train":
                parts.append(self._plot(s))
            for r in self.results:
                v = self.verdicts[r.name][s.name]
                parts.append(f"<h3>{esc(r.name)}: <span class='{v.status}'>{esc(v.status)}</span></h3>")
                if v.reason and v.status != "fail":
                    parts.append(f"<p>{esc(v.reason)}</p>")
                if v.max_param_deviation is not None:
                    parts.append(f"<p>max |&Delta;param| {v.max_param_deviation:.3g}; max relative loss deviation "
                                 f"{(v.max_loss_deviation or 0.0):.3g}"
                                 + (f"; gradient collectives per optimizer step {v.gradient_sync_per_step}"
                                    if v.gradient_sync_per_step is not None else "") + "</p>")
                if v.divergences:
                    parts.append("<ul>" + "".join(f"<li>{esc(d.message())}</li>" for d in v.divergences[:20])
                                 + (f"<li>... {len(v.divergences) - 20} more</li>" if len(v.divergences) > 20 else "")
                                 + "</ul>")
                if v.checks:
                    parts.append("<details><summary>checks</summary><ul>"
                                 + "".join(f"<li>{esc(c)}</li>" for c in v.checks) + "</ul></details>")
        parts.append("</body></html>")
        return "".join(parts)

    def _plot(self, scenario: Scenario) -> str:
        """Inline SVG: per-step loss, the reference in black, each strategy in its colour."""
        series: list[tuple[str, str, str, list[tuple[int, float]]]] = []  # label, colour, dash, points
        ref_runs = self.reference.get(scenario.name, {})
        first_ref = next((r.id for r in scenario.runs if r.backend == "reference"), None)
        if first_ref and ref_runs.get(first_ref, {}).get("status") == "ok":
            series.append((f"{REFERENCE} ({first_ref})", "#000", "", _points(ref_runs[first_ref])))
        for i, r in enumerate(self.results):
            colour = COLORS[i % len(COLORS)]
            runs = [run for run in scenario.runs if run.backend == "strategy"]
            for j, run in enumerate(runs):
                t = r.traces.get(scenario.name, {}).get(run.id)
                if t and t.get("status") == "ok":
                    series.append((f"{r.name} ({run.id})", colour, "" if j == 0 else "5,3", _points(t)))
            for run_id, t in r.reference_traces.get(scenario.name, {}).items():
                if t.get("status") == "ok":
                    series.append((f"{REFERENCE} from {r.name} ({run_id})", colour, "2,2", _points(t)))
        return svg_plot(series, title=f"{scenario.name}: loss per optimizer step")


def _points(trace: dict[str, Any]) -> list[tuple[int, float]]:
    return [(s["step"], s["loss"]) for s in trace.get("steps", [])]


def svg_plot(series: Sequence[tuple[str, str, str, list[tuple[int, float]]]], *, title: str,
             width: int = 640, height: int = 280) -> str:
    """A line plot as an SVG string; non-finite values are drawn as crosses on the top edge."""
    esc = html.escape
    finite = [y for *_, pts in series for _, y in pts if math.isfinite(y)]
    steps = [x for *_, pts in series for x, _ in pts]
    if not finite or not steps:
        return f"<p><i>{esc(title)}: no data</i></p>"
    left, right, top, bottom = 60, 180, 24, 30
    x0, x1 = min(steps), max(max(steps), min(steps) + 1)
    y0, y1 = min(finite), max(finite)
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - 0.5, y1 + 0.5
    pad = 0.05 * (y1 - y0)
    y0, y1 = y0 - pad, y1 + pad
    pw, ph = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' role='img'>",
           f"<text x='{left}' y='16' font-size='13'>{esc(title)}</text>",
           f"<rect x='{left}' y='{top}' width='{pw}' height='{ph}' fill='none' stroke='#999'/>"]
    for k in range(5):
        yv = y0 + (y1 - y0) * k / 4
        out.append(f"<text x='{left - 6}' y='{sy(yv) + 4:.1f}' font-size='10' text-anchor='end'>{yv:.3g}</text>")
    for x in range(x0, x1 + 1):
        out.append(f"<text x='{sx(x):.1f}' y='{height - 12}' font-size='10' text-anchor='middle'>{x}</text>")
    for i, (label, colour, dash, pts) in enumerate(series):
        segment: list[str] = []
        segments = []
        for x, y in pts:
            if math.isfinite(y):
                segment.append(f"{sx(x):.1f},{sy(y):.1f}")
            else:
                out.append(f"<text x='{sx(x):.1f}' y='{top + 10}' font-size='12' fill='{colour}' "
                           f"text-anchor='middle'>&#215;</text>")
                if segment:
                    segments.append(segment)
                segment = []
        if segment:
            segments.append(segment)
        for seg in segments:
            dash_attr = f" stroke-dasharray='{dash}'" if dash else ""
            width_px = 3 if colour == "#000" else 1.5
            out.append(f"<polyline points='{' '.join(seg)}' fill='none' stroke='{colour}' "
                       f"stroke-width='{width_px}' stroke-opacity='0.8'{dash_attr}/>")
            if len(seg) == 1:
                cx, cy = seg[0].split(",")
                out.append(f"<circle cx='{cx}' cy='{cy}' r='2.5' fill='{colour}'/>")
        ly = top + 12 + 14 * i
        out.append(f"<line x1='{width - right + 10}' y1='{ly - 4}' x2='{width - right + 30}' y2='{ly - 4}' "
                   f"stroke='{colour}' stroke-width='2'" + (f" stroke-dasharray='{dash}'" if dash else "") + "/>")
        out.append(f"<text x='{width - right + 34}' y='{ly}' font-size='10'>{esc(label)}</text>")
    out.append("</svg>")
    return "".join(out)


def _short(v: Verdict) -> str:
    if v.status == "pass":
        return "pass" + ("" if v.max_param_deviation is None else f" (max |Δθ| {v.max_param_deviation:.1e})")
    if v.status == "fail":
        d = v.divergences[0] if v.divergences else None
        if d is None:
            return f"FAIL: {v.reason}"
        where = f"{d.quantity}" + (f" @ step {d.step}" if d.step is not None else "")
        dev = f" ({d.deviation:.2e})" if d.deviation is not None else ""
        return f"FAIL {where}{dev} [{d.run}]"
    return f"{v.status}: {v.reason}"


def _cell(v: Verdict) -> str:
    """The terminal cell: short enough for one line per strategy column; reasons go below the table."""
    if v.status == "pass":
        return "pass" if v.max_param_deviation is None else f"pass {v.max_param_deviation:.1e}"
    if v.status == "fail":
        d = v.divergences[0] if v.divergences else None
        if d is None:
            return "FAIL"
        where = d.quantity if len(d.quantity) <= 24 else d.quantity[:23] + "…"
        return f"FAIL {where}" + (f"@{d.step}" if d.step is not None else "") + (
            f" ({d.deviation:.1e})" if d.deviation is not None else "")
    return v.status


def _rich_cell(v: Verdict) -> str:
    from rich.markup import escape

    text = escape(_cell(v))
    style = {"pass": "green", "fail": "bold red", "unsupported": "dim", "skipped": "yellow"}.get(v.status, "")
    return f"[{style}]{text}[/{style}]" if style else text


def _json_traces(traces: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for scenario, runs in traces.items():
        out[scenario] = {}
        for run_id, t in runs.items():
            d = {k: v for k, v in t.items() if k not in ("state", "ranks")}
            if "ranks" in t:
                d["ranks"] = [{"collectives": r.get("collectives"), "counts": r.get("counts")} for r in t["ranks"]]
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
    return value


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
        reference = suite.reference() if any(r.status == "ran" for r in results) else {}
        verdicts = {r.name: judge(r, reference, suite.scenarios) for r in results}
        report = SuiteReport(
            world_size=suite.world_size, alt_world_size=suite.alt_world_size, scenarios=suite.scenarios,
            results=results, verdicts=verdicts, reference=reference, reference_wall_s=suite.reference_wall_s,
            wall_s=time.perf_counter() - started,
        )
    finally:
        if own_suite:
            suite.close()
    if report_dir is not None:
        report.write(report_dir)
    return report


__all__ = ["SuiteReport", "certify", "svg_plot"]
