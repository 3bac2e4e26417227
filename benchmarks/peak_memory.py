"""Peak memory per rank: unison against the hand-written loop on the same backend API (CPU: resident set size).

Each contender trains in a world of its own, of new processes, so neither inherits the memory the other
freed (the allocator keeps freed pages resident). In each rank, after the imports both contenders need
and the process group, the peak resident set is reset (``5`` written to ``/proc/self/clear_refs``), the
contender trains the workload (:mod:`.workload`), and the peak is read (``VmHWM`` in
``/proc/self/status``). The ratio is unison's peak over the hand-written loop's, on the rank where it is
largest; the table also gives each contender's growth over the resident set at the reset, which is
where a difference made by training shows undiluted by the interpreter and the libraries.

A second measurement (``warm``) runs a short unison fit of the same strategy in both contenders before
the reset: every module a fit imports (unison's own, pydantic's for the option schemas, rich) is then
resident in both, and what remains between them is the memory of training itself, the CPU analogue of
comparing ``torch.cuda.max_memory_allocated``.

A third (``fixed``) also fixes glibc's mmap threshold at 128 KiB (``mallopt(M_MMAP_THRESHOLD)``) before
the warm-up fit. By default glibc raises that threshold each time a large block is freed, after which
large tensors come from the heap, whose freed space stays resident: the peak then depends on the order
of allocations as much as on their sizes (the two ranks of one hand-written zero2 loop on the lm
workload differ by 24-32 MiB). With the threshold fixed, every tensor above it is mapped and unmapped on
its own, and the peak follows the memory in use.
"""

from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path
from typing import Any

#: unison's peak resident set over the hand-written loop's, per rank.
MEMORY_TARGET = 1.02
#: ``M_MMAP_THRESHOLD`` for glibc's ``mallopt``, and the value the ``fixed`` measurement sets.
_M_MMAP_THRESHOLD, FIXED_MMAP_THRESHOLD = -3, 128 * 1024


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> float:
    """Reset this process's peak resident set to its current one (Linux); the current one, MiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mib("VmRSS")


def peak_rss(w: Any, strategy: str, who: str, warm: bool = False, fixed: bool = False) -> dict[str, float]:
    """Run in every rank of a fresh world: train ``w`` as ``who`` (``hand`` or ``unison``); the rank's MiB.

    With ``warm``, a 3-step unison fit of the same strategy runs first, in either contender; with ``fixed``,
    glibc's mmap threshold is fixed first (see the module docstring).
    """
    if fixed and not ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, FIXED_MMAP_THRESHOLD):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed: not glibc?")
    import unison  # noqa: F401  both contenders pay for the same imports before the reset
    from benchmarks.workload import HAND_LOOPS, run_unison

    if strategy.startswith("zero"):
        import deepspeed  # noqa: F401
    if warm:
        run_unison(dataclasses.replace(w, steps=3, warmup=1), strategy)
    base = reset_peak()
    if who == "hand":
        HAND_LOOPS[strategy](w)
    else:
        run_unison(w, strategy)
    return {"base_mib": base, "peak_mib": _status_mib("VmHWM")}


def compare(
    w: Any, strategy: str, world: int, timeout: float, warm: bool = False, fixed: bool = False
) -> dict[str, list[dict[str, float]]]:
    """Each contender's per-rank peaks, each in a new world of ``world`` ranks (the hand-written loop first)."""
    from unison.launch.torchrun import spawn

    return {who: spawn(peak_rss, world, w, strategy, who, warm, fixed, timeout=timeout) for who in ("hand", "unison")}


def summarize(ranks: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    """The ratio on the rank where it is largest, with that rank's numbers."""
    ratios = [u["peak_mib"] / h["peak_mib"] for h, u in zip(ranks["hand"], ranks["unison"])]
    r = max(range(len(ratios)), key=ratios.__getitem__)
    h, u = ranks["hand"][r], ranks["unison"][r]
    return {
        "rank": r,
        "ratio": ratios[r],
        "hand_peak": h["peak_mib"],
        "unison_peak": u["peak_mib"],
        "hand_growth": h["peak_mib"] - h["base_mib"],
        "unison_growth": u["peak_mib"] - u["base_mib"],
    }
