"""``python -m benchmarks``: every benchmark in one run; prints tables and writes benchmarks/RESULTS.md.

Sections (``--only`` picks some): ``overhead`` (unison / hand-written loop per
backend), ``peer`` (unison / PyTorch Lightning and Accelerate, ddp and fsdp), ``profile`` (where the
gap to the hand-written loop goes, by function, for single and pipeline), ``memory`` (peak resident
set per rank, unison / hand-written loop per backend; see benchmarks/peak_memory.py),
``framework`` (time outside backend calls, hook dispatch), ``worlds`` (memory at world 2 and 4,
step time at world 1, 2, 4), ``data`` (sharded data: samples/s from local disk
and from an S3 server on loopback, read amplification at world 1, 2, 4; see
benchmarks/data_throughput.py), ``conformance`` (wall time of the conformance
matrix: read from ``--conformance-log``, or measured with ``--run-conformance``;
never run by default, it takes minutes).

Set ``OMP_NUM_THREADS=1`` (each rank of a world gets one thread, as the
conformance suite does); the run sets it when unset.

Past 400 lines because each section's table (titles, columns, the note that says
how to read it) is written here beside the call that fills it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SECTIONS = ("overhead", "peer", "profile", "memory", "framework", "worlds", "data", "conformance")
HERE = Path(__file__).resolve().parent
#: Sharded data from S3 on loopback: samples/s at least this fraction of local disk's.
DATA_TARGET = 0.8
#: Ratio targets (unison / the other), and the framework-time target.
RATIO_TARGET = 1.03
DISPATCH_TARGET_US = 100.0


class Table:
    """One result table, printed with rich and written as Markdown."""

    def __init__(self, title: str, headers: list[str], note: str = "") -> None:
        self.title, self.headers, self.note = title, headers, note
        self.rows: list[list[str]] = []

    def add(self, *cells: Any) -> None:
        self.rows.append([str(c) for c in cells])

    def rich(self) -> Any:
        from rich.table import Table as RichTable

        table = RichTable(title=self.title, caption=self.note or None, caption_justify="left")
        for h in self.headers:
            table.add_column(h)
        for row in self.rows:
            table.add_row(*row)
        return table

    def markdown(self) -> str:
        lines = [f"### {self.title}", ""]
        if self.note:
            lines += [self.note, ""]
        lines.append("| " + " | ".join(self.headers) + " |")
        lines.append("|" + "---|" * len(self.headers))
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in self.rows]
        return "\n".join(lines) + "\n"


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def machine() -> dict[str, str]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "cpu": f"{cpu}, {usable} usable cores",
        "gpu": gpu,
        "os": platform.platform(),
        "python": platform.python_version(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset"),
        "load average at start (1, 5, 15 min)": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


PACKAGES = ("unison", "torch", "deepspeed", "lightning", "accelerate", "pluggy", "numpy")


def _without_deepspeed() -> list[str]:
    """DeepSpeed is an extra (the `deepspeed` one): without it the ZeRO rows are left out, and said so."""
    import importlib.util

    return [] if importlib.util.find_spec("deepspeed") else ["zero2", "zero3"]


def _fmt_ratio(r: float, target: float = RATIO_TARGET) -> str:
    return f"{r:.3f}" + ("" if r <= target else " (above target)")


# --------------------------------------------------------------------------- #
# sections
# --------------------------------------------------------------------------- #


def section_overhead(w: Any, rounds: int, timeout: float) -> tuple[list[Table], dict[str, Any]]:
    from benchmarks.overhead import DISTRIBUTED, alternate, summarize, world_overhead
    from benchmarks.workload import HAND_DESCRIPTION
    from unison.launch.torchrun import spawn

    results = {"single": alternate(w, "single", rounds)}
    # One world per backend: a backend that patches torch globally (DeepSpeed ZeRO-3 wraps
    # F.linear) must not meet another's leftovers (FSDP2's DTensor parameters).
    world: dict[str, Any] = {"times": {}, "collectives_us": {}}
    missing = _without_deepspeed()
    for name in (n for n in DISTRIBUTED if n not in missing):
        one = spawn(world_overhead, 2, w, (name,), rounds, timeout=timeout)[0]
        world["times"].update(one["times"])
        world["collectives_us"].update(one["collectives_us"])
    results.update(world["times"])
    table = Table(
        f"Overhead per backend, {w.name} workload: unison / hand-written loop on the same backend API",
        [
            "strategy",
            "world",
            "hand-written ms/step",
            "unison ms/step",
            f"ratio (target <= {w.target})",
            "per-round ratios",
            "CPU ms/step, hand-written; unison",
            "CPU ratio",
            "per-round CPU ratios",
            "without the stop agreement (ablation)",
            "hand-written loop",
        ],
        f"Median of {rounds} alternated rounds; steady-state step time ({w.steps - w.warmup} steps after "
        f"{w.warmup} warm-up). Per-round ratios show the noise: each round's pair ran back to back. CPU: the CPU "
        "time of a steady step, summed over the world's processes and all their threads (benchmarks/overhead.py): "
        "the work a step asks for, without the time a process waited in a collective (a gloo wait uses no CPU) or "
        "was not scheduled; the variation of the host under a virtual machine still shows in it. It does not show "
        "a wait that one rank's extra work causes on another, the wall clock does. The ablation column: unison "
        "with its per-step stop agreement removed (measurement only, not a mode), over the same hand-written "
        "median (wall clock).",
    )
    if missing:
        table.note += f" Not run: {', '.join(missing)} (DeepSpeed is not installed)."
    summary: dict[str, Any] = {"collectives_us": world["collectives_us"]}
    for name, times in results.items():
        s = summarize(times)
        summary[name] = s
        table.add(
            name,
            1 if name == "single" else 2,
            f"{s['hand_ms']:.2f}",
            f"{s['unison_ms']:.2f}",
            _fmt_ratio(s["ratio"], w.target),
            " ".join(f"{r:.2f}" for r in s["round_ratios"]),
            f"{s['hand_cpu_ms']:.2f}; {s['unison_cpu_ms']:.2f}",
            _fmt_ratio(s["cpu_ratio"], w.target),
            " ".join(f"{r:.3f}" for r in s["cpu_round_ratios"]),
            "" if s["no_agreement_ratio"] is None else f"{s['no_agreement_ratio']:.3f}",
            HAND_DESCRIPTION[name],
        )
    collectives = Table(
        f"Where a distributed unison step spends time around the backend ({w.name} workload, 2 gloo ranks), "
        "us per step",
        ["strategy", "stop agreement", "bare 2-float all-reduce", "loss reduce", "grad norm (+ clip if trainer's)"],
        "Stop agreement: should_stop and stop requests, one all-reduce of 3 floats on the CPU (gloo) control group "
        "at every step boundary (a CPU collective: no device sync), or, where the loss all-reduce spans the world "
        "on the CPU (every strategy here), two more numbers in that one (this column is then the flags' bookkeeping). "
        "Loss reduce: the micro-batch losses summed over "
        "replicas on the device (every rank reports the same loss; the pipeline's last stage adds its losses, the "
        "other stage zeros, in one sum over the world). Grad norm: strategy.clip_grad_norm, the global "
        "pre-clip norm hooks receive. Bare all-reduce: the same collective in a tight loop (its latency alone; "
        "the rest of the stop agreement is waiting for the slower rank). Medians over the steady steps of one run.",
    )
    for name, c in world["collectives_us"].items():
        collectives.add(
            name,
            f"{c['stop_agreement']:.0f}",
            f"{c['bare_all_reduce']:.0f}",
            f"{c['loss_reduce']:.0f}",
            f"{c['grad_norm']:.0f}",
        )
    return [table, collectives], summary


def section_memory(w: Any, timeout: float) -> tuple[Table, dict[str, Any]]:
    from benchmarks.overhead import DISTRIBUTED
    from benchmarks.peak_memory import MEMORY_TARGET, compare, summarize

    missing = _without_deepspeed()
    names = ["single", *(n for n in DISTRIBUTED if n not in missing)]
    variants = {"cold": (False, False), "warm": (True, False), "fixed": (True, True)}
    out = {
        n: {v: summarize(compare(w, n, 1 if n == "single" else 2, timeout, *flags)) for v, flags in variants.items()}
        for n in names
    }
    table = Table(
        f"Peak memory per rank, {w.name} workload: unison / hand-written loop on the same backend API",
        [
            "strategy",
            "world",
            "hand-written peak MiB",
            "unison peak MiB",
            f"ratio (target <= {MEMORY_TARGET})",
            "growth over the reset MiB, hand-written / unison",
            "after a warm-up fit: peak MiB, hand-written / unison",
            "after a warm-up fit: ratio",
            "warm-up fit, mmap threshold fixed: growth MiB, hand-written / unison",
            "warm-up fit, mmap threshold fixed: ratio",
        ],
        "Peak resident set (VmHWM) of the rank where the ratio is largest, reset after the imports and the process "
        f"group (benchmarks/peak_memory.py); each contender in a world of new processes; {w.steps} steps. Growth: "
        "the peak less the resident set at the reset, what training itself added. After a warm-up fit: both "
        "contenders first run a 3-step unison fit of the same strategy, so the modules a fit imports are resident "
        "in both and the ratio compares the memory of training alone. Mmap threshold fixed: the same, with glibc's "
        "mmap threshold fixed at 128 KiB in both, so that freed heap space left resident by the order of "
        "allocations does not count (benchmarks/peak_memory.py says why).",
    )
    if missing:
        table.note += f" Not run: {', '.join(missing)} (DeepSpeed is not installed)."
    for n, both in out.items():
        m, warm, fixed = both["cold"], both["warm"], both["fixed"]
        table.add(
            n,
            1 if n == "single" else 2,
            f"{m['hand_peak']:.0f}",
            f"{m['unison_peak']:.0f}",
            _fmt_ratio(m["ratio"], MEMORY_TARGET),
            f"{m['hand_growth']:.1f} / {m['unison_growth']:.1f}",
            f"{warm['hand_peak']:.0f} / {warm['unison_peak']:.0f}",
            _fmt_ratio(warm["ratio"], MEMORY_TARGET),
            f"{fixed['hand_growth']:.1f} / {fixed['unison_growth']:.1f}",
            _fmt_ratio(fixed["ratio"], MEMORY_TARGET),
        )
    return table, out


def section_peer(w: Any, rounds: int, timeout: float) -> tuple[Table, dict[str, Any]]:
    from benchmarks.peer import world_peer
    from unison.launch.torchrun import spawn

    out = spawn(world_peer, 2, w, rounds, timeout=timeout)[0]
    table = Table(
        f"Peers, {w.name} workload: unison / PyTorch Lightning and unison / Hugging Face Accelerate, ddp and fsdp "
        "(accumulation and clipping, same global batches)",
        [
            "strategy",
            "Lightning ms/step",
            "Accelerate ms/step",
            "unison ms/step",
            "unison / Lightning (target <= 1.0)",
            "unison / Accelerate (target <= 1.0)",
            "per-round ratios (Lightning; Accelerate)",
            "max abs final-weight difference (Lightning; Accelerate)",
            "max abs weight change in training",
        ],
        f"Lightning {_version('lightning')}, Accelerate {_version('accelerate')}, 2 gloo ranks, median of {rounds} "
        "rounds whose order rotates. fsdp: FSDP2 in all three (Lightning's ModelParallelStrategy, Accelerate's "
        f"FSDP2 plugin), every {'/'.join(w.shard_classes)} its own unit.",
    )
    summary: dict[str, Any] = {}
    for strategy, o in out.items():
        t = {who: statistics.median(v) for who, v in o["times"].items() if v}
        ratios = {who: t["unison"] / t[who] for who in ("lightning", "accelerate") if who in t}
        per_round = {
            who: " ".join(f"{a / b:.2f}" for a, b in zip(o["times"]["unison"], o["times"][who]))
            for who in ("lightning", "accelerate")
        }
        diff = o["max_abs_weight_diff"]

        def cell(who: str, text: str, t: dict[str, float] = t) -> str:
            return text if who in t else "n/a"

        table.add(
            strategy,
            cell("lightning", f"{t.get('lightning', 0) * 1e3:.2f}"),
            cell("accelerate", f"{t.get('accelerate', 0) * 1e3:.2f}"),
            f"{t['unison'] * 1e3:.2f}",
            cell("lightning", _fmt_ratio(ratios.get("lightning", 0), 1.0)),
            cell("accelerate", _fmt_ratio(ratios.get("accelerate", 0), 1.0)),
            f"{per_round['lightning'] or 'n/a'}; {per_round['accelerate'] or 'n/a'}",
            "; ".join(f"{diff[who]:.2e}" if who in diff else "n/a" for who in ("lightning", "accelerate")),
            f"{o['max_abs_weight_change']:.2e}",
        )
        summary[strategy] = {**o, **{f"ratio_{who}": r for who, r in ratios.items()}}
    notes = sorted({reason for o in out.values() for reason in o["unavailable"].values()})
    if notes:
        table.note += " n/a: " + "; ".join(notes) + "."
    return table, summary


def section_profile(w: Any, timeout: float) -> tuple[list[Table], dict[str, Any]]:
    from benchmarks.gap_profile import SHOW_ABOVE, world_compare
    from unison.launch.torchrun import spawn

    steps = 40
    results = {
        "single": world_compare(w, "single", steps),
        "pipeline": spawn(world_compare, 2, w, "pipeline", steps, timeout=timeout)[0],
    }
    summary = Table(
        f"Profile, {w.name} workload: unison's excess over the hand-written loop, by owner (% of the loop's step)",
        ["strategy", "rank", "loop us/step (profiled)", "unison us/step (profiled)", "excess by owner"],
        f"benchmarks/gap_profile.py: cProfile self time per steady step ({steps} steps: a run of warm-up + {steps} "
        "steps minus a run of the warm-up alone, for each contender), unison minus the loop, by function. Owner: "
        "unison (this package's code), torch, python (the standard library and built-ins). The profiler slows "
        "Python calls more than kernels: these shares rank the costs, the overhead table measures them.",
    )
    functions = Table(
        f"Profile, {w.name} workload: every function whose excess is above {SHOW_ABOVE:.0%} of the loop's step",
        ["strategy", "rank", "function", "owner", "unison us/step", "loop us/step", "excess (% of the loop's step)"],
    )
    for strategy, out in results.items():
        for r in out["ranks"]:
            summary.add(
                strategy,
                r["rank"],
                f"{r['hand_step_us']:.0f}",
                f"{r['unison_step_us']:.0f}",
                ", ".join(f"{k} {v:+.1%}" for k, v in r["excess_by_owner"].items() if abs(v) >= 0.001),
            )
            for row in r["rows"]:
                functions.add(
                    strategy,
                    r["rank"],
                    f"`{row['function']}`",
                    row["owner"],
                    f"{row['unison_us']:.0f}",
                    f"{row['hand_us']:.0f}",
                    f"{row['excess_share']:+.1%}",
                )
    return [summary, functions], results


def section_framework(w: Any, rounds: int) -> tuple[list[Table], dict[str, Any]]:
    from benchmarks.framework import run

    out = run(w, rounds)
    t1 = Table(
        "Framework time per optimizer step (single, outside backend calls)",
        ["callbacks", "step wall us", "backend + loss_fn us", "data loading us", "framework us"],
        "Backend calls: the strategy's forward, backward, no_sync, reduce_sum, clip_grad_norm, optimizer_step, "
        "zero_grad and the user's loss_fn, timed in place. Data loading: the trainer's DataLoader (a hand-written "
        "loop loads its batches too). Framework = wall - backend - data: the trainer's own work, hooks included.",
    )
    for n, r in out["framework"].items():
        t1.add(n, f"{r['wall_us']:.0f}", f"{r['backend_us']:.0f}", f"{r['data_us']:.0f}", f"{r['framework_us']:.0f}")
    t2 = Table(
        "Hook dispatch per optimizer step",
        ["callbacks", "dispatch us/step", "target"],
        "The five per-step hooks through the plugin manager, each callback implementing all five with an empty "
        "body, plus the default plugins (Throughput).",
    )
    for n, us in out["dispatch"].items():
        t2.add(
            n,
            f"{us:.1f}",
            f"< {DISPATCH_TARGET_US:.0f} us" + (" (met)" if us < DISPATCH_TARGET_US else " (missed)") if n == 5 else "",
        )
    sc = out["sampler"]
    t3 = Table(
        "Sampler: planning one step on a shuffled ImageNet-sized dataset",
        ["samples", "first step of an epoch us", "every other step us", "one randperm us"],
        "The trainer draws each epoch's permutation once and slices it per step (drawing it every step would "
        "cost the randperm column on every step).",
    )
    t3.add(
        f"{sc['dataset_size']:,}", f"{sc['first_step_us']:.0f}", f"{sc['steady_us']:.0f}", f"{sc['randperm_us']:.0f}"
    )
    return [t1, t2, t3], out


def section_worlds(w: Any, rounds: int, timeout: float) -> tuple[list[Table], dict[str, Any]]:
    from benchmarks.memory_scaling import (
        COMPOSED_SCALING,
        MEMORY,
        SCALING,
        ZERO_FORMULA_TEXT,
        memory_formula,
        world_memory_scaling,
    )
    from unison.launch.torchrun import spawn

    results = {n: spawn(world_memory_scaling, n, w, rounds, n > 1, timeout=timeout)[0] for n in (1, 2, 4)}
    scaling = Table(
        "Scaling: step time at world 1, 2, 4 (fixed global batch)",
        ["strategy", *[f"world {n} ms/step" for n in results], *[f"speed-up at {n}" for n in results if n > 1]],
        f"Global batch {w.global_batch}, accumulation {w.accumulate}; median of {rounds} runs. This machine has "
        f"{len(os.sched_getaffinity(0))} cores shared with other work: ranks beyond the core count time-share.",
    )
    for s in SCALING:
        base = results[1]["scaling"][s]["median_ms"]
        scaling.add(
            s,
            *[f"{results[n]['scaling'][s]['median_ms']:.2f}" for n in results],
            *[f"{base / results[n]['scaling'][s]['median_ms']:.2f}x" for n in results if n > 1],
        )
    fsdp4 = results[4]["scaling"]["fsdp"]["median_ms"]
    for s in COMPOSED_SCALING:
        ms = results[4]["scaling"][s]["median_ms"]
        scaling.add(s, "", "", f"{ms:.2f} ({ms / fsdp4:.2f}x fsdp's)", "", "")
    scaling.note += (
        " hsdp (2 replicas x 2 shards), fsdp_tp (2 dp x 2 tp) and pipeline_fsdp (2 replicas x 2 stages) are "
        "timed where their 2x2 mesh exists, at world 4, beside fsdp's step there."
    )
    psi = w.parameters()
    memory = Table(
        f"Memory per rank (fp32, AdamW, Ψ = {psi:,} parameters), bytes: measured / ZeRO formula",
        [
            "strategy",
            "world",
            "parameters",
            "gradients",
            "optimizer state",
            "total / formula",
            "formula",
            "RSS MiB (after setup+3 steps)",
        ],
        "Measured: Strategy.memory_footprint() on rank 0 after the last step. Formula: the ZeRO paper's, fp32 "
        "(4-byte parameters and gradients, K = 8 for Adam's two moments); DeepSpeed keeps a separate fp32 master "
        "partition even for fp32 parameters, so zero1/2/3 are compared with the paper's K = 12. torch_zero "
        "(ZeroRedundancyOptimizer) assigns whole parameters to ranks, so its shards are as even as the largest "
        "parameter allows; ZeRO-3 keeps parameters under its persistence threshold whole on every rank.",
    )
    for n in (2, 4):
        for s in MEMORY:
            m = results[n]["memory"][s]
            fp, fg, fo = memory_formula(s, n, w)
            total = m["parameters"] + m["gradients"] + m["optimizer_state"]
            memory.add(
                s,
                n,
                f"{m['parameters']:,} / {fp:,.0f}",
                f"{m['gradients']:,} / {fg:,.0f}",
                f"{m['optimizer_state']:,} / {fo:,.0f}",
                f"{total / (fp + fg + fo):.3f}",
                ZERO_FORMULA_TEXT[s],
                f"{m['rss_mib']:.0f}",
            )
    return [scaling, memory], results


def _wall_seconds(text: str) -> float | None:
    """Seconds from ``wall_s=S`` (written by --run-conformance) or a shell ``time`` line (``real 1m12.5s``)."""
    m = re.search(r"wall_s=([0-9.]+)", text)
    if m:
        return float(m.group(1))
    m = re.search(r"^real\s+(?:([0-9]+)m)?([0-9.]+)s?$", text, re.M)
    if m:
        return 60 * float(m.group(1) or 0) + float(m.group(2))
    return None


def section_data() -> tuple[list[Table], dict[str, Any]]:
    from benchmarks import data_throughput

    args = data_throughput.parse(["--samples", "8192"])
    results = data_throughput.measure(args)
    data = results["dataset"]
    speed = Table(
        "Sharded data: samples/s from local disk and from S3 on loopback",
        ["order", "loader workers", "local samples/s", "S3 samples/s", "S3 / local", "S3 requests", "first batch s"],
        f"One pass of world 1 over {data['samples']} samples ({data['bytes'] / 1e6:.1f} MB of JSON lines in "
        f"{data['shards']} shards) through the trainer's plan, sampler and DataLoader; samples/s from the first "
        "batch on, the seconds to it (local / S3: worker start, their S3 clients) apart; read-ahead "
        f"{args.read_ahead >> 20} MiB per process. Target: S3 at least {DATA_TARGET} of local disk. Under the "
        "global permutation about every sample is a request of its own, and a request costs 1.2-2 ms of client "
        "CPU in s3fs (about 600 requests/s per process on this machine), while local disk serves a sample in "
        "tens of microseconds: see docs/data.md for the recommended order.",
    )
    for row in results["samples_per_s"]:
        ratio = row["s3"] / row["local"]
        mark = "" if ratio >= DATA_TARGET else f" (below {DATA_TARGET})"
        speed.add(
            row["shuffle"],
            row["workers"],
            f"{row['local']:.0f}",
            f"{row['s3']:.0f}",
            f"{ratio:.2f}{mark}",
            row["requests"],
            f"{row['local first batch s']:.2f} / {row['s3 first batch s']:.2f}",
        )
    amplification = Table(
        "Sharded data: read amplification",
        ["world", "ShardedDataset", "IterableDataset (today's streaming path)"],
        "Bytes the S3 server sent (its own counter) over the dataset's bytes, one pass of every rank, global "
        "permutation, no loader workers. The sharded source reads each rank's samples (coalesced, at most 10 % "
        "read between records); an iterable dataset is read whole by every rank.",
    )
    for row in results["read_amplification"]:
        amplification.add(row["world"], f"{row['sharded']:.3f}", f"{row['iterable']:.3f}")
    return [speed, amplification], results


def section_conformance(log: str | None, run: bool) -> tuple[Table | None, dict[str, Any]]:
    table = Table("Conformance matrix wall time", ["command", "wall time", "source"])
    if run:
        exe = Path(sys.executable).with_name("unison")
        command = [str(exe), "conformance", "--strategy", "all"]
        start = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True)
        wall = time.perf_counter() - start
        path = HERE / "conformance.log"
        path.write_text(
            f"# wall_s={wall:.1f} exit={proc.returncode} command={shlex.join(command[1:])}\n"
            + proc.stdout
            + proc.stderr
        )
        table.add(
            "unison conformance --strategy all",
            f"{wall:.0f} s (exit {proc.returncode})",
            f"measured in this run; output in {path.relative_to(HERE.parent)}",
        )
        return table, {"wall_s": wall}
    if log:
        text = Path(log).read_text()
        wall = _wall_seconds(text)
        if wall is None:
            raise SystemExit(f"--conformance-log {log}: no 'wall_s=SECONDS' line nor a shell `time` 'real' line")
        found = re.search(r"command=(.*)", text)
        command = found.group(1) if found else "conformance --strategy all"
        table.add(f"unison {command}", f"{wall:.0f} s", f"read from {log}")
        return table, {"wall_s": wall}
    return None, {}


# --------------------------------------------------------------------------- #
# main
# --------------------------------------------------------------------------- #


def _sections(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The sections ``--only`` names (conformance added when its log or run is asked for)."""
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s) {sorted(unknown)}; pick from {', '.join(SECTIONS)}")
    if (args.conformance_log or args.run_conformance) and "conformance" not in sections:
        sections.append("conformance")
    return sections


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS[:-1]),
        help=f"comma-separated sections out of {', '.join(SECTIONS)} (default: all but conformance)",
    )
    parser.add_argument(
        "--workload",
        default="mlp,lm",
        help="comma-separated workloads for the overhead, peer, profile and memory sections: mlp (ms steps), lm "
        "(100-300 ms steps)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds per comparison (>= 5 for RESULTS)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per timed run (mlp 25, lm 12)")
    parser.add_argument("--warmup", type=int, default=None, help="steps excluded from the steady state (5, 3)")
    parser.add_argument("--conformance-log", default=None, help="file with the conformance run's wall time")
    parser.add_argument("--run-conformance", action="store_true", help="time `unison conformance --strategy all`")
    parser.add_argument("--output", default=str(HERE / "RESULTS.md"), help="Markdown results ('-' for none)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one world may take")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from rich.console import Console

    from benchmarks.workload import WORKLOADS

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    sections = _sections(parser, args)
    names = [n.strip() for n in args.workload.split(",") if n.strip()]
    if not names or set(names) - set(WORKLOADS):
        parser.error(f"--workload: pick from {', '.join(WORKLOADS)}")
    sizing = {k: v for k, v in (("steps", args.steps), ("warmup", args.warmup)) if v is not None}
    workloads = {n: WORKLOADS[n](**sizing) for n in names}
    w = next(iter(workloads.values()))
    console = Console()
    host = machine()
    started = time.perf_counter()
    tables: list[Table] = []
    timings: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        console.print(f"[bold]running {name}[/bold] ...")
        t = time.perf_counter()
        out = fn()
        timings[name] = time.perf_counter() - t
        return out

    per_workload = {
        "overhead": lambda wl: section_overhead(wl, args.rounds, args.timeout)[0],
        "peer": lambda wl: [section_peer(wl, args.rounds, args.timeout)[0]],
        "profile": lambda wl: section_profile(wl, args.timeout)[0],
        "memory": lambda wl: [section_memory(wl, args.timeout)[0]],
    }
    for name, wl in workloads.items():
        for section, run in per_workload.items():
            if section in sections:
                tables += timed(f"{section} {name}", lambda run=run, wl=wl: run(wl))
    if "framework" in sections:
        tables += timed("framework", lambda: section_framework(w, args.rounds))[0]
    if "worlds" in sections:
        tables += timed("worlds", lambda: section_worlds(w, max(3, args.rounds // 2 + 1), args.timeout))[0]
    if "data" in sections:
        tables += timed("data", section_data)[0]
    if "conformance" in sections:
        table, _ = timed("conformance", lambda: section_conformance(args.conformance_log, args.run_conformance))
        if table is not None:
            tables.append(table)
    if not any(t.title.startswith("Conformance") for t in tables):
        note = Table("Conformance matrix wall time", ["command", "wall time", "source"])
        note.add(
            "unison conformance --strategy all",
            "not measured in this run",
            "pass --conformance-log FILE (a log with wall_s=S or a shell `time` line) or --run-conformance",
        )
        tables.append(note)
    wall = time.perf_counter() - started
    host["load average at end (1, 5, 15 min)"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    for table in tables:
        console.print(table.rich())
    console.print(f"total wall time {wall:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in timings.items())})")
    if args.output != "-":
        command = "OMP_NUM_THREADS=1 python -m benchmarks" + (
            "" if argv is None and len(sys.argv) == 1 else " " + shlex.join(sys.argv[1:] if argv is None else argv)
        )
        write_results(Path(args.output), tables, host, workloads, command, wall, timings)
        console.print(f"wrote {args.output}")


def write_results(
    path: Path,
    tables: list[Table],
    host: dict[str, str],
    workloads: dict[str, Any],
    command: str,
    wall: float,
    timings: dict[str, float],
) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Benchmark results",
        "",
        f"Written by `python -m benchmarks` on {now}. Reproduce from the repository root with:",
        "",
        "```",
        f"{command}",
        "```",
        "",
        f"Total wall time: {wall:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in timings.items())}).",
        "",
        "## Machine",
        "",
        *[f"- {k}: {v}" for k, v in host.items()],
        "",
        "## Packages",
        "",
        *[f"- {p} {_version(p)}" for p in PACKAGES],
        "",
        "## Workloads",
        "",
        *[
            f"- `{name}`: {w.describe()}; AdamW lr {w.lr}, clipping at {w.clip} (global norm), {w.steps} steps per "
            f"timed run of which {w.warmup} warm-up, fp32, gloo on CPU, `progress='off'`, nothing logged in the "
            "timed window."
            for name, w in workloads.items()
        ],
        "",
        "## Results",
        "",
        *[t.markdown() for t in tables],
    ]
    analysis = HERE / "ANALYSIS.md"
    if analysis.exists():
        lines += ["## Analysis", "", analysis.read_text().strip(), ""]
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
