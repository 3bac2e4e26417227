"""The module-feature scenarios prove their feature was applied, not only that training matched.

``compile`` and ``activation_checkpointing`` are meant to change nothing in the
numbers: a strategy that ignores the option would pass the comparison with the
reference. So their runs carry a probe, recorded on every rank around ``fit``:

* ``compile``: the dynamo frames compiled during the fit
  (``torch._dynamo.utils.counters["frames"]["ok"]``, from an emptied dynamo
  cache); every rank of the strategy's run must have compiled at least one.
* ``activation_checkpointing``: the FLOPs executed during the fit
  (:func:`unison._upstream.torch.flop_counter`: ``torch.utils.flop_counter``'s formulas). A
  checkpointed block runs its forward again in backward, so the strategy's
  ranks together must execute more FLOPs than the reference without it (the
  ranks of a data-parallel world split the batch, a pipeline's ranks split the
  layers, so without recomputation the sum equals the reference's). For the
  suite's ``blocks`` model, every block checkpointed, the ratio is about 1.3
  (the two middle blocks' forwards run again; a one-``Linear`` block keeps only
  its input and weight and recomputes nothing); at least
  :data:`MIN_RECOMPUTE_RATIO` is required.

A probe that does not see its feature fails the scenario with a
:class:`~unison.conformance.verdict.Divergence` of kind ``feature``. A strategy
whose declaration refuses the feature is refused the run before any process
group and the scenario is *declared out* with the declared reason, never probed:
so is a strategy written for plugin API 2.0 that overrides ``setup``, whose
declaration refuses both features because its ``setup`` runs no
``apply_features`` ("the strategy overrides setup and does not apply features",
:mod:`unison.contract.compat`).
"""

from __future__ import annotations

from typing import Any

from unison.conformance.spec import Scenario

#: The least ratio of the strategy's FLOPs (all ranks) to the reference's that shows recomputation.
MIN_RECOMPUTE_RATIO = 1.1


class FeatureProbe:
    """Counts what shows a module feature at work in one run (see the module docstring)."""

    def __init__(self, feature: str) -> None:
        self.feature = feature
        self._mode: Any = None
        self._frames_before = 0
        self.value: float | None = None

    def __enter__(self) -> FeatureProbe:
        if self.feature == "compile":
            # A forward compiled earlier in this process (same code, guards that hold) would run from
            # dynamo's cache without compiling a frame: start from an empty cache.
            import torch

            from unison._upstream.torch import compiled_frames

            torch.compiler.reset()
            self._frames_before = compiled_frames()
        else:
            from unison._upstream.torch import flop_counter

            self._mode = flop_counter()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.feature == "compile":
            from unison._upstream.torch import compiled_frames

            self.value = float(compiled_frames() - self._frames_before)
        else:
            self._mode.__exit__(*exc)
            self.value = float(self._mode.total)

    def result(self) -> dict[str, Any]:
        return {"feature": self.feature, "value": self.value}


def check_feature_probe(
    c: Any, scenario: Scenario, label: str, trace: dict[str, Any], reference: dict[str, Any] | None
) -> None:
    """Fail ``c`` (a comparison checker) where the strategy's run shows no sign of its feature."""
    if scenario.probe is None:
        return
    ranks = [rt for rt in (trace.get("ranks") or [trace]) if rt.get("status") == "ok"]
    values = [(rt.get("feature_probe") or {}).get("value") for rt in ranks]
    if scenario.probe == "compile":
        c.checks.append(f"{label}: every rank compiled at least one frame with torch.compile")
        for r, frames in enumerate(values):
            if not frames:
                c.fail(
                    label,
                    f"frames compiled by torch.compile on rank {r}",
                    expected="> 0",
                    got=frames,
                    kind="feature",
                    note="the run asked for compile but nothing was compiled: the strategy ignored the option",
                )
        return
    c.checks.append(
        f"{label}: the ranks together executed at least {MIN_RECOMPUTE_RATIO}x the reference's FLOPs "
        "(checkpointed forwards recomputed in backward)"
    )
    ref = ((reference or {}).get("feature_probe") or {}).get("value")
    counted = [float(v) for v in values if v is not None]
    if not ref or len(counted) != len(values):
        c.fail(label, "FLOPs executed", note="no FLOP count recorded on a rank or in the reference", kind="run")
        return
    ratio = sum(counted) / ref
    if ratio < MIN_RECOMPUTE_RATIO:
        c.fail(
            label,
            "FLOPs executed by all ranks over the reference's (activation checkpointing recomputes forwards)",
            expected=f">= {MIN_RECOMPUTE_RATIO}",
            got=round(ratio, 4),
            kind="feature",
            note="no forward was recomputed in backward: the strategy did not apply activation checkpointing",
        )
