"""Framework time: what a unison step spends outside the backend, and what hooks cost.

* **Outside backend calls**: ``single`` trains with every strategy method the
  trainer calls on the hot path (forward, backward, no_sync, reduce_sum,
  clip_grad_norm, optimizer_step, zero_grad) and the user's ``loss_fn`` timed,
  and the data iterator timed. Framework time per step = wall time per step -
  time in those calls - time fetching batches (data loading is reported on its
  own: a hand-written loop loads its batches too).
* **Hook dispatch**: the five per-step hooks (step start, after backward,
  before optimizer step, after optimizer step, step end) called through the
  plugin manager exactly as the trainer calls them, with 0, 5 and 20
  callbacks that implement all five, plus the default plugins (Throughput).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.workload import Workload, stamp_plugin, steady_step_time

#: The strategy methods the trainer calls on a step's hot path.
BACKEND_METHODS = ("forward", "backward", "no_sync", "reduce_sum", "clip_grad_norm", "optimizer_step", "zero_grad")


class _Timer:
    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed

    def iterate(self, iterator: Any) -> Any:
        it = iter(iterator)
        while True:
            start = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                self.seconds += time.perf_counter() - start
            yield item


def noop_callbacks(n: int) -> list[Any]:
    """``n`` callbacks implementing every per-step hook with an empty body."""
    import unison

    class Noop:
        @unison.hookimpl
        def unison_on_train_step_start(self, trainer: Any, step: int) -> None:
            pass

        @unison.hookimpl
        def unison_on_after_backward(self, trainer: Any, step: int) -> None:
            pass

        @unison.hookimpl
        def unison_on_before_optimizer_step(self, trainer: Any, step: int, grad_norm: Any) -> None:
            pass

        @unison.hookimpl
        def unison_on_after_optimizer_step(self, trainer: Any, step: int, skipped: bool) -> None:
            pass

        @unison.hookimpl
        def unison_on_train_step_end(self, trainer: Any, step: int, output: Any) -> None:
            pass

    return [Noop() for _ in range(n)]


def _instrumented_run(w: Workload, callbacks: int) -> dict[str, float]:
    """One ``single`` run with the backend calls and the data iterator timed; microseconds per step."""
    import unison

    backend, data = _Timer(), _Timer()
    marks: dict[int, tuple[float, float]] = {}

    class Instrument:
        @unison.hookimpl
        def unison_on_fit_start(self, trainer: Any) -> None:
            # Instance attributes shadow the methods: the trainer's calls go through the timer.
            for name in BACKEND_METHODS:
                if hasattr(trainer.strategy, name):
                    setattr(trainer.strategy, name, backend.wrap(getattr(trainer.strategy, name)))
            steps = trainer.data.steps
            trainer.data.steps = lambda start: data.iterate(steps(start))

        @unison.hookimpl
        def unison_on_train_step_end(self, step: int) -> None:
            marks[step] = (backend.seconds, data.seconds)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return w.loss(out, target)

    stamper, stamps = stamp_plugin()
    trainer = unison.Trainer(
        strategy="single", callbacks=[stamper, Instrument(), *noop_callbacks(callbacks)], **w.unison_settings()
    )
    trainer.fit(w.model, w.data(), loss_fn=backend.wrap(loss_fn), optimizer=w.optimizer)
    first, last = w.warmup - 1, w.steps - 1
    wall = steady_step_time(stamps, w.warmup)
    in_backend = (marks[last][0] - marks[first][0]) / (last - first)
    in_data = (marks[last][1] - marks[first][1]) / (last - first)
    return {
        "wall_us": wall * 1e6,
        "backend_us": in_backend * 1e6,
        "data_us": in_data * 1e6,
        "framework_us": (wall - in_backend - in_data) * 1e6,
    }


def distributed_costs(w: Workload, strategy: str = "ddp") -> dict[str, float]:
    """Microseconds per step of the collectives around the backend's step (median over steady steps).

    ``stop_agreement``: ``should_stop`` and stop requests all-reduced on the CPU
    (gloo) control group at every step boundary: from the wait for the previous
    boundary's all-reduce (``collect``) to the start of this one's (``agree``);
    where the loss all-reduce carries the flags (unison.training.stopping), the
    flags' bookkeeping at the boundary. ``loss_reduce``: the step's
    micro-batch losses summed over replicas (``strategy.reduce_sum``, or the
    one sum over the world of a strategy that reports its losses on some ranks:
    a pipeline), so every rank reports the same loss.
    """
    import unison

    per_step: dict[str, list[float]] = {"stop_agreement": [], "loss_reduce": [], "grad_norm": []}

    def timing(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                per_step[name].append((time.perf_counter() - start) * 1e6)

        return timed

    class Instrument:
        @unison.hookimpl
        def unison_on_fit_start(self, trainer: Any) -> None:
            loop = trainer._fit.loop  # the fit's TrainLoop (unison.training.record), set up before fit_start
            stop, started = loop.stop, []
            collect, agree = stop.collect, stop.agree

            def timed_collect() -> None:
                started.append(started[-1] if started else time.perf_counter())
                collect()

            def timed_agree(now: bool = False) -> bool:
                try:
                    return agree(now=now)
                finally:
                    per_step["stop_agreement"].append((time.perf_counter() - started[0]) * 1e6)
                    started.clear()

            stop.collect, stop.agree = timed_collect, timed_agree
            loop._step_sum = timing("loss_reduce", loop._step_sum)  # reduce_sum, or the sum over the world
            trainer.strategy.clip_grad_norm = timing("grad_norm", trainer.strategy.clip_grad_norm)

    options = w.strategy_options(strategy)
    trainer = unison.Trainer(
        strategy=strategy,
        callbacks=[Instrument()],
        **w.unison_settings(**({"strategy_options": options} if options else {})),
    )
    trainer.fit(w.model, w.data(), loss_fn=w.loss, optimizer=w.optimizer)
    out = {k: statistics.median(v[w.warmup :]) for k, v in per_step.items()}
    # The bare latency of one such collective in a tight loop: the rest of stop_agreement is waiting
    # for the slower rank, which a loop without it would wait for at its next collective instead.
    import torch.distributed as dist

    flags, bare = torch.zeros(2), []
    for _ in range(200):
        start = time.perf_counter()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bare.append((time.perf_counter() - start) * 1e6)
    out["bare_all_reduce"] = statistics.median(bare)
    return out


def framework_time(w: Workload, callbacks: int, rounds: int) -> dict[str, float]:
    """Per-step wall, backend, data and framework microseconds for ``single`` (medians over rounds)."""
    rows = [_instrumented_run(w, callbacks) for _ in range(rounds)]
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def hook_dispatch(callbacks: int, iterations: int = 3000, rounds: int = 5) -> float:
    """Microseconds per optimizer step to dispatch the five per-step hooks with ``callbacks`` callbacks."""
    import unison
    from unison.training.outputs import StepOutput

    trainer = unison.Trainer(
        strategy="single", callbacks=noop_callbacks(callbacks), max_steps=10, progress="off", log_every_n_steps=10**6
    )
    pm = trainer.pm
    norm = torch.zeros(())
    output = StepOutput(0, torch.zeros(2), norm, [1e-3], False, 64, None)
    best = []
    for _ in range(rounds):
        start = time.perf_counter()
        for i in range(iterations):
            pm.unison_on_train_step_start(trainer=trainer, step=i)
            pm.unison_on_after_backward(trainer=trainer, step=i)
            pm.unison_on_before_optimizer_step(trainer=trainer, step=i, grad_norm=norm)
            pm.unison_on_after_optimizer_step(trainer=trainer, step=i, skipped=False)
            pm.unison_on_train_step_end(trainer=trainer, step=i, output=output)
        best.append((time.perf_counter() - start) / iterations)
    return statistics.median(best) * 1e6


def sampler_cost(dataset_size: int = 1_281_167, steps: int = 200) -> dict[str, float]:
    """Microseconds to plan one step's micro-batches on a shuffled ImageNet-sized dataset.

    The plan draws the epoch's permutation once (the first step of each epoch
    pays it) and slices it afterwards; ``randperm_us`` is what one draw costs,
    which a plan drawing it every step would pay every step.
    """
    from unison.data.plan import BatchPlan

    plan = BatchPlan(dataset_size, 256, 4, 2, 0, seed=0, shuffle=True)
    epoch = 3  # an epoch no earlier call has drawn
    first = plan.steps_per_epoch * epoch
    start = time.perf_counter()
    plan.local_micro_indices(first)
    first_us = (time.perf_counter() - start) * 1e6
    start = time.perf_counter()
    for step in range(first + 1, first + 1 + steps):
        plan.local_micro_indices(step)
    steady_us = (time.perf_counter() - start) / steps * 1e6
    start = time.perf_counter()
    torch.randperm(dataset_size, generator=torch.Generator().manual_seed(1))
    return {
        "dataset_size": dataset_size,
        "first_step_us": first_us,
        "steady_us": steady_us,
        "randperm_us": (time.perf_counter() - start) * 1e6,
    }


def run(w: Workload, rounds: int) -> dict[str, Any]:
    return {
        "framework": {n: framework_time(w, n, rounds) for n in (0, 5, 20)},
        "dispatch": {n: hook_dispatch(n) for n in (0, 5, 20)},
        "sampler": sampler_cost(),
    }
