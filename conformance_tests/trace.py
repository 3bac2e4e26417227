"""Trace recording: the hooks, numbers and collectives of one fit, as the suite compares them.

Every run produces a *trace* (a plain dict, JSON-able but for ``state``):

``steps``
    per optimizer step: ``loss``, ``micro_losses``, ``grad_norm``, ``lrs``
    (every parameter group), ``skipped`` — as the trainer reported them to
    ``unison_on_train_step_end`` — plus the grad norm the
    ``unison_on_before_optimizer_step`` hook saw.
``hooks``
    every ``unison_*`` hook called during ``fit``, in order, recorded with
    :meth:`unison.PluginManager.record_hook_calls` (pluggy's hook-call
    monitoring: exactly what plugins see).
``counts``
    the trainer's optimizer and scheduler step counts, and what really
    happened: the optimizer steps in which the optimizer the user's factory
    built was really stepped (an optimizer step post-hook, counted between
    ``unison_on_before_optimizer_step`` and ``unison_on_after_optimizer_step``)
    and the scheduler's ``last_epoch``.
``collectives``
    calls made on the real process group, counted from the ``c10d::*``
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
    (gradients, not a loss or a norm).
``param_groups``
    the hyperparameters of each parameter group of ``strategy.optimizer`` at
    the run's first step (after a resume loaded its state), ``lr`` apart.
``saved_optimizer_state`` / ``loaded_optimizer_state``
    a summary of the user's optimizer's state (:func:`~unison.conformance.snapshots.optimizer_state_summary`)
    at every checkpoint written, and at the run's first step: a resume must
    give back what was written.
``boundaries``
    for engine-owned accumulation, what ``is_accumulation_boundary()``
    answered at every micro-step.
``state``
    ``trainer.full_state_dict()`` after ``fit``, on every rank (so replicas
    that end apart are seen).
``precision_probe``
    in a ``*-mixed`` scenario's strategy runs: the dtypes of every ``Linear``
    output seen inside forward and of the parameters the optimizer updates
    (:class:`~unison.conformance.sensitivity.PrecisionProbe`).
``buffer_snapshots``
    ``{step: canonical buffers}`` taken from ``trainer.full_state_dict()``
    inside ``unison_on_save_checkpoint``, at every checkpoint the run writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import torch

import unison
from unison.conformance.snapshots import PAYLOAD_PREFIXES, group_hyperparameters, optimizer_state_summary, payload

STEP_MARK = "unison.conformance::forward_backward"


NO_SYNC_MARK = "unison.conformance::no_sync"


MICRO_MARK = "unison.conformance::backward"


CLIP_MARK = "unison.conformance::clip_grad_norm"


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


class TraceRecorder:
    """A plugin recording what the trainer reports at every optimizer step."""

    def __init__(self, buffer_names: Sequence[str] = ()) -> None:
        self.steps: list[dict[str, Any]] = []
        #: Canonical names of the model's buffers (recorded at every checkpoint).
        self.buffer_names = tuple(buffer_names)
        self.buffer_snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.hook_grad_norms: dict[int, float] = {}
        self.start_counts: dict[str, int] | None = None
        self._mark: Any = None
        #: True between ``before_optimizer_step`` and ``after_optimizer_step``:
        #: the only place a real optimizer update belongs. (Loading optimizer
        #: state through torch.distributed.checkpoint.state_dict runs one
        #: zero-lr ``step()`` to materialise the state; that is not an update.)
        self.in_update = False
        #: ``step()`` calls of the user's optimizer per optimizer step. An
        #: engine may call it more than once per update (DeepSpeed ZeRO steps
        #: it once per parameter group, narrowing ``param_groups``), so what is
        #: checked is whether it was called at all, per step.
        self.step_calls: dict[int, int] = {}
        self.current_step: int | None = None
        self.updates_outside_window = 0
        #: ``{"step", "loss"}`` of every validation (``val/loss``).
        self.validations: list[dict[str, Any]] = []
        #: The hyperparameters of every parameter group of the optimizer the strategy steps, at the run's
        #: first step (after a resume loaded its state), ``lr`` apart (compared at every step).
        self.param_groups: list[dict[str, Any]] | None = None
        #: The optimizers the user's factory built (set by the run; the last one is the one trained).
        self.optimizers: list[Any] = []
        #: ``{step: summary}`` of the optimizer's state at every checkpoint written, and its state at the
        #: run's first step (a resumed run: what the checkpoint restored); see
        #: :func:`~unison.conformance.snapshots.optimizer_state_summary`.
        self.saved_optimizer_state: dict[int, dict[str, Any]] = {}
        self.loaded_optimizer_state: dict[str, Any] | None = None

    def count_update(self) -> None:
        if self.in_update and self.current_step is not None:
            self.step_calls[self.current_step] = self.step_calls.get(self.current_step, 0) + 1
        else:
            self.updates_outside_window += 1

    def close_mark(self) -> None:
        if self._mark is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None

    @unison.hookimpl
    def unison_on_train_step_start(self, trainer: Any, step: int) -> None:
        if self.start_counts is None:
            # After a checkpoint load (which happens after fit_start), so a
            # resumed run's counts start where the checkpoint left them.
            self.start_counts = {
                "optimizer_steps": trainer.progress.optimizer_steps,
                "scheduler_steps": trainer.progress.scheduler_steps,
            }
            self.param_groups = group_hyperparameters(getattr(trainer.strategy, "optimizer", None))
            self.loaded_optimizer_state = optimizer_state_summary(self.optimizers[-1] if self.optimizers else None)
        self.close_mark()
        self._mark = torch.autograd.profiler.record_function(STEP_MARK)
        self._mark.__enter__()

    @unison.hookimpl
    def unison_on_after_backward(self, step: int) -> None:
        self.close_mark()

    @unison.hookimpl
    def unison_on_before_optimizer_step(self, step: int, grad_norm: float) -> None:
        self.hook_grad_norms[step] = float(grad_norm)
        self.in_update = True
        self.current_step = step

    @unison.hookimpl
    def unison_on_after_optimizer_step(self, step: int, skipped: bool) -> None:
        self.in_update = False

    @unison.hookimpl
    def unison_on_save_checkpoint(self, trainer: Any) -> None:
        summary = optimizer_state_summary(self.optimizers[-1] if self.optimizers else None)
        if summary is not None:
            self.saved_optimizer_state[trainer.progress.global_step] = summary
        # Collective (every rank writes the checkpoint): the canonical state,
        # as a user exporting it at that moment would get it.
        if self.buffer_names:
            state = trainer.full_state_dict()
            self.buffer_snapshots[trainer.progress.global_step] = {k: state[k] for k in self.buffer_names if k in state}

    @unison.hookimpl
    def unison_on_validation_end(self, step: int, metrics: dict[str, float]) -> None:
        self.validations.append({"step": step, "loss": float(metrics["val/loss"])})

    @unison.hookimpl
    def unison_on_train_step_end(self, step: int, output: Any) -> None:
        self.steps.append(
            {
                "step": step,
                "loss": float(output.loss),
                "micro_losses": [float(x) for x in output.micro_losses],
                "grad_norm": float(output.grad_norm),
                "hook_grad_norm": self.hook_grad_norms.get(step),
                "lrs": [float(x) for x in output.lrs],
                "skipped": bool(output.skipped),
                "optimizer_step_calls": self.step_calls.get(step, 0),
            }
        )


def redispatched(event: Any) -> bool:
    """Whether ``event`` is an op's second record: the op re-dispatched by a Python dispatch mode.

    An op called under a ``TorchDispatchMode`` (the ``Throughput`` callback's
    FLOP counter on a fit's second step, a user's own mode) is recorded twice
    by the profiler: the call, and inside it (under ``PythonDispatchMode``)
    the mode's call of the same op. One collective ran; the inner record has
    an ancestor of the same name.
    """
    parent = getattr(event, "cpu_parent", None)
    while parent is not None:
        if parent.name == event.name:
            return True
        parent = parent.cpu_parent
    return False


@dataclasses.dataclass(frozen=True)
class Record:
    """One profiler record as :func:`analyse_collectives` reads it: name, start and end (ns), thread,
    the payload's shapes and dtypes (empty without ``record_shapes``), and whether it is an op's second
    record under a Python dispatch mode (:func:`redispatched`)."""

    name: str
    start: float
    end: float
    thread: int = 0
    shapes: tuple[Any, ...] = ()
    dtypes: tuple[str, ...] = ()
    redispatched: bool = False


def _wanted(name: str) -> bool:
    return (
        name in (STEP_MARK, NO_SYNC_MARK, CLIP_MARK, MICRO_MARK)
        or name.startswith(("c10d::", FUNCTIONAL_PREFIX))
        or (name.startswith(PAYLOAD_PREFIXES) and "reduce" in name)
    )


def records(prof: Any) -> list[Record]:
    """The records :func:`analyse_collectives` reads, straight from the profiler's raw (Kineto) results.

    ``prof.events()`` builds a ``FunctionEvent`` tree of every op in Python: about 0.4 s per run and rank
    here, a third of a conformance run's time on these tiny models. The marks and collectives are a few
    hundred of the ten thousand records; nesting (a re-dispatched ``c10d`` call inside one of the same
    name on its thread) is read from their time spans.
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
        if r.name.startswith("c10d::") and any(
            o is not r
            and o.name == r.name
            and o.thread == r.thread
            and o.start <= r.start
            and r.end <= o.end
            and (o.start, -o.end) < (r.start, -r.end)
            for o in calls
        ):
            r = dataclasses.replace(r, redispatched=True)
        out.append(r)
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
            calls.append((e.start, COLLECTIVE_KINDS.get(op, f"other:{op}")))
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
    grad_in_no_sync = sum(1 for t, kind in calls if kind in GRADIENT_SYNC_KINDS and inside(t, no_sync))
    return {
        # The dtypes that reductions of more than one element carried in the forward/backward windows.
        "reduction_dtypes": dict(Counter(dtype for t, dtype in reductions if inside(t, windows))),
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


def instrument(strategy: Any, boundaries: list[bool]) -> None:
    """Observe ``no_sync``, ``backward``, ``clip_grad_norm`` and ``is_accumulation_boundary`` on this strategy
    instance.

    Instance attributes shadow the methods: the strategy's behaviour is
    unchanged, the suite only marks the time spans and records the answers.
    """
    original_backward = strategy.backward

    def backward(loss: Any) -> None:
        with torch.autograd.profiler.record_function(MICRO_MARK):
            original_backward(loss)

    strategy.backward = backward
    original_clip = strategy.clip_grad_norm

    def clip_grad_norm(max_norm: Any) -> Any:
        with torch.autograd.profiler.record_function(CLIP_MARK):
            return original_clip(max_norm)

    strategy.clip_grad_norm = clip_grad_norm
    original_no_sync = getattr(strategy, "no_sync", None)
    if original_no_sync is not None:

        @contextlib.contextmanager
        def no_sync() -> Iterator[Any]:
            with torch.autograd.profiler.record_function(NO_SYNC_MARK), original_no_sync() as value:
                yield value

        strategy.no_sync = no_sync
    original_boundary = getattr(strategy, "is_accumulation_boundary", None)
    if original_boundary is None:
        return

    def is_accumulation_boundary() -> bool:
        answer = bool(original_boundary())
        boundaries.append(answer)
        return answer

    strategy.is_accumulation_boundary = is_accumulation_boundary
