"""The suite's own mutation score: every deliberately broken strategy must be caught.

Reads a written report (``report.json``) of a run over strategies known to be
wrong, each with one defect, and prints ``N of N caught, smallest margin M``:
a strategy is *caught* when its certificate failed (a scenario failed); its
margin is the largest, over its failed scenarios, of the deciding check's
deviation over its tolerance (``inf`` when every failure is categorical: an
undeclared refusal, an error, a hook sequence or collective count). A broken
strategy whose scenarios are only *inconclusive* (the effect they exist to see is
below 10x the tolerance) is not caught: nothing proved it wrong. A control with an
inconclusive scenario is not certified, so it fails as a control. Exit
status 1 when any of them was not caught, or when a control (a correct
strategy among them) was not certified on the scenarios that ran. With
``--rules name:rule,...`` it also checks each diagnosis: a broken strategy is
*named right* when one of its failed scenarios is diagnosed with that rule, and
the line says ``diagnoses N of N right``; a wrong one fails the score too::

    python -m unison.conformance.mutation runs/conformance-broken --broken a,b,c --control d --rules a:summed
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class MutationScore:
    caught: dict[str, float]
    missed: list[str]
    controls_failed: list[str]
    #: Broken strategies not caught whose certificate was withheld only by inconclusive scenarios.
    inconclusive: list[str] = field(default_factory=list)
    #: ``{name: (expected rule, the rules its failed scenarios were diagnosed with)}`` for ``--rules``.
    diagnoses: dict[str, tuple[str, list[str]]] = field(default_factory=dict)

    @property
    def misnamed(self) -> list[str]:
        return [n for n, (want, got) in self.diagnoses.items() if want not in got]

    @property
    def total(self) -> int:
        return len(self.caught) + len(self.missed)

    @property
    def smallest_margin(self) -> tuple[str, float] | None:
        if not self.caught:
            return None
        name = min(self.caught, key=lambda n: self.caught[n])
        return name, self.caught[name]

    def line(self) -> str:
        text = f"{len(self.caught)} of {self.total} caught"
        smallest = self.smallest_margin
        if smallest is not None:
            value = "inf (categorical)" if math.isinf(smallest[1]) else f"{smallest[1]:.3g}"
            text += f", smallest margin {value} ({smallest[0]})"
        certified = [n for n in self.missed if n not in self.inconclusive]
        if certified:
            text += f"; CERTIFIED although broken: {', '.join(certified)}"
        if self.inconclusive:
            text += f"; not caught, only inconclusive: {', '.join(self.inconclusive)}"
        if self.controls_failed:
            text += f"; correct control not certified: {', '.join(self.controls_failed)}"
        if self.diagnoses:
            text += f"; diagnoses {len(self.diagnoses) - len(self.misnamed)} of {len(self.diagnoses)} right"
            for n in self.misnamed:
                want, got = self.diagnoses[n]
                text += f"; {n} diagnosed {', '.join(sorted(set(got))) or 'nothing'}, not {want}"
        return text

    @property
    def ok(self) -> bool:
        return not self.missed and not self.controls_failed and not self.misnamed


def score(
    report: dict[str, Any], broken: Sequence[str], controls: Sequence[str] = (), rules: dict[str, str] | None = None
) -> MutationScore:
    """The mutation score of ``report`` (the ``report.json`` dict) over ``broken`` strategies; ``rules``: the
    diagnosis rule each must be named with."""
    certs = {c["strategy"]: c for c in report["certificates"]}
    verdicts = {s["name"]: s["verdicts"] for s in report["strategies"]}
    caught: dict[str, float] = {}
    missed = []
    inconclusive = []
    for name in broken:
        cert = certs.get(name)
        if cert is None or not cert["failed"]:
            missed.append(name)
            if cert is not None and cert.get("inconclusive"):
                inconclusive.append(name)
            continue
        margins = [
            v["margin"] if v.get("margin") is not None else math.inf
            for v in verdicts[name].values()
            if v["status"] == "fail"
        ]
        caught[name] = max(margins)
    controls_failed = [n for n in controls if n not in certs or not certs[n].get("passed", certs[n]["certified"])]
    diagnoses = {
        name: (
            rule,
            [
                v["diagnosis"]["rule"]
                for v in verdicts.get(name, {}).values()
                if v["status"] == "fail" and v.get("diagnosis")
            ],
        )
        for name, rule in (rules or {}).items()
    }
    return MutationScore(caught, missed, controls_failed, inconclusive, diagnoses)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m unison.conformance.mutation", description=__doc__)
    parser.add_argument("report_dir", help="directory holding report.json")
    parser.add_argument("--broken", required=True, help="comma-separated strategies that must not be certified")
    parser.add_argument("--control", default="", help="comma-separated correct strategies that must pass")
    parser.add_argument("--rules", default="", help="comma-separated name:rule, the diagnosis each must be named")
    args = parser.parse_args(argv)
    report = json.loads((Path(args.report_dir) / "report.json").read_text())
    rules = dict(item.split(":", 1) for item in args.rules.split(",") if item)
    result = score(report, [n for n in args.broken.split(",") if n], [n for n in args.control.split(",") if n], rules)
    print(result.line())
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
