"""The suite's record of the collectives of one fit: the training loop's marks around the strategy's calls
(:mod:`unison.training.marks`: ``no_sync``, each micro-step's ``backward``, ``clip_grad_norm``, an engine's
boundary answers), the profiler's records of the ``c10d`` dispatcher operations, and their analysis into
the trace's ``collectives`` entry. Nothing of the strategy is wrapped: the suite observes the same calls a
user's profile shows.

The ``collectives`` of a trace are the calls made on the real process group, counted from the ``c10d::*``
dispatcher operations recorded by ``torch.profiler``. Why the profiler
and not wrapped ``torch.distributed`` functions: DDP's reducer (and other
C++ engines) call the ProcessGroup from C++ and never pass through the
Python functions; every collective, from Python or C++, goes through the
``c10d`` dispatcher ops. Counted per kind for the whole fit, per optimizer
step inside the forward/backward window (``unison_on_train_step_start`` to
``unison_on_after_backward``), and inside the strategy's ``no_sync()``.
Per micro-step too (``gradient_sync_per_micro_step``): each micro-step's
window runs from the end of the previous micro-step's ``backward`` (or the
step's start) to the end of its own, so the suite can check the declared
:class:`~unison.contract.ownership.GradSync` (boundary only, or every micro-step).
A ``c10d`` call made inside one of DTensor's functional collectives
(``_c10d_functional::*``, e.g. tensor parallel's all-reduce of a row-wise
layer's output, or of a column-wise layer's input gradient) is counted
apart, as ``functional:<kind>``, and is not a gradient sync: those run in
every forward and backward by design and reduce activations, not the
parameter gradients ``no_sync()`` defers (FSDP2, DDP and the engines
synchronise gradients through ``c10d`` directly). A strategy that
synchronised parameter gradients through DTensor redistribution would
escape this count; its numbers are still compared.
``reductions_in_clip`` counts the reductions called inside the strategy's
``clip_grad_norm``. Where :func:`records_payloads` says so (the
mixed-precision scenarios and ``plain``), ``record_shapes`` is on and each
collective's payload (dtype, elements) is read from the backend's own
record (``gloo:all_reduce``): ``reduction_dtypes`` counts the dtypes of
reductions of more than one element inside the forward/backward windows
(gradients, not a loss or a norm). The process group of each call comes from torch's flight
recorder (:func:`enable_flight_recorder`, :func:`flight_entries`: its entries carry the group, on the
profiler's clock), read where :func:`records_groups` says so; ``gradient_groups`` counts the groups of
those reductions.

The records are read from the profiler's raw (Kineto) results (:func:`records`), not from its
``FunctionEvent`` tree, which costs about 0.4 s per run and rank to build.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import math
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from unison.conformance.snapshots import PAYLOAD_PREFIXES, payload
from unison.training import marks

STEP_MARK = "unison.conformance::forward_backward"

#: The training loop's marks at the strategy's sync points (:mod:`unison.training.marks`): the suite reads
#: them from the profile; nothing of the strategy is wrapped.
NO_SYNC_MARK = marks.NO_SYNC
MICRO_MARK = marks.BACKWARD
CLIP_MARK = marks.CLIP_GRAD_NORM
BOUNDARY_MARKS = {marks.BOUNDARY_TRUE: True, marks.BOUNDARY_FALSE: False}


#: The namespace of DTensor's functional collectives (``torch.distributed._functional_collectives``).
FUNCTIONAL_PREFIX = "_c10d_functional::"


#: ``c10d`` dispatcher op -> collective kind.
COLLECTIVE_KINDS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "broadcast_": "broadcast",
    "reduce_": "reduce",
    "gather_": "gather",
    "scatter_": "scatter",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "barrier": "barrier",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
}


#: The kinds that synchronise gradients (what ``no_sync`` must suppress):
#: all-reduce (DDP), reduce-scatter (FSDP, ZeRO-2/3) and reduce to the
#: owning rank (fairscale ShardedDataParallel).
GRADIENT_SYNC_KINDS = ("all_reduce", "reduce_scatter", "reduce")


@dataclasses.dataclass(frozen=True)
class Record:
    """One profiler record as :func:`analyse_collectives` reads it: name, start and end (ns), thread,
    the payload's shapes and dtypes (empty without ``record_shapes``), and whether it is an op's second
    record under a Python dispatch mode.

    An op called under a ``TorchDispatchMode`` (the ``Throughput`` callback's FLOP counter on a fit's
    second step, a user's own mode) is recorded twice by the profiler: the call, and inside it (under
    ``PythonDispatchMode``) the mode's call of the same op. One collective ran; the inner record is
    ``redispatched``.
    """

    name: str
    start: float
    end: float
    thread: int = 0
    shapes: tuple[Any, ...] = ()
    dtypes: tuple[str, ...] = ()
    redispatched: bool = False
    #: The process group the collective ran on and its elements, from the flight recorder entry created
    #: inside this ``c10d`` call (:func:`flight_entries`); ``""`` and ``0`` where none was found.
    group: str = ""
    numel: int = 0


def _wanted(name: str) -> bool:
    return (
        name in (STEP_MARK, NO_SYNC_MARK, CLIP_MARK, MICRO_MARK)
        or name in BOUNDARY_MARKS
        or name.startswith(("c10d::", FUNCTIONAL_PREFIX))
        or (name.startswith(PAYLOAD_PREFIXES) and "reduce" in name)
    )


def records(prof: Any, flight: list[FlightEntry] | None = None) -> list[Record]:
    """The records :func:`analyse_collectives` reads, straight from the profiler's raw (Kineto) results.

    ``prof.events()`` builds a ``FunctionEvent`` tree of every op in Python: about 0.4 s per run and rank
    here, a third of a conformance run's time on these tiny models. The marks and collectives are a few
    hundred of the ten thousand records; nesting (a re-dispatched ``c10d`` call inside one of the same
    name on its thread) is read from their time spans. With ``flight`` (:func:`flight_entries`), each
    ``c10d`` call carries the group and elements of the flight recorder entry created inside its span.
    """
    kept = []
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if _wanted(name):
            shapes = tuple(e.shapes()) if name.startswith(PAYLOAD_PREFIXES) else ()
            dtypes = tuple(e.dtypes()) if shapes else ()
            kept.append(Record(name, e.start_ns(), e.end_ns(), e.start_thread_id(), shapes, dtypes))
    calls = [r for r in kept if r.name.startswith("c10d::")]
    out = []
    for r in kept:
        # An op's second record lies inside its first (same name, same thread, a wider span).
        if r.name.startswith("c10d::") and any(
            o.name == r.name
            and o.thread == r.thread
            and o.start <= r.start
            and r.end <= o.end
            and (o.start, o.end) != (r.start, r.end)
            for o in calls
        ):
            r = dataclasses.replace(r, redispatched=True)
        out.append(r)
    return _with_groups(out, flight or [])


#: Entries the flight recorder keeps (a ring of the process's latest collectives): more than one fit of the
#: suite's tiny models makes, and few enough to read cheaply (a dump and its parse take about 48 ms at 1000
#: entries, 195 ms at 5000, read at the end of each run that records groups).
FLIGHT_RECORDER_ENTRIES = 1_000


def enable_flight_recorder() -> None:
    """Keep torch's flight recorder on in this process (read when the first process group starts).

    The profiler's records of a collective carry no process group (gloo records none; the ``c10d`` op's
    group argument is not recorded); the flight recorder's entries do, with the payload's sizes and
    dtypes and the time each work was created, on the profiler's clock. A user's own setting wins.
    """
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))


@dataclasses.dataclass(frozen=True)
class FlightEntry:
    """One collective as torch's flight recorder kept it: created at ``created`` (ns), on group ``group``, with
    ``numel`` input elements."""

    created: int
    group: str
    numel: int


def flight_entries() -> list[FlightEntry]:
    """This process's flight recorder entries (empty when the recorder is off or unavailable)."""
    import json

    from unison._upstream.torch import flight_recorder_json

    try:
        text = flight_recorder_json()
        entries = (json.loads(text).get("entries") or []) if text else []
    except (RuntimeError, ValueError):
        return []
    out = []
    for e in entries:
        sizes = e.get("input_sizes") or []
        numel = sum(math.prod(size) for size in sizes)
        out.append(FlightEntry(int(e["time_created_ns"]), str(e["process_group"][0]), numel))
    return out


