"""TensorBoard event files: ``version_N/tensorboard/events.out.tfevents.*``.

Every metric is a scalar whose tag is the metric name, at ``global_step`` =
the trainer's step, written as TensorBoard's classic scalar summary: the
scalars dashboard of ``tensorboard --logdir ROOT`` shows it with the default
loader, and ``EventAccumulator(...).Scalars(tag)`` returns it. That format
holds a float32, so a value reads back as the float32 rounding of the
trainer's float64 (the JSONL and CSV loggers keep every digit). The run's
config, strategy declaration and versions are a text summary under
``run/metadata``. Needs ``pip install 'unison[tensorboard]'``;
``tensorboard --logdir ROOT`` shows every version side by side.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from typing import Any

from ._base import RunLogger, require
from ._run import RunDirectory

SUBDIR = "tensorboard"

#: TensorBoard writer threads whose uncaught exceptions the logger reports itself.
_QUIET_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_previous_hook: Any = None


_in_hook = threading.local()


def _quiet_hook(args: Any) -> None:
    if args.thread in _QUIET_THREADS and isinstance(args.exc_value, Exception):
        return  # surfaces again in the logging call, which reports it once
    if getattr(_in_hook, "on", False) or _previous_hook is None:  # a hook chained back to this one
        threading.__excepthook__(args)
        return
    _in_hook.on = True
    try:
        _previous_hook(args)
    finally:
        _in_hook.on = False


def _install_quiet_hook() -> None:
    """Chain :func:`_quiet_hook` in front of ``threading.excepthook`` (once per process)."""
    global _previous_hook
    if threading.excepthook is not _quiet_hook:
        _previous_hook = threading.excepthook
        threading.excepthook = _quiet_hook


class TensorBoardLogger(RunLogger):
    """Writes TensorBoard event files into each fit's run directory.

    Args:
        run: the run directory root (or a shared :class:`RunDirectory`).
        flush_secs: how often pending events reach the disk (and at the end of the fit).
    """

    def __init__(self, run: RunDirectory | str | os.PathLike[str], flush_secs: int = 10) -> None:
        require("tensorboard", "tensorboard", "TensorBoardLogger")
        super().__init__(run)
        self.flush_secs = flush_secs
        self._writer: Any = None

    def _start(self, trainer: Any, metadata: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        assert self.path is not None
        resume_step = self.run.resume_step if self.run is not None else None
        # A run continuing its own version: TensorBoard drops the events after the resumed step.
        purge = resume_step + 1 if resume_step is not None else None
        before = set(threading.enumerate())
        self._writer = SummaryWriter(log_dir=str(self.path / SUBDIR), flush_secs=self.flush_secs, purge_step=purge)
        # The writer's background thread re-raises a write error (a full disk) after handing it to the next
        # add_scalar call, where the write-failure policy reports it once; its own traceback would be a
        # second, raw report, so it is not printed for the threads this writer started.
        _QUIET_THREADS.update(set(threading.enumerate()) - before)
        _install_quiet_hook()
        text = json.dumps(metadata, indent=2, sort_keys=True, default=str)
        # Markdown code block: the text plugin renders it verbatim.
        self._writer.add_text("run/metadata", "```\n" + text + "\n```", global_step=0)

    def location(self) -> str:
        return str(self.path / SUBDIR) if self.path is not None else super().location()

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            # Classic scalar (simple_value): what TensorBoard's scalar loaders and EventAccumulator.Scalars read.
            self._writer.add_scalar(name, float(value), global_step=step)

    def _close(self, ok: bool) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def read_scalars(logdir: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Every scalar under ``logdir`` as ``{tag: [(step, value), ...]}``.

    Read as a user's script would: ``EventAccumulator(...).Scalars(tag)`` for
    every tag of ``Tags()["scalars"]``, keeping every event (no sampling).
    """
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_text(logdir: str | os.PathLike[str], tag: str = "run/metadata") -> str:
    """A text summary written under ``logdir`` (the run metadata by default)."""
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.TENSORS: 0})
    acc.Reload()
    value = tensor_util.make_ndarray(acc.Tensors(f"{tag}/text_summary")[0].tensor_proto)
    return value.flat[0].decode()
