"""TensorBoard event files: ``version_N/tensorboard/events.out.tfevents.*``.

Every metric is a scalar whose tag is the metric name, at ``global_step`` =
the trainer's step. Scalars are written as float64 tensor summaries (the
``scalars`` plugin shows them like any scalar), so the value read back is
exactly the trainer's, not a float32 rounding of it. The run's config,
strategy declaration and versions are a text summary under ``run/metadata``.
Needs ``pip install 'unison[tensorboard]'``; ``tensorboard --logdir ROOT``
shows every version side by side.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ._base import RunLogger, require
from ._run import RunDirectory

SUBDIR = "tensorboard"


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
        self._writer = SummaryWriter(log_dir=str(self.path / SUBDIR), flush_secs=self.flush_secs, purge_step=purge)
        text = json.dumps(metadata, indent=2, sort_keys=True, default=str)
        # Markdown code block: the text plugin renders it verbatim.
        self._writer.add_text("run/metadata", "```\n" + text + "\n```", global_step=0)

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, float(value), global_step=step, new_style=True, double_precision=True)

    def _close(self, ok: bool) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def read_scalars(logdir: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Every scalar under ``logdir`` as ``{tag: [(step, value), ...]}``, read by TensorBoard's own event reader."""
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    acc = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={event_accumulator.TENSORS: 0, event_accumulator.SCALARS: 0}
    )
    acc.Reload()
    out: dict[str, list[tuple[int, float]]] = {}
    for tag in acc.Tags()["tensors"]:
        if acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars":  # not text summaries
            out[tag] = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
    for tag in acc.Tags()["scalars"]:
        out[tag] = [(e.step, e.value) for e in acc.Scalars(tag)]
    return out


def read_text(logdir: str | os.PathLike[str], tag: str = "run/metadata") -> str:
    """A text summary written under ``logdir`` (the run metadata by default)."""
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.TENSORS: 0})
    acc.Reload()
    value = tensor_util.make_ndarray(acc.Tensors(f"{tag}/text_summary")[0].tensor_proto)
    return value.flat[0].decode()