def _with_groups(kept: list[Record], entries: list[FlightEntry]) -> list[Record]:
    """Each ``c10d`` call with the group and elements of the flight recorder entry created inside its span
    (the first one not yet taken: an op that issues a coalesced call is one entry)."""
    if not entries:
        return kept
    entries = sorted(entries, key=lambda e: e.created)
    times = [e.created for e in entries]
    taken: set[int] = set()
    out = []
    for r in kept:
        if r.name.startswith("c10d::") and not r.redispatched:
            i = bisect.bisect_left(times, r.start)
            while i < len(entries) and times[i] <= r.end:
                if i not in taken:
                    taken.add(i)
                    r = dataclasses.replace(r, group=entries[i].group, numel=entries[i].numel)
                    break
                i += 1
        out.append(r)
    return out


def process_groups() -> dict[str, list[int]]:
    """The live process groups of this process: their flight-recorder name -> global ranks."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return {}
    from unison._upstream.torch import process_group_names

    out = {}
    for group, name in process_group_names().items():
        try:
            out[name] = sorted(int(r) for r in dist.get_process_group_ranks(group))
        except (RuntimeError, ValueError, KeyError):
            continue
    return out


def analyse_collectives(events: Any) -> dict[str, Any]:
    """Count the collectives of one fit from its profiler :class:`Record` s (:func:`records`)."""
    windows: list[tuple[float, float]] = []
    no_sync: list[tuple[float, float]] = []
    clips: list[tuple[float, float]] = []
    backward_ends: list[float] = []
    calls: list[tuple[float, str]] = []
    functional: list[tuple[float, float]] = []
    #: Reductions of more than one element (gradients, not a loss or a norm): (start, dtype).
    reductions: list[tuple[float, str]] = []
    #: Calls of more than one element whose group the flight recorder named: (start, kind, group name).
    grouped: list[tuple[float, str, str]] = []
    for e in events:
        name = e.name
        if name.startswith(FUNCTIONAL_PREFIX) and not name.endswith("wait_tensor"):
            functional.append((e.start, e.end))
        if name == STEP_MARK:
            windows.append((e.start, e.end))
        elif name == NO_SYNC_MARK:
            no_sync.append((e.start, e.end))
        elif name == CLIP_MARK:
            clips.append((e.start, e.end))
        elif name == MICRO_MARK:
            backward_ends.append(e.end)
        elif name.startswith("c10d::") and not e.redispatched:
            op = name[len("c10d::") :]
            kind = COLLECTIVE_KINDS.get(op, f"other:{op}")
            calls.append((e.start, kind))
            if e.group and e.numel > 1:
                grouped.append((e.start, kind, e.group))
        elif name.startswith(PAYLOAD_PREFIXES) and "reduce" in name:
            found = payload(e)
            if found is not None and found[1] > 1:
                reductions.append((e.start, found[0]))
    windows.sort()

    def inside(t: float, spans: list[tuple[float, float]]) -> bool:
        return any(a <= t <= b for a, b in spans)

    # Activation collectives of DTensor (tensor parallel): counted apart, never a gradient sync.
    calls = [(t, f"functional:{kind}" if inside(t, functional) else kind) for t, kind in calls]
    total = Counter(kind for _, kind in calls)

    def grad_syncs(a: float, b: float, *, open_start: bool = False) -> int:
        return sum(
            1 for t, kind in calls if kind in GRADIENT_SYNC_KINDS and (a < t if open_start else a <= t) and t <= b
        )

    per_step = []
    per_micro_step = []
    backward_ends.sort()
    for a, b in windows:
        kinds = Counter(kind for t, kind in calls if a <= t <= b)
        per_step.append(dict(kinds))
        # Micro-step i: from the end of backward i-1 (or the step's start) to the end of backward i.
        ends = [e for e in backward_ends if a <= e <= b]
        micro, start = [], a
        for i, end in enumerate(ends):
            micro.append(grad_syncs(start, end, open_start=i > 0))
            start = end
        per_micro_step.append(micro)
    # Gradient reductions only: DTensor's activation collectives (inside a functional op) are not.
    groups = Counter(
        group
        for t, kind, group in grouped
        if kind in GRADIENT_SYNC_KINDS and not inside(t, functional) and inside(t, windows)
    )
    grad_in_no_sync = sum(1 for t, kind in calls if kind in GRADIENT_SYNC_KINDS and inside(t, no_sync))
    return {
        # The dtypes that reductions of more than one element carried in the forward/backward windows.
        "reduction_dtypes": dict(Counter(dtype for t, dtype in reductions if inside(t, windows))),
        # The process groups (flight recorder names) of the gradient reductions in those windows.
        "gradient_groups": dict(groups),
        # Reductions (all-reduce, reduce-scatter, reduce) called inside the strategy's clip_grad_norm.
        "reductions_in_clip": sum(1 for t, kind in calls if kind in GRADIENT_SYNC_KINDS and inside(t, clips)),
        "total": dict(total),
        "per_step": per_step,
        "gradient_sync_per_step": [sum(s.get(k, 0) for k in GRADIENT_SYNC_KINDS) for s in per_step],
        "gradient_sync_per_micro_step": per_micro_step,
        "gradient_sync_in_no_sync": grad_in_no_sync,
        "no_sync_entries": len(no_sync),
    }


def records_payloads(scenario: Any) -> bool:
    """Whether a run of ``scenario`` records each collective's payload (``record_shapes``, about a third more
    time per run): in every mixed-precision scenario, where the reduction dtype is checked, and in ``plain``,
    which shows it for fp32."""
    return scenario.precision != "32-true" or scenario.name == "plain"


def records_groups(scenario: Any) -> bool:
    """Whether a run of ``scenario`` reads each collective's process group from the flight recorder (a dump
    per run and rank, see :data:`FLIGHT_RECORDER_ENTRIES`): where payloads are recorded, and in
    ``accumulation``. A reduction over a subgroup shows in every scenario; these see it."""
    return records_payloads(scenario) or scenario.name == "accumulation"


@contextlib.contextmanager
def profile_collectives(enabled: bool, *, shapes: bool = False) -> Iterator[list[Any]]:
    out: list[Any] = []
    if not enabled:
        yield out
        return
    from torch.profiler import ProfilerActivity, profile

    # Kineto prints two "USDT ... profiler_start/stop" lines per profiled run
    # on stderr; a suite profiles every run on every rank. Read when the
    # profiler starts, so setting it here is enough; a user's setting wins.
    os.environ.setdefault("KINETO_LOG_LEVEL", "99")
    # record_shapes: the dtype and size of each collective's payload (``reduction_dtypes``).
    with profile(activities=[ProfilerActivity.CPU], record_shapes=shapes, with_stack=False) as prof:
        yield out
    out.append(prof)


def engine_boundaries(events: list[Record]) -> list[bool]:
    """An engine's ``is_accumulation_boundary()`` answers, in order, from the loop's marks
    (:data:`unison.training.marks.BOUNDARY_TRUE`; empty where the trainer owns accumulation)."""
    return [BOUNDARY_MARKS[e.name] for e in sorted(events, key=lambda e: e.start) if e.name in BOUNDARY_MARKS]
