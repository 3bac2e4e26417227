"""The work a steady step asks for, unison against the hand-written loop: instructions and system calls.

``python -m benchmarks.step_work`` writes benchmarks/STEP_WORK.md.

Why: the timed benchmarks measure what users feel, but on a shared virtual
machine a fit's wall clock and CPU time move by 10-30% with the host's load,
more than the few percent the targets are about, and the guest exposes no
hardware counters. Two measures here that load moves little or not at all:

**Instructions** (valgrind's callgrind): load does not move them; two runs of
the same loop in fresh processes counted 40.78 and 40.49 million instructions
per `single` mlp step (0.7% apart: the address-space layout and the
allocator's state differ from one process to the next), where the wall clock
of two fits differs by 10-30% here. Each contender trains the
workload in a fresh world of processes (every rank under ``valgrind
--tool=callgrind --separate-threads=yes``, the hash seed fixed), once for
``warmup`` steps and once for ``warmup + n``. The difference over ``n`` is the
instructions of one steady step: imports, setup, warm-up and the end of the fit
cancel out. Counts are kept per thread:

* **main**: the training thread (the loop's Python, forward, backward, the
  optimizer, and each collective's call and wait);
* **collectives**: the threads of gloo and the process group, which run the
  collectives (the all-reduce's sums);
* **timers**: threads that wake on a clock rather than per step (unison's
  watchdog and heartbeat, the TCPStore daemon that serves them, other Python
  threads). Valgrind slows a step about 50 times, so a timer thread's count per
  step is that many times what it is in a normal run: reported apart and left
  out of the ratio.

An instruction count measures work, not time (a Python bytecode and a vectorised
kernel instruction do not cost the same), and it counts user space only.
Valgrind runs the AVX2 paths of the math libraries (it does not emulate
AVX-512), so kernels count more instructions than natively; both contenders run
the same kernels.

**System work** (``getrusage``, without valgrind): per steady step and rank,
the user and system CPU time and the voluntary and involuntary context
switches, each the median of alternated rounds of a ``warmup`` run and a
``warmup + n`` run (the difference over ``n``). A small gloo collective costs
more in thread hand-offs (a voluntary context switch each time a thread sleeps
on a wait) and system calls than in its sums, which the instruction count
does not see; the context-switch counts move little with load. A third
contender, unison without its stop agreement (the ablation of
:func:`benchmarks.overhead.without_stop_agreement`), shows what that agreement
costs where it runs a collective of its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from unison.launch.torchrun import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STRATEGIES = ("single", "ddp", "fsdp", "zero2", "zero3", "pipeline")
#: Thread kinds, from a function each kind's threads run (found in callgrind's function names).
COLLECTIVE_MARKS = ("ProcessGroupGloo::runLoop", "gloo::transport::tcp::Loop::run")
#: Functions of rank 0's main thread listed per strategy: the largest differences, unison - loop.
TOP_FUNCTIONS = 8
#: Steady steps of the getrusage measure (no valgrind: a longer difference is cheap and steadier).
SYSTEM_STEPS = 40


def _thread_count(path: Path) -> tuple[int, str]:
    """The instructions one callgrind thread file counted, and its kind (main, collectives or timers)."""
    text = path.read_text(errors="replace")
    found = re.search(r"^(?:totals|summary):\s+(\d+)", text, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"{path}: no totals line (did valgrind finish?)")
    if re.search(r"^thread:\s*1\s*$", text, re.MULTILINE):
        kind = "main"
    elif any(mark in text for mark in COLLECTIVE_MARKS):
        kind = "collectives"
    else:
        kind = "timers"
    return int(found.group(1)), kind


def _functions(path: Path) -> dict[str, int]:
    """Instructions by function (self cost) in one callgrind thread file, from ``callgrind_annotate``."""
    text = subprocess.run(
        ["callgrind_annotate", "--threshold=100", str(path)], capture_output=True, text=True, check=True
    ).stdout
    out: dict[str, int] = {}
    for line in text.splitlines():
        found = re.match(r"\s*([\d,]+) \([^)]*\)\s+(.*)$", line)
        if found is None or "PROGRAM TOTALS" in line:
            continue
        name = re.sub(r"'\d+$", "", found.group(2).split(" [")[0])
        name = re.sub(r"^\S*/Python-[\d.]+/", "", name)  # the interpreter's build directory
        out[name] = out.get(name, 0) + int(found.group(1).replace(",", ""))
    return out


def count_world(
    who: str, strategy: str, workload: str, steps: int, world: int, timeout: float
) -> tuple[list[dict[str, int]], dict[str, int]]:
    """Instructions by thread kind, per rank, for one run of ``steps`` optimizer steps under callgrind; and
    rank 0's main thread by function."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise RuntimeError("valgrind is not installed (apt-get install valgrind)")
    out = Path(tempfile.mkdtemp(prefix="unison-callgrind-"))
    env = {
        **os.environ,
        "PYTHONHASHSEED": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "UNISON_RUNS_ROOT": str(out / "runs"),
    }
    procs = []
    try:
        for rank in range(world):
            tool = [valgrind, "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}/cg.r{rank}"]
            cmd = [*tool, sys.executable, "-m", "benchmarks.step_work", "--child", who, strategy, workload, str(steps)]
            log = open(out / f"log.r{rank}", "w")  # noqa: SIM115  # closed with the process below
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            procs.append((subprocess.Popen(cmd, env=rank_env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log))
        deadline = time.monotonic() + timeout
        for proc, log in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            log.close()
        failed = [rank for rank, (proc, _) in enumerate(procs) if proc.returncode != 0]
        if failed:
            tail = (out / f"log.r{failed[0]}").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{who} {strategy} ({steps} steps): rank {failed[0]} failed under valgrind:\n{tail}")
        ranks = []
        for rank in range(world):
            kinds = {"main": 0, "collectives": 0, "timers": 0}
            for path in sorted(out.glob(f"cg.r{rank}-*")):
                count, kind = _thread_count(path)
                kinds[kind] += count
            ranks.append(kinds)
        return ranks, _functions(out / "cg.r0-01")
    finally:
        for proc, log in procs:  # kill a world that failed or ran past its time
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
        shutil.rmtree(out, ignore_errors=True)


def per_step(who: str, strategy: str, workload: Any, n: int, timeout: float) -> tuple[list[dict[str, float]], dict]:
    """Instructions of one steady step by thread kind, per rank: (warmup + n) steps less warmup steps, over n;
    and rank 0's main thread by function, likewise."""
    world = 1 if strategy == "single" else 2
    short, short_fns = count_world(who, strategy, workload.name, workload.warmup, world, timeout)
    long, long_fns = count_world(who, strategy, workload.name, workload.warmup + n, world, timeout)
    functions = {k: (long_fns.get(k, 0) - short_fns.get(k, 0)) / n for k in set(short_fns) | set(long_fns)}
    return [{k: (b[k] - a[k]) / n for k in a} for a, b in zip(short, long)], functions


def measure(strategies: list[str], workload: Any, n: int, timeout: float) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for strategy in strategies:
        started = time.perf_counter()
        hand, hand_fns = per_step("hand", strategy, workload, n, timeout)
        unison, unison_fns = per_step("unison", strategy, workload, n, timeout)
        excess = {k: unison_fns.get(k, 0.0) - hand_fns.get(k, 0.0) for k in set(hand_fns) | set(unison_fns)}
        top = sorted(excess.items(), key=lambda kv: -abs(kv[1]))[:TOP_FUNCTIONS]
        results[strategy] = {
            "hand": hand,
            "unison": unison,
            "functions": [{"function": k, "excess": v} for k, v in top],
            "seconds": time.perf_counter() - started,
        }
        print(f"{strategy}: {json.dumps(results[strategy])}", flush=True)
    return results


def system_work(strategy: str, workload: Any, n: int, rounds: int) -> dict[str, list[dict[str, float]]]:
    """In every rank of a world (or the one process of ``single``): ``getrusage`` per steady step for each
    contender, the median of ``rounds`` alternated rounds; returned per contender (rank 0's, then rank 1's)."""
    import resource
    import statistics

    import torch.distributed as dist

    from benchmarks.overhead import without_stop_agreement
    from benchmarks.workload import HAND_LOOPS, run_unison

    def usage() -> tuple[float, ...]:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return (r.ru_utime, r.ru_stime, float(r.ru_nvcsw), float(r.ru_nivcsw))

    def train(who: str, w: Any) -> None:
        if who == "hand":
            HAND_LOOPS[strategy](w)
        elif who == "unison":
            run_unison(w, strategy)
        else:
            with without_stop_agreement():
                run_unison(w, strategy)

    contenders = ["hand", "unison"] + (["no_agreement"] if dist.is_initialized() else [])
    rows: dict[str, list[list[float]]] = {who: [] for who in contenders}
    for r in range(-1, rounds):  # round -1 is not recorded: the process's one-time costs
        for who in contenders if r % 2 == 0 else contenders[::-1]:
            runs = []
            for steps in (workload.warmup, workload.warmup + n):
                if dist.is_initialized():
                    dist.barrier()
                before = usage()
                train(who, dataclasses.replace(workload, steps=steps))
                runs.append([b - a for a, b in zip(before, usage())])
            if r >= 0:
                rows[who].append([(long - short) / n for short, long in zip(*runs)])
    keys = ("user_us", "system_us", "voluntary_switches", "involuntary_switches")
    scale = (1e6, 1e6, 1.0, 1.0)
    mine = {
        who: {k: statistics.median(col) * f for k, f, col in zip(keys, scale, zip(*cols))} for who, cols in rows.items()
    }
    if not dist.is_initialized():
        return {who: [v] for who, v in mine.items()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {who: [rank[who] for rank in everyone] for who in contenders}


def measure_system(strategies: list[str], workload: Any, n: int, rounds: int, timeout: float) -> dict[str, Any]:
    from unison.launch.torchrun import spawn

    out = {}
    for strategy in strategies:
        if strategy == "single":
            out[strategy] = system_work(strategy, workload, n, rounds)
        else:
            out[strategy] = spawn(system_work, 2, strategy, workload, n, rounds, timeout=timeout)[0]
        print(f"{strategy}: {json.dumps(out[strategy])}", flush=True)
    return out


def markdown(
    results: dict[str, Any], system: dict[str, Any], workload: Any, n: int, rounds: int, command: str, wall: float
) -> str:
    lines = [
        "# The work of a steady step: unison against the hand-written loop",
        "",
        f"Written by `{command}` ({wall:.0f} s). benchmarks/step_work.py says how and why. Workload "
        f"`{workload.name}`: {workload.describe()}; the hand-written loops of benchmarks/workload.py; 2 gloo "
        "ranks except `single`.",
        "",
    ]
    if results:
        lines += [
            "## Instructions per optimizer step (callgrind)",
            "",
            f"Each contender in fresh processes under valgrind's callgrind, {workload.warmup} and "
            f"{workload.warmup + n} steps, the difference over {n}. Main: the training thread. Collectives: gloo's "
            "and the process group's threads. Timers: threads that wake on a clock (unison's watchdog and "
            "heartbeat, the TCPStore daemon), whose count per step valgrind's slowdown inflates about 50 times: "
            "shown, not in the ratio. Ratio: unison's main + collectives over the loop's. Millions of instructions.",
            "",
            "| strategy | rank | hand-written: main; collectives; timers | unison: main; collectives; timers | "
            "main thread: unison - loop | ratio (main + collectives) |",
            "|---|---|---|---|---|---|",
        ]
        for strategy, r in results.items():
            for rank, (h, u) in enumerate(zip(r["hand"], r["unison"])):
                counted_h, counted_u = h["main"] + h["collectives"], u["main"] + u["collectives"]
                lines.append(
                    f"| {strategy} | {rank} "
                    f"| {h['main'] / 1e6:.2f}; {h['collectives'] / 1e6:.2f}; {h['timers'] / 1e6:.2f} "
                    f"| {u['main'] / 1e6:.2f}; {u['collectives'] / 1e6:.2f}; {u['timers'] / 1e6:.2f} "
                    f"| {(u['main'] - h['main']) / 1e6:+.3f} | {counted_u / counted_h:.4f} |"
                )
        lines += [
            "",
            f"### Rank 0's main thread: the {TOP_FUNCTIONS} largest differences by function",
            "",
            "Self instructions per step, unison minus the loop, by C function (callgrind sees the interpreter, "
            "not the Python functions it runs: `_PyEval_EvalFrameDefault` is Python bytecode; "
            "`all_type_info_get_cache` and `allocate_layout` are pybind11 making the objects a Python-level "
            "collective returns).",
            "",
            "| strategy | function | unison - loop, thousands |",
            "|---|---|---|",
        ]
        for strategy, r in results.items():
            for row in r["functions"]:
                name = row["function"].replace("|", "\\|")
                lines.append(f"| {strategy} | `{name[:110]}` | {row['excess'] / 1e3:+.1f} |")
        lines.append("")
    if system:
        lines += [
            "## System work per optimizer step (getrusage)",
            "",
            f"Per rank: median of {rounds} alternated rounds (after one unrecorded round) of a {workload.warmup}-step "
            f"and a {workload.warmup + SYSTEM_STEPS}-step run, the difference over {SYSTEM_STEPS}. User and system CPU "
            "microseconds; "
            "voluntary context switches (a thread sleeping on a wait: a collective's hand-offs) and involuntary "
            "ones. Without the stop agreement: unison with the ablation of benchmarks/overhead.py (not a mode).",
            "",
            "| strategy | rank | contender | user us | system us | voluntary switches | involuntary switches |",
            "|---|---|---|---|---|---|---|",
        ]
        names = {"hand": "hand-written", "unison": "unison", "no_agreement": "unison without the stop agreement"}
        for strategy, by_who in system.items():
            for who, ranks in by_who.items():
                for rank, v in enumerate(ranks):
                    lines.append(
                        f"| {strategy} | {rank} | {names[who]} | {v['user_us']:.0f} | {v['system_us']:.0f} "
                        f"| {v['voluntary_switches']:.1f} | {v['involuntary_switches']:.1f} |"
                    )
        lines.append("")
    return "\n".join(lines)


def _child(who: str, strategy: str, workload: str, steps: int) -> None:
    """One rank of a counted run (under valgrind): train ``steps`` steps, nothing else."""
    import torch
    import torch.distributed as dist

    from benchmarks.workload import HAND_LOOPS, WORKLOADS, run_unison

    torch.set_num_threads(1)
    w = dataclasses.replace(WORKLOADS[workload](), steps=steps, warmup=1)
    if who == "unison":
        run_unison(w, strategy)
        return
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    HAND_LOOPS[strategy](w)
    if distributed:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--child"]:
        _child(args[1], args[2], args[3], int(args[4]))
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from benchmarks.workload import WORKLOADS

    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_work", description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated, from the overhead table")
    parser.add_argument("--workload", default="mlp", choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int, default=10, help="steady steps counted (the difference of two runs)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds of the getrusage measure")
    parser.add_argument(
        "--only", default="instructions,system", help="comma-separated: instructions (callgrind), system (getrusage)"
    )
    parser.add_argument("--output", default=str(HERE / "STEP_WORK.md"), help="Markdown results ('-' for none)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one world may take")
    parsed = parser.parse_args(args)
    strategies = [s.strip() for s in parsed.strategies.split(",") if s.strip()]
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        parser.error(f"--strategies: unknown {sorted(unknown)}; pick from {', '.join(STRATEGIES)}")
    parts = {p.strip() for p in parsed.only.split(",") if p.strip()}
    if not parts or parts - {"instructions", "system"}:
        parser.error("--only: pick from instructions, system")
    if "instructions" in parts and shutil.which("valgrind") is None:
        parser.error("--only instructions needs valgrind: apt-get install valgrind (or pass --only system)")
    workload = WORKLOADS[parsed.workload](warmup=3)
    started = time.perf_counter()
    system = (
        measure_system(strategies, workload, SYSTEM_STEPS, parsed.rounds, parsed.timeout) if "system" in parts else {}
    )
    results = measure(strategies, workload, parsed.steps, parsed.timeout) if "instructions" in parts else {}
    wall = time.perf_counter() - started
    command = "python -m benchmarks.step_work" + (" " + " ".join(args) if args else "")
    text = markdown(results, system, workload, parsed.steps, parsed.rounds, command, wall)
    print(text)
    if parsed.output != "-":
        Path(parsed.output).write_text(text)


if __name__ == "__main__":
    main()
