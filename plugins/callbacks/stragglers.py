"""Stragglers: every rank's step time on each logging step, and the slowest rank named.

A slow rank (a throttled GPU, a noisy neighbour, a slow loader worker) makes every rank slow: the
others wait for it in the next collective. So each rank measures two things per optimizer step
(``unison_on_train_step_start`` to ``unison_on_train_step_end``, two clock reads): its wall time, and
the part of it spent *waiting* in blocking collectives, as :mod:`unison.launch.collectives` times them.
Its *compute* time is the difference. The rank whose compute time is longest is the one the others
wait for.

On each logging step (every ``log_every_n_steps``) the ranks exchange their means since the last
log in one small all-gather on the trainer's CPU control group (three numbers per rank; no device
work); other steps add nothing but the clock reads. Every rank then logs, through ``trainer.log``:

=================================  ===============================================================
``perf/step_time_min``             the shortest mean step time of any rank (seconds)
``perf/step_time_median``          the median over ranks
``perf/step_time_max``             the longest
``perf/wait_time``                 this rank's mean seconds per step waiting in collectives
``perf/compute_time``              this rank's mean step time less that wait
``stragglers/slowest_rank``        the rank with the longest compute time
``stragglers/slowest_ratio``       its compute time over the median compute time of all ranks
``stragglers/flagged``             1 when that ratio exceeds ``threshold``, else 0
=================================  ===============================================================

When a rank is flagged, global rank 0 prints one line with the progress lines (stdout; not with
``progress="off"``; a JSON object in the json log format)::

    straggler at step 40: rank 1 (host-b) computes 0.212 s per step, 1.93x the median 0.110 s;
    step time min/median/max 0.214/0.215/0.216 s; waiting per step: rank 0 0.201 s, rank 1 0.001 s

Where the wait cannot be told apart from the work (collectives on device groups, or run in C++ like
DDP's gradient all-reduce; see :mod:`unison.launch.collectives`), a rank's compute time is its step
time: ranks whose steps differ are still told apart, and a rank that only waits there may look
busy. At world size 1 nothing is exchanged and nothing is logged.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from unison.errors import ConfigurationError
from unison.launch import collectives, messages
from unison.plugin import hookimpl


class StragglerReport:
    """Logs min/median/max step time across ranks and names the slowest rank (a pluggy plugin).

    Args:
        threshold: a rank is flagged (and named in the progress output) when its compute time per
            step exceeds the median compute time of all ranks by this factor (> 1).
    """

    def __init__(self, threshold: float = 1.5) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold <= 1:
            raise ConfigurationError(
                "StragglerReport.threshold",
                f"got {threshold!r}; it is a factor over the median compute time",
                "pass a number above 1, e.g. threshold=1.5 (flag a rank 50% slower than the median)",
            )
        self.threshold = float(threshold)
        #: The last exchange: ``{"step", "step_time", "wait_time", "slowest_rank", "ratio", "flagged"}``
        #: (per-rank lists for the times), or ``None`` before the first logging step.
        self.last: dict[str, Any] | None = None
        self._hosts: list[str] = []
        self._reset()

    def _reset(self) -> None:
        self._seconds, self._waited, self._steps = 0.0, 0.0, 0
        self._started: float | None = None
        self._wait_at_start = 0.0

    @hookimpl
    def unison_on_fit_start(self, trainer: Any) -> None:
        self._reset()
        self.last = None
        env = trainer.env
        self._hosts = []
        if env is not None and env.world_size > 1 and dist.is_initialized():
            hosts: list[Any] = [None] * env.world_size
            # Once per fit: who runs where, for naming a straggler's host.
            dist.all_gather_object(hosts, messages.node(), group=trainer.control_group)
            self._hosts = [str(h) for h in hosts]

    @hookimpl
    def unison_on_train_step_start(self, trainer: Any) -> None:
        self._wait_at_start = collectives.RECORDER.wait_s
        self._started = time.perf_counter()

    @hookimpl
    def unison_on_train_step_end(self, trainer: Any, step: int) -> None:
        if self._started is None:  # a step whose start this plugin did not see
            return
        self._seconds += time.perf_counter() - self._started
        self._waited += collectives.RECORDER.wait_s - self._wait_at_start
        self._steps += 1
        self._started = None
        if (step + 1) % trainer.settings.log_every_n_steps or not self._hosts:
            return
        mine = torch.tensor([self._seconds / self._steps, self._waited / self._steps], dtype=torch.float64)
        self._seconds, self._waited, self._steps = 0.0, 0.0, 0
        gathered = [torch.empty_like(mine) for _ in self._hosts]
        before = collectives.RECORDER.wait_s
        dist.all_gather(gathered, mine, group=trainer.control_group)
        collectives.RECORDER.wait_s = before  # this exchange's own wait is not the training's
        self._report(trainer, step + 1, [g.tolist() for g in gathered])

    def _report(self, trainer: Any, step: int, per_rank: list[list[float]]) -> None:
        times = [t for t, _ in per_rank]
        waits = [w for _, w in per_rank]
        compute = [max(0.0, t - w) for t, w in per_rank]
        slowest = max(range(len(compute)), key=compute.__getitem__)
        median = statistics.median(compute)
        ratio = compute[slowest] / median if median > 0 else 1.0
        flagged = ratio > self.threshold
        rank = trainer.env.rank
        self.last = {
            "step": step,
            "step_time": times,
            "wait_time": waits,
            "slowest_rank": slowest,
            "ratio": ratio,
            "flagged": flagged,
        }
        trainer.log(
            {
                "perf/step_time_min": min(times),
                "perf/step_time_median": statistics.median(times),
                "perf/step_time_max": max(times),
                "perf/wait_time": waits[rank],
                "perf/compute_time": compute[rank],
                "stragglers/slowest_rank": float(slowest),
                "stragglers/slowest_ratio": ratio,
                "stragglers/flagged": float(flagged),
            }
        )
        if flagged and rank == 0 and trainer.settings.progress != "off":
            waiting = ", ".join(f"rank {r} {w:.3f} s" for r, w in enumerate(waits))
            messages.say(
                f"straggler at step {step}: rank {slowest} ({self._hosts[slowest]}) computes "
                f"{compute[slowest]:.3f} s per step, {ratio:.2f}x the median {median:.3f} s; step time "
                f"min/median/max {min(times):.3f}/{statistics.median(times):.3f}/{max(times):.3f} s; "
                f"waiting per step: {waiting}",
                level="warning",
                file=sys.stdout,
                step=step,
            )
