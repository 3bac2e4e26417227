"""Plots: each strategy's relative deviation from the reference per step, as inline SVG.

Relative loss and grad-norm difference on a log scale, the precision's ceiling drawn in;
exact agreement is drawn at the plot's floor (:data:`PLOT_FLOOR`).
"""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING, Any

from unison.conformance.execution import REFERENCE
from unison.conformance.spec import Scenario
from unison.conformance.verdict import RELATIVE_FLOOR, TOLERANCES

if TYPE_CHECKING:
    from unison.conformance.report import SuiteReport

#: Line colours (matplotlib's tab10), one per strategy.
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]


#: Relative deviations below this (exact agreement included) are drawn at this value on the log axis.
PLOT_FLOOR = 1e-10


def _rel(a: float, b: float) -> float | None:
    """Relative deviation as the comparison measures it; ``None`` where either is not finite (skipped steps)."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return None
    return abs(a - b) / max(abs(b), RELATIVE_FLOOR)


def deviation_series(report: SuiteReport, scenario: Scenario) -> list[dict[str, Any]]:
    """Per strategy run compared with a reference run: relative loss and grad-norm deviation per step."""
    ref_runs = report.reference.get(scenario.name, {})
    series = []
    for i, r in enumerate(report.results):
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


def deviation_plot(report: SuiteReport, scenario: Scenario) -> str:
    """An SVG figure: |strategy - reference| / |reference| per step for the loss and the grad norm."""
    from matplotlib import rc_context
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogLocator, MaxNLocator

    series = deviation_series(report, scenario)
    if not series and any(r.backend == "strategy" for r in scenario.runs):
        # default_plugins, fresh_resume: Dropout masks are drawn per rank, so no reference run has them.
        return (
            f"<p><i>{scenario.name}: the strategy's runs are compared with each other (bit for bit), not with "
            "the reference: no deviation from it to plot</i></p>"
        )
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
