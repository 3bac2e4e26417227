"""Overhead per backend: unison against a hand-written loop on the same backend API.

For each strategy both contenders train the same workload (:mod:`.workload`)
in the same process or world, alternated round by round (hand first on even
rounds, unison first on odd ones) so that load on the machine hits both alike,
after one unrecorded round of both (the first fit in a process pays one-time
costs past its warm-up steps: allocator growth, first calls).
Each run's steady-state step time is read from stamps taken after every
optimizer step (warm-up steps excluded); the ratio is the median unison time
over the median hand-written time. ``single`` runs in this process, the others
in one gloo world.

Beside the wall-clock ratio, the CPU ratio: the CPU seconds each steady step
used, summed over the world's processes (every thread: autograd's and gloo's
included), unison's median over the loop's. Time a process waits in a gloo
collective (which uses no CPU) or is not scheduled is not CPU time, so this
ratio measures the work unison adds (its Python, its extra collectives' own
cost), not the waits that work causes on another rank, which only the wall
clock shows. It does not remove the host's own variation: under a virtual
machine a step's CPU time moves with the host's load, and on a quiet guest the
CPU and wall-clock ratios of a round agree.

In the world, a third contender runs alongside: unison with its per-step stop
agreement removed (:func:`without_stop_agreement`, an ablation that exists
only here), which measures what that one collective costs on this machine
where the agreement runs one (on the CPU, a strategy whose loss all-reduce
spans the world carries the flags in it: there the ablation removes only
their bookkeeping).
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.workload import HAND_LOOPS, Workload, run_unison, steady_step_cpu, steady_step_time

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

    Key ``who``: wall seconds per steady step; key ``who + "_cpu"``: CPU seconds per steady step, summed over
    the world's processes. With ``ablation``, unison without its stop agreement runs too (key
    ``"no_agreement"``).
    """
    contenders = ["hand", "unison"] + (["no_agreement"] if ablation else [])
    times: dict[str, list[float]] = {key: [] for who in contenders for key in (who, who + "_cpu")}
    for r in range(-1, rounds):  # round -1 is not recorded: it takes the process's one-time costs out of both
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
            if r >= 0:
                cpu = torch.tensor([steady_step_cpu(stamps, w.warmup)], dtype=torch.float64)
                if dist.is_initialized():
                    dist.all_reduce(cpu)  # the ranks skip the same round, so each joins every all-reduce
                times[who].append(steady_step_time(stamps, w.warmup))
                times[who + "_cpu"].append(float(cpu))
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
    uc, hc = statistics.median(times["unison_cpu"]), statistics.median(times["hand_cpu"])
    return {
        "unison_cpu_ms": uc * 1e3,
        "hand_cpu_ms": hc * 1e3,
        "cpu_ratio": uc / hc,
        "cpu_round_ratios": [a / b for a, b in zip(times["unison_cpu"], times["hand_cpu"])],
        "unison_ms": u * 1e3,
        "hand_ms": h * 1e3,
        "ratio": u / h,
        "round_ratios": per_round,
        "hand_spread": (max(times["hand"]) - min(times["hand"])) / h,
        "unison_spread": (max(times["unison"]) - min(times["unison"])) / u,
        "rounds": len(per_round),
        "no_agreement_ratio": statistics.median(times["no_agreement"]) / h if "no_agreement" in times else None,
    }
