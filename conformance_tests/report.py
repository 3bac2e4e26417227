"""The report a platform team attaches to a review: terminal table, JSON, HTML.

:func:`certify` runs the suite for some strategies and returns a
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

A strategy is *certified* when it ran, no scenario failed, none was
inconclusive and at least one training scenario was proven; the certificate
lists which scenarios were proven, which were declared out and which were
inconclusive (listed separately: an inconclusive scenario is neither proven nor
failed, and it withholds the certificate).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import io
import json
import math
import os
import platform
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unison.conformance.compare import (
    DECLARED_OUT,
    FAIL,
    INCONCLUSIVE,
    PASS,
    SKIPPED,
    TOLERANCES,
    Verdict,
    judge,
    status_label,
)
from unison.conformance.runner import REFERENCE, StrategyResult, Suite
from unison.conformance.scenarios import SCENARIOS, SCENARIOS_BY_NAME, Scenario

#: Line colours (matplotlib's tab10), one per strategy.
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]
#: Relative deviations below this (exact agreement included) are drawn at this value on the log axis.
PLOT_FLOOR = 1e-10
#: Packages whose versions the report names (read from the installed metadata, nothing imported).
VERSIONED = ("unison", "torch", "pluggy", "deepspeed", "fairscale", "apex", "transformers")


# --------------------------------------------------------------------------- #
# Environment and certificates
# --------------------------------------------------------------------------- #


def _git_revision() -> dict[str, Any] | None:
    """The git commit of the unison source tree (editable installs, CI checkouts), or ``None``."""
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": rev.stdout.strip(), "dirty": bool(status.stdout.strip())}


def environment(world_size: int, alt_world_size: int) -> dict[str, Any]:
    """What the certificate was produced with: versions, revision, host, world sizes."""
    versions = {}
    for name in VERSIONED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    versions["python"] = platform.python_version()
    import torch

    return {
        "versions": versions,
        "git": _git_revision(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "accelerator": "cpu",
        "distributed_backend": "gloo" if torch.distributed.is_available() else None,
        "world_size": world_size,
        "alt_world_size": alt_world_size,
    }


@dataclass
class Certificate:
    """One strategy's outcome at one world size."""

    strategy: str
    certified: bool
    #: One line: why (not) certified.
    summary: str
    proven: list[str]
    #: ``[(scenario, declared reason)]``
    declared_out: list[tuple[str, str]]
    #: ``[(scenario, diagnosis or first divergence)]``
    failed: list[tuple[str, str]]
    skipped: str | None = None
    non_conformant: str | None = None
    #: ``[(scenario, why)]``: every check held but the effect is below 10x the tolerance (not proven).
    inconclusive: list[tuple[str, str]] = field(default_factory=list)
    #: Scenarios this run covered, and how many the full catalogue has: a run of
    #: fewer is *partial* and never reads as a certificate.
    scenarios_run: int = 0
    scenarios_total: int = 0
    #: World sizes at which at least one scenario was proven (the main world,
    #: and the other world size when a reshard resume was proven there).
    world_sizes: list[int] = field(default_factory=list)
    #: ``{scenario: measured deviation / tolerance}`` of every proven scenario with numbers compared.
    deviation_ratios: dict[str, float] = field(default_factory=dict)

    @property
    def partial(self) -> bool:
        return self.scenarios_run < self.scenarios_total

    @property
    def label(self) -> str:
        """``certified``, ``partial: n of N scenarios`` (nothing failed, but not every scenario ran) or
        ``not certified``."""
        if not self.certified:
            return "not certified"
        if self.partial:
            return f"partial: {self.scenarios_run} of {self.scenarios_total} scenarios"
        return "certified"

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            # A partial run certifies nothing, whatever passed.
            "certified": self.certified and not self.partial,
            "partial": self.partial,
            "passed": self.certified,
            "label": self.label,
            "scenarios_run": self.scenarios_run,
            "scenarios_total": self.scenarios_total,
            "world_sizes": self.world_sizes,
            "deviation_ratios": self.deviation_ratios,
            "summary": self.summary,
            "proven": self.proven,
            "declared_out": [{"scenario": s, "reason": r} for s, r in self.declared_out],
            "failed": [{"scenario": s, "why": w} for s, w in self.failed],
            "inconclusive": [{"scenario": s, "why": w} for s, w in self.inconclusive],
            "skipped": self.skipped,
            "non_conformant": self.non_conformant,
        }


