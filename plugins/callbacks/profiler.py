"""A ``torch.profiler`` trace of a chosen window of optimizer steps.

The profiler starts at ``unison_on_train_step_start`` of step ``start_step``
and stops after ``num_steps`` steps, so its trace holds exactly those steps
(forward, backward, collectives, optimizer), each inside a
``unison.step#N`` range. Traces are written on the ranks asked for:

* ``format="chrome"``: ``DIR/trace-rank{R}-steps{A}-{B}-{TIME}.json``, for
  ``chrome://tracing`` or https://ui.perfetto.dev;
* ``format="tensorboard"``: ``DIR/rank{R}.{TIME}.pt.trace.json`` through
  ``torch.profiler.tensorboard_trace_handler``, for TensorBoard's profiler
  plugin (``tensorboard --logdir DIR``).

CUDA activity is recorded too when training on CUDA. A fit that ends inside
the window writes what was recorded; a crash discards it.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any, Literal

import torch

from unison.errors import ConfigurationError
from unison.plugin import hookimpl


class Profiler:
    """Profile optimizer steps ``start_step`` .. ``start_step + num_steps - 1`` (0-based).

    Args:
        dirpath: where traces go (created on demand).
        start_step: the first profiled step; skip a step or two so warm-up is not in the trace.
        num_steps: how many steps to profile.
        format: ``"chrome"`` or ``"tensorboard"`` (see the module docstring).
        ranks: ``"zero"`` (global rank 0 only) or ``"all"``.
        record_shapes, profile_memory, with_stack: passed to ``torch.profiler.profile``.
    """

    def __init__(
        self,
        dirpath: str = "profiler",
        start_step: int = 1,
        num_steps: int = 2,
        format: Literal["chrome", "tensorboard"] = "chrome",
        ranks: Literal["zero", "all"] = "zero",
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
    ) -> None:
        if start_step < 0 or num_steps < 1:
            raise ConfigurationError(
                "Profiler.start_step/num_steps",
                f"got {start_step}/{num_steps}",
                "pass start_step >= 0 and num_steps >= 1",
            )
        if format not in ("chrome", "tensorboard"):
            raise ConfigurationError("Profiler.format", f"got {format!r}", "use 'chrome' or 'tensorboard'")
        if ranks not in ("zero", "all"):
            raise ConfigurationError("Profiler.ranks", f"got {ranks!r}", "use 'zero' or 'all'")
        self.dirpath = Path(dirpath)
        self.start_step, self.num_steps, self.format, self.ranks = start_step, num_steps, format, ranks
        self.options = {"record_shapes": record_shapes, "profile_memory": profile_memory, "with_stack": with_stack}
        self._prof: Any = None
        self._range: Any = None
        self._first = self._last = -1
        #: Trace files written so far.
        self.traces: list[Path] = []

    @property
    def last_step(self) -> int:
        return self.start_step + self.num_steps - 1

    @hookimpl
    def unison_on_trainer_init(self, trainer: Any) -> None:
        max_steps = trainer.settings.max_steps
        if max_steps is not None and self.start_step >= max_steps:
            raise ConfigurationError(
                "Profiler.start_step",
                f"step {self.start_step} is never reached (max_steps={max_steps})",
                f"pass a start_step below {max_steps}",
            )

    @hookimpl
    def unison_on_train_step_start(self, trainer: Any, step: int) -> None:
        if step == self.start_step and (self.ranks == "all" or trainer.is_global_zero):
            activities = [torch.profiler.ProfilerActivity.CPU]
            if trainer.env is not None and trainer.env.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, **self.options)
            self._prof.start()
            self._first = step
        if self._prof is not None:
            self._range = torch.profiler.record_function(f"unison.step#{step}")
            self._range.__enter__()
            self._last = step

    @hookimpl
    def unison_on_train_step_end(self, trainer: Any, step: int) -> None:
        if self._prof is None:
            return
        self._close_range()
        if step >= self.last_step:
            self._export(trainer)

    @hookimpl
    def unison_on_fit_end(self, trainer: Any) -> None:
        if self._prof is not None:  # the fit ended inside the window
            self._close_range()
            self._export(trainer)

    @hookimpl
    def unison_on_exception(self, trainer: Any, exception: BaseException) -> None:
        if self._prof is not None:
            self._close_range()
            self._prof.stop()
            self._prof = None

    def _close_range(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def _export(self, trainer: Any) -> None:
        prof, self._prof = self._prof, None
        prof.stop()
        rank = trainer.env.rank if trainer.env is not None else 0
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        self.dirpath.mkdir(parents=True, exist_ok=True)
        if self.format == "chrome":
            path = self.dirpath / f"trace-rank{rank}-steps{self._first}-{self._last}-{stamp}.json"
            prof.export_chrome_trace(str(path))
            self.traces.append(path)
        else:
            before = set(self.dirpath.glob("*.pt.trace.json*"))
            torch.profiler.tensorboard_trace_handler(str(self.dirpath), worker_name=f"rank{rank}")(prof)
            self.traces += sorted(set(self.dirpath.glob("*.pt.trace.json*")) - before)
