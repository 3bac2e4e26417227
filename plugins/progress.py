"""Progress display on global rank 0, for the Python API and ``unison train`` alike.

Every Trainer gets one (through ``unison_default_plugins``) unless its
``progress`` setting is ``"off"`` or it was given its own :class:`ProgressBar`:

* ``"auto"`` (default): a live rich bar when stdout is a terminal, plain lines otherwise;
* ``"rich"``: always the live bar; ``"plain"``: always plain lines.

Both show step/total, loss, learning rate, samples/s (tokens/s when the batches
count tokens), elapsed time and ETA, and the validation loop's progress. Plain
lines come every ``progress_every_n_steps`` steps (about 20 per run by
default) and after every validation, e.g.::

    train step 40/150 | loss 2.3456 | lr 3.00e-03 | 512 samples/s | 32.8k tokens/s | elapsed 0:00:12 | eta 0:00:33
    val step 75: val/loss 2.1234 | 12 batches in 0:00:01

Values that live on the device are read only when shown (at most a few times
a second for the live bar, once per plain line), never every step.
"""

from __future__ import annotations

import datetime
import sys
import time
from typing import Any, Literal

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from unison.launch import messages
from unison.plugin import hookimpl

from ._timing import StepWindow

#: Steps averaged for the displayed throughput.
RATE_WINDOW = 20


def _clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(seconds)))


def _si(value: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}" if value >= 10 else f"{value:.2f}"


class ProgressBar:
    """The progress display (a pluggy plugin; only global rank 0 shows anything).

    Args:
        mode: ``"auto"``, ``"rich"`` or ``"plain"`` (see the module docstring).
        every_n_steps: steps between plain lines; ``None``: about 20 lines per run.
        console: the rich console to draw on (default: stdout); tests pass a recording one.
        refresh_per_second: redraws of the live bar.
    """

    def __init__(
        self,
        mode: Literal["auto", "rich", "plain"] = "auto",
        every_n_steps: int | None = None,
        console: Console | None = None,
        refresh_per_second: float = 4,
    ) -> None:
        self.mode = mode
        self.every_n_steps = every_n_steps
        self.console = console
        self.refresh_per_second = refresh_per_second
        self._window = StepWindow(RATE_WINDOW)
        self._bar: Progress | None = None
        self._train: TaskID | None = None
        self._val: TaskID | None = None
        self._active = False
        self._started = 0.0
        self._first_step = 0
        self._total: int | None = None
        self._shown = 0.0
        self._val_started = 0.0
        self._val_batches = 0

    # -- helpers -------------------------------------------------------------- #
    def _live(self) -> bool:
        if messages.log_format() == "json":  # a log service reads lines: no live bar
            return False
        if self.mode != "auto":
            return self.mode == "rich"
        return (self.console or Console()).is_terminal

    def _info(self, output: Any) -> str:
        parts = [f"loss {output.loss:.4f}", f"lr {output.lrs[0]:.2e}"]
        rates = self._window.rates()
        if "samples_per_s" in rates:
            parts.append(f"{_si(rates['samples_per_s'])} samples/s")
        if "tokens_per_s" in rates:
            parts.append(f"{_si(rates['tokens_per_s'])} tokens/s")
        if output.skipped:
            parts.append("(skipped)")
        return " | ".join(parts)

    def _print(self, line: str) -> None:
        if messages.log_format() == "json":
            messages.say(line, file=sys.stdout)  # one JSON object per line, on stdout like the text lines
        elif self._bar is not None:
            self._bar.console.print(line, markup=False, highlight=False)
        elif self.console is not None:
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            print(line, flush=True)  # plain: no rich wrapping at 80 columns in log files

    def _stop(self) -> None:
        self._active = False
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    # -- hooks ------------------------------------------------------------------ #
    @hookimpl
    def unison_on_fit_start(self, trainer: Any) -> None:
        if not trainer.is_global_zero:
            return
        self._active = True
        self._window.clear()
        self._started = time.monotonic()
        self._first_step = trainer.global_step
        # The step fit ends at (max_steps, or max_epochs over a sized dataset); None: the data stream decides.
        self._total = trainer.data.total_steps() if trainer.data is not None else trainer.settings.max_steps
        if not self._live():
            return
        self._bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TextColumn("elapsed"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            refresh_per_second=self.refresh_per_second,
        )
        self._bar.start()
        self._train = self._bar.add_task("train", total=self._total, completed=trainer.global_step, info="")

    @hookimpl
    def unison_on_load_checkpoint(self, trainer: Any) -> None:
        # Resumed: the bar starts at the restored step, and the ETA counts only this run's steps.
        self._first_step = trainer.global_step
        self._started = time.monotonic()
        if self._bar is not None and self._train is not None:
            self._bar.reset(self._train, total=self._total, completed=trainer.global_step, info="")

    @hookimpl
    def unison_on_train_step_start(self, trainer: Any) -> None:
        if self._active:
            self._window.start()

    @hookimpl
    def unison_on_train_step_end(self, trainer: Any, step: int, output: Any) -> None:
        if not self._active:
            return
        self._window.end(output)
        done = step + 1
        if self._bar is not None:
            assert self._train is not None
            now = time.monotonic()
            if now - self._shown >= 1 / self.refresh_per_second or done == self._total:
                self._shown = now
                self._bar.update(self._train, completed=done, info=self._info(output))
            else:
                self._bar.update(self._train, completed=done)
            return
        every = self.every_n_steps or max(1, (self._total or 20) // 20)
        if done % every == 0 or done == self._total or trainer.should_stop:
            elapsed = time.monotonic() - self._started
            this_run = done - self._first_step
            line = f"train step {done}" + (f"/{self._total}" if self._total else "") + f" | {self._info(output)}"
            line += f" | elapsed {_clock(elapsed)}"
            if self._total and this_run > 0:
                line += f" | eta {_clock(elapsed / this_run * (self._total - done))}"
            self._print(line)

    @hookimpl
    def unison_on_validation_start(self, trainer: Any, step: int) -> None:
        if not self._active:
            return
        self._val_started, self._val_batches = time.monotonic(), 0
        if self._bar is not None:
            self._val = self._bar.add_task("val", total=None, info="")

    @hookimpl
    def unison_validation_progress(self, trainer: Any, batch_idx: int, num_batches: int | None) -> None:
        if not self._active:
            return
        self._val_batches = batch_idx + 1
        if self._bar is not None and self._val is not None:
            self._bar.update(self._val, completed=batch_idx + 1, total=num_batches)

    @hookimpl
    def unison_on_validation_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        if not self._active:
            return
        if self._bar is not None and self._val is not None:
            self._bar.remove_task(self._val)
            self._val = None
        shown = " | ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        self._print(
            f"val step {step}: {shown} | {self._val_batches} batches in {_clock(time.monotonic() - self._val_started)}"
        )

    @hookimpl
    def unison_on_fit_end(self, trainer: Any) -> None:
        self._stop()

    @hookimpl
    def unison_on_exception(self, trainer: Any, exception: BaseException) -> None:
        self._stop()


@hookimpl
def unison_default_plugins(settings: Any, plugins: list[Any]) -> list[Any]:
    if settings.progress == "off" or any(isinstance(p, ProgressBar) for p in plugins):
        return []
    return [ProgressBar(mode=settings.progress, every_n_steps=settings.progress_every_n_steps)]