#: What each word of the report means, in plain language (shown in the HTML report).
LEGEND = (
    ("certified", "every scenario of the suite ran; none failed; each was proven or declared out"),
    (
        "partial",
        "only some scenarios ran (--scenario); none of those failed, but a partial run certifies nothing",
    ),
    ("not certified", "at least one scenario failed or was inconclusive, or nothing could be proven"),
    ("pass (proven)", "the strategy trained like the single-process reference, within the tolerance"),
    ("declared out", "the strategy refused the scenario, and its declaration says it does not support what it needs"),
    ("fail", "the strategy differed from the reference, or refused something it declares it supports"),
    ("skipped", "the strategy cannot run on this machine (e.g. its library is not installed)"),
    (
        "inconclusive",
        "every check held, but the effect the scenario exists to see (e.g. bf16 vs fp32) is below 10x its "
        "tolerance, so passing proves nothing: not proven, and no certificate while it lasts",
    ),
)


def _proven_world_sizes(result: StrategyResult, verdicts: dict[str, Verdict], world_size: int) -> list[int]:
    sizes = set()
    for name, v in verdicts.items():
        scenario = SCENARIOS_BY_NAME.get(name)
        if v.status != PASS or scenario is None or scenario.kind != "train":
            continue
        sizes.add(world_size)
        ran_alt = any(
            r.backend == "strategy"
            and r.world == "alt"
            and result.traces.get(name, {}).get(r.id, {}).get("status") == "ok"
            for r in scenario.runs
        )
        if ran_alt:
            sizes.add(result.alt_world_size)
    return sorted(sizes)


def _certificate(result: StrategyResult, verdicts: dict[str, Verdict], world_size: int) -> Certificate:
    proven = [n for n, v in verdicts.items() if v.status == PASS]
    out = [(n, v.reason or "") for n, v in verdicts.items() if v.status == DECLARED_OUT]
    failed = [
        (n, v.diagnosis.message() if v.diagnosis is not None else v.summary())
        for n, v in verdicts.items()
        if v.status == FAIL
    ]
    cert = Certificate(
        result.name,
        False,
        "",
        proven,
        out,
        failed,
        non_conformant=result.non_conformant,
        scenarios_run=len(verdicts),
        scenarios_total=len(SCENARIOS),
        world_sizes=_proven_world_sizes(result, verdicts, world_size),
        inconclusive=[(n, v.reason or "") for n, v in verdicts.items() if v.status == INCONCLUSIVE],
        deviation_ratios={n: r for n, v in verdicts.items() if (r := v.deviation_ratio) is not None},
    )
    if result.status == "skipped":
        cert.skipped = result.reason
        cert.summary = f"not run here: {result.reason}"
    elif result.status != "ran":
        cert.summary = f"could not be run: {result.reason}"
    elif failed:
        cert.summary = f"{len(failed)} scenario(s) failed: {', '.join(n for n, _ in failed)}"
    elif cert.inconclusive:
        cert.summary = (
            f"{len(cert.inconclusive)} scenario(s) inconclusive (effect below 10x the tolerance, nothing proven): "
            f"{', '.join(n for n, _ in cert.inconclusive)}"
        )
    elif not any(SCENARIOS_BY_NAME[n].kind == "train" for n in proven if n in SCENARIOS_BY_NAME):
        # Declarations alone (checked without training) certify nothing.
        cert.summary = f"no training scenario proven at world size {world_size}: every one ran is declared out"
    else:
        cert.certified = True
        sizes = " and ".join(str(n) for n in cert.world_sizes) or str(world_size)
        cert.summary = f"{len(proven)} scenario(s) proven at world size {sizes}" + (
            f", {len(out)} declared out" if out else ""
        )
        if cert.deviation_ratios:
            worst = max(cert.deviation_ratios, key=lambda n: cert.deviation_ratios[n])
            cert.summary += f"; largest deviation {cert.deviation_ratios[worst]:.2g} of the tolerance ({worst})"
        if cert.partial:
            cert.summary += (
                f"; only {cert.scenarios_run} of the {cert.scenarios_total} scenarios ran, so this is no "
                "certificate (run every scenario to certify)"
            )
    return cert


