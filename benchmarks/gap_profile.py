"""Where the gap to the hand-written loop goes: a per-function profile of unison against the loop.

Each contender (unison and the hand-written loop on the same backend API) trains
the workload twice under :mod:`cProfile`, once for ``warmup`` steps and once for
``warmup + n`` steps, after one unprofiled short run that takes the one-time
imports and caches out of both. Subtracting the short run's per-function self time from
the long run's leaves what ``n`` steady steps cost, setup and warm-up cancelled
out, without a hook inside either loop. Divided by ``n`` it is microseconds per
step for every function either contender called.

The *excess* of a function is unison's per-step self time in it minus the
loop's. Rows name every function whose excess is above :data:`SHOW_ABOVE` of the
loop's profiled step, with its owner: ``unison`` (this package's own code),
``torch`` (its Python code and its C functions), ``python`` (the standard library
and other built-ins) or the file's package. A torch
function with an excess is work unison asks of torch that the loop does not
(a collective, a copy); the reason for each is in RESULTS.md's analysis.

A profiler slows Python code more than native kernels (a fixed cost per Python
call), so the profiled steps are slower than the timed ones and Python-heavy
costs weigh more in them; the shares here rank the costs, the overhead table
measures them.
"""

from __future__ import annotations

import cProfile
import dataclasses
import os
import pstats
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from benchmarks.workload import HAND_LOOPS, Workload, run_unison

#: A function is shown when its excess is above this share of the loop's profiled step.
SHOW_ABOVE = 0.01
ROOT = Path(__file__).resolve().parents[1]
_STDLIB = os.path.dirname(os.__file__)


def owner(filename: str) -> str:
    """Who a profiled function belongs to, from its file."""
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    if path.startswith(str(ROOT)) and "/.venv/" not in path and "/benchmarks/" not in path:
        return "unison"
    if path.startswith(str(ROOT / "benchmarks")):
        return "benchmark"
    if "site-packages" in path:
        return path.split("site-packages/", 1)[1].split("/", 1)[0]
    if path.startswith(_STDLIB) or path.startswith("<"):
        return "python"
    return "other"


def builtin_owner(name: str) -> str:
    """Who a C function belongs to, from cProfile's name for it (``<built-in method torch._C...>``)."""
    return "torch" if "torch" in name else "python"


def _self_times(fn: Callable[[], Any]) -> dict[tuple[str, int, str], float]:
    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    stats: Any = pstats.Stats(prof)
    return {key: value[2] for key, value in stats.stats.items()}


def per_step(run: Callable[[Workload], Any], w: Workload, steps: int) -> dict[tuple[str, int, str], float]:
    """Seconds of self time per steady step, by function: a long run minus a short one, over the difference."""
    short = dataclasses.replace(w, steps=w.warmup)
    long = dataclasses.replace(w, steps=w.warmup + steps)
    run(short)  # once unprofiled: one-time imports and caches land in neither profile
    if dist.is_initialized():
        dist.barrier()
    a = _self_times(lambda: run(short))
    if dist.is_initialized():
        dist.barrier()
    b = _self_times(lambda: run(long))
    return {k: (b.get(k, 0.0) - a.get(k, 0.0)) / steps for k in set(a) | set(b)}


def _name(key: tuple[str, int, str]) -> str:
    filename, line, func = key
    if filename == "~":  # a built-in (a C function): its name says what it is
        return func
    path = os.path.abspath(filename)
    short = path.split("site-packages/", 1)[1] if "site-packages/" in path else os.path.relpath(path, ROOT)
    return f"{short}:{line} {func}"


def compare(strategy: str, w: Workload, steps: int = 40) -> dict[str, Any]:
    """Per-step profiles of unison and the hand-written loop on ``strategy`` (in every rank of its world)."""
    unison = per_step(lambda x: run_unison(x, strategy), w, steps)
    hand = per_step(HAND_LOOPS[strategy], w, steps)
    hand_step, unison_step = sum(hand.values()), sum(unison.values())
    by_owner: dict[str, float] = defaultdict(float)
    rows = []
    for key in set(unison) | set(hand):
        excess = unison.get(key, 0.0) - hand.get(key, 0.0)
        who = builtin_owner(key[2]) if key[0] == "~" else owner(key[0])
        by_owner[who] += excess
        if excess > SHOW_ABOVE * hand_step:
            rows.append(
                {
                    "function": _name(key),
                    "owner": who,
                    "unison_us": unison.get(key, 0.0) * 1e6,
                    "hand_us": hand.get(key, 0.0) * 1e6,
                    "excess_share": excess / hand_step,
                }
            )
    rows.sort(key=lambda r: -r["excess_share"])
    return {
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "hand_step_us": hand_step * 1e6,
        "unison_step_us": unison_step * 1e6,
        "excess_by_owner": {k: v / hand_step for k, v in sorted(by_owner.items(), key=lambda kv: -kv[1])},
        "rows": rows,
    }


def world_compare(w: Workload, strategy: str, steps: int) -> dict[str, Any]:
    """Run in every rank of a world; every rank's profile comes back (rank 0's return value carries all)."""
    mine = compare(strategy, w, steps)
    if not dist.is_initialized():
        return {"ranks": [mine]}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {"ranks": everyone}


if __name__ == "__main__":  # python -m benchmarks.gap_profile [single|pipeline]: print the rows
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from benchmarks.workload import WORKLOADS

    name = sys.argv[1] if len(sys.argv) > 1 else "single"
    workload = WORKLOADS[sys.argv[2] if len(sys.argv) > 2 else "mlp"]()
    if name == "single":
        out = world_compare(workload, name, 40)
    else:
        from unison.launch.torchrun import spawn

        out = spawn(world_compare, 2, workload, name, 40, timeout=900)[0]
    for r in out["ranks"]:
        print(f"rank {r['rank']}: hand {r['hand_step_us']:.0f} us, unison {r['unison_step_us']:.0f} us")
        print("  excess by owner:", {k: f"{v:+.1%}" for k, v in r["excess_by_owner"].items()})
        for row in r["rows"]:
            print(
                f"  {row['excess_share']:+.1%} {row['owner']:>8} {row['function']} "
                f"({row['unison_us']:.0f} vs {row['hand_us']:.0f} us)"
            )
