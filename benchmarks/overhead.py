"""Overhead per backend: unison against a hand-written loop on the same backend API.

For each strategy both contenders train the same workload (:mod:`.workload`)
in the same process or world, alternated round by round (hand first on even
rounds, unison first on odd ones) so that load on the machine hits both alike.
Each run's steady-state step time is read from stamps taken after every
optimizer step (warm-up steps excluded); the ratio is the median unison time
over the median hand-written time. ``single`` runs in this process, the others
in one gloo world.

In the world, a third contender runs alongside: unison with its per-step stop
agreement removed (:func:`without_stop_agreement`, an ablation that exists
only here), which measures what that one collective costs on this machine.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from benchmarks.workload import HAND_LOOPS, Workload, run_unison, steady_step_time

DISTRIBUTED = ("ddp", "fsdp", "zero2", "zero3", "pipeline")


@contextlib.contextmanager
def without_stop_agreement() -> Iterator[None]:
    """Ablation, for measurement only: the trainer skips the all-reduce that agrees on stopping.

    Not a supported mode: with it a ``should_stop`` set on one rank, or a
    signal reaching one rank, would stop the ranks after different steps.
    """
    from unison.training.stopping import StopAgreement

    agree = StopAgreement.agree
    StopAgreement.agree = lambda self, now=False: self.trainer.should_stop  # type: ignore[method-assign]
    try:
        yield
    finally:
        StopAgreement.agree = agree  # type: ignore[method-assign]


def alternate(w: Workload, strategy: str, rounds: int, ablation: bool = False) -> dict[str, list[float]]:
    """Step times of the contenders over ``rounds`` alternated rounds (on every rank; rank 0's are the world's).

    With ``ablation``, unison without its stop agreement runs too (key ``"no_agreement"``).
    """
    contenders = ["hand", "unison"] + (["no_agreement"] if ablation else [])
    times: dict[str, list[float]] = {who: [] for who in contenders}
    for r in range(rounds):
        for who in contenders if r % 2 == 0 else contenders[::-1]:
            if dist.is_initialized():
                dist.barrier()
            if who == "hand":
                stamps = HAND_LOOPS[strategy](w)
            elif who == "unison":
                stamps = run_unison(w, strategy)["stamps"]
            else:
                with without_stop_agreement():
                    stamps = run_unison(w, strategy)["stamps"]
            times[who].append(steady_step_time(stamps, w.warmup))
    return times


def world_overhead(w: Workload, strategies: tuple[str, ...], rounds: int) -> dict[str, Any]:
    """Run in every rank of a world: the alternated rounds of each strategy, then ddp's per-step collectives."""
    from benchmarks.framework import distributed_costs

    out: dict[str, Any] = {"times": {s: alternate(w, s, rounds, ablation=True) for s in strategies}}
    out["collectives_us"] = {s: distributed_costs(w, s) for s in strategies}
    return out


def summarize(times: dict[str, list[float]]) -> dict[str, Any]:
    u, h = statistics.median(times["unison"]), statistics.median(times["hand"])
    # Noise: the spread of the per-round ratios (each round's pair ran back to back).
    per_round = [a / b for a, b in zip(times["unison"], times["hand"])]
    return {
        "unison_ms": u * 1e3,
        "hand_ms": h * 1e3,
        "ratio": u / h,
        "round_ratios": per_round,
        "hand_spread": (max(times["hand"]) - min(times["hand"])) / h,
        "unison_spread": (max(times["unison"]) - min(times["unison"])) / u,
        "rounds": len(per_round),
        "no_agreement_ratio": statistics.median(times["no_agreement"]) / h if "no_agreement" in times else None,
    }