# --------------------------------------------------------------------------- #
# The report
# --------------------------------------------------------------------------- #


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
        return _certificate(result, self.verdicts[strategy], self.world_size)

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
        notes = []
        for r in self.results:
            seen = set()
            for v in self.verdicts[r.name].values():
                if v.status in (DECLARED_OUT, SKIPPED, INCONCLUSIVE) and v.reason not in seen:
                    seen.add(v.reason)
                    scenarios = [n for n, w in self.verdicts[r.name].items() if w.reason == v.reason]
                    notes.append(f"  {r.name} {status_label(v.status)} ({', '.join(scenarios)}): {v.reason}")
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
                    "plot": jinja2_markup(self.deviation_plot(s)) if s.kind == "train" else None,
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

    # -- plots ------------------------------------------------------------- #
    def deviation_series(self, scenario: Scenario) -> list[dict[str, Any]]:
        """Per strategy run compared with a reference run: relative loss and grad-norm deviation per step."""
        ref_runs = self.reference.get(scenario.name, {})
        series = []
        for i, r in enumerate(self.results):
            for j, run in enumerate(rn for rn in scenario.runs if rn.backend == "strategy"):
                against = run.twin or run.truth
                t = r.traces.get(scenario.name, {}).get(run.id)
                ref = ref_runs.get(against or "")
                if not t or t.get("status") != "ok" or not ref or ref.get("status") != "ok":
                    continue
                want = {s["step"]: s for s in ref.get("steps", [])}
                points = []
                for s in t.get("steps", []):
                    b = want.get(s["step"])
                    if b is None:
                        continue
                    points.append((s["step"], _rel(s["loss"], b["loss"]), _rel(s["grad_norm"], b["grad_norm"])))
                series.append(
                    {
                        "label": f"{r.name} ({run.id} vs {REFERENCE} {against})",
                        "strategy": r.name,
                        "colour": COLORS[i % len(COLORS)],
                        "style": ["-", "--", ":", "-."][j % 4],
                        "points": points,
                    }
                )
        return series

    def deviation_plot(self, scenario: Scenario) -> str:
        """An SVG figure: |strategy - reference| / |reference| per step for the loss and the grad norm."""
        from matplotlib import rc_context
        from matplotlib.figure import Figure
        from matplotlib.ticker import LogLocator, MaxNLocator

        series = self.deviation_series(scenario)
        if not series:
            return f"<p><i>{scenario.name}: no strategy run to compare</i></p>"
        tol = TOLERANCES.get(scenario.precision)
        # Text stays text (searchable, small); the salt keeps element ids unique across the inline figures.
        with rc_context({"svg.fonttype": "none", "svg.hashsalt": f"unison-{scenario.name}", "font.size": 9}):
            # The legend goes below the axes, two columns, its rows adding height:
            # beside them, long labels squeezed the axes and ran into the titles.
            legend_rows = math.ceil((len(series) + (tol is not None)) / 2)
            fig = Figure(figsize=(9.5, 3.0 + 0.2 * legend_rows), layout="constrained")
            axes = fig.subplots(1, 2, sharey=True)
            for ax, index, quantity, ceiling in (
                (axes[0], 1, "loss", tol.loss if tol else None),
                (axes[1], 2, "grad norm", tol.grad_norm if tol else None),
            ):
                for s in series:
                    xs = [p[0] for p in s["points"] if p[index] is not None]
                    ys = [max(p[index], PLOT_FLOOR) for p in s["points"] if p[index] is not None]
                    ax.plot(
                        xs, ys, s["style"], color=s["colour"], marker="o", markersize=3, linewidth=1.4, label=s["label"]
                    )
                if ceiling is not None:
                    ax.axhline(
                        ceiling,
                        color="#444",
                        linestyle=(0, (4, 3)),
                        linewidth=1,
                        label=f"ceiling ({scenario.precision})",
                    )
                ax.set_yscale("log")
                ax.set_ylim(
                    PLOT_FLOOR / 3,
                    max(1.0, 3 * max((p[index] or 0.0 for s in series for p in s["points"]), default=1.0)),
                )
                ax.yaxis.set_major_locator(LogLocator(base=10, numticks=12))
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                ax.set_xlabel("optimizer step")
                ax.set_title(quantity)
                ax.grid(True, which="major", alpha=0.3)
            axes[0].set_ylabel(f"|strategy − reference| / |reference|\n(exact = {PLOT_FLOOR:.0e})")
            handles, labels = axes[0].get_legend_handles_labels()
            fig.suptitle(f"{scenario.name}: relative deviation from the reference ({REFERENCE}) per optimizer step")
            fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize=8, frameon=False)
            buffer = io.StringIO()
            fig.savefig(buffer, format="svg", bbox_inches="tight")
        svg = buffer.getvalue()
        return svg[svg.index("<svg") :]


def jinja2_markup(text: str) -> Any:
    import markupsafe

    return markupsafe.Markup(text)


def _rel(a: float, b: float) -> float | None:
    """Relative deviation as the comparison measures it; ``None`` where either is not finite (skipped steps)."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return None
    from unison.conformance.compare import RELATIVE_FLOOR

    return abs(a - b) / max(abs(b), RELATIVE_FLOOR)


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


__all__ = ["LEGEND", "Certificate", "SuiteReport", "certify", "environment"]
