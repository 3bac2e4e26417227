"""Certificates: what a strategy proved, and the environment it was proven in.

A strategy is *certified* when it ran, no scenario failed, none was
inconclusive and at least one training scenario was proven; the certificate
lists which scenarios were proven, which were declared out and which were
inconclusive (listed separately: an inconclusive scenario is neither proven nor
failed, and it withholds the certificate).
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unison.conformance.scenarios import SCENARIOS, SCENARIOS_BY_NAME
from unison.conformance.suite import StrategyResult
from unison.conformance.verdict import DECLARED_OUT, FAIL, INCONCLUSIVE, PASS, Verdict
from unison.plugin.entry_points import installed_versions

#: Packages whose versions the report names (read from the installed metadata, nothing imported).
VERSIONED = ("unison", "torch", "pluggy", "deepspeed", "fairscale", "apex", "transformers")


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
    versions = installed_versions(VERSIONED)
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
    #: ``{precision: [dtype, ...]}``: what the strategy's gradient reductions (more than one element, in the
    #: forward/backward windows) carried under each precision its scenarios ran, from the process group's
    #: own record of each collective (:mod:`unison.conformance.checks.reported`).
    gradient_reductions: dict[str, list[str]] = field(default_factory=dict)

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
            "gradient_reductions": self.gradient_reductions,
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


def proven_world_sizes(result: StrategyResult, verdicts: dict[str, Verdict], world_size: int) -> list[int]:
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


def gradient_reductions(result: StrategyResult) -> dict[str, list[str]]:
    """The dtypes the strategy's gradient reductions carried, per precision of the scenarios it ran."""
    from unison.conformance.checks.reported import reduction_dtypes

    out: dict[str, set[str]] = {}
    for name, runs in result.traces.items():
        scenario = SCENARIOS_BY_NAME.get(name)
        if scenario is None:
            continue
        for trace in runs.values():
            if trace.get("status") == "ok":
                out.setdefault(scenario.precision, set()).update(reduction_dtypes(trace))
    return {p: sorted(d) for p, d in sorted(out.items()) if d}


def build_certificate(result: StrategyResult, verdicts: dict[str, Verdict], world_size: int) -> Certificate:
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
        world_sizes=proven_world_sizes(result, verdicts, world_size),
        inconclusive=[(n, v.reason or "") for n, v in verdicts.items() if v.status == INCONCLUSIVE],
        deviation_ratios={n: r for n, v in verdicts.items() if (r := v.deviation_ratio) is not None},
        gradient_reductions=gradient_reductions(result),
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
