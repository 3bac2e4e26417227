"""The documented hook order is the fired hook order.

The order lives once, in the module docstring of :mod:`unison.plugin.hookspecs` (docs/hooks.md
repeats it verbatim). These tests parse that block into a pattern over
hook names and match real runs against it: a fresh run with validation, checkpoints,
logging, an epoch boundary and a cut-short epoch; a resumed run; and runs stopped by
``should_stop``.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import unison
from unison.plugin import hookspecs

from helpers import mlp, regression_data

ROOT = Path(__file__).resolve().parents[1]
#: Registration hooks run when a registry is (re)built, not as part of fit's order; validation
#: progress ticks once per validation batch, a count that depends on the data-parallel size.
REGISTRATION = {"unison_strategies", "unison_precisions", "unison_validation_progress"}


# --------------------------------------------------------------------------- #
# The documented order, parsed
# --------------------------------------------------------------------------- #
def documented_block(doc: str, marker: str = "::") -> str:
    """The literal block that follows the first line ending in ``marker`` after "The order of one"."""
    lines = doc[doc.index("The order of one") :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.rstrip().endswith(marker)) + 1
    block: list[str] = []
    for line in lines[start:]:
        if line.strip() and not line.startswith(" "):
            break
        block.append(line)
    return textwrap.dedent("\n".join(block)).strip("\n")


def order_pattern(block: str) -> re.Pattern[str]:
    """A regular expression over ``"hook hook ... "`` strings that accepts exactly the documented orders.

    ``name`` must fire; ``[a, b, c]`` fires all or none of its hooks, in order;
    ``each optimizer step:`` repeats its more-indented lines any number of times;
    text after a hook (two spaces or more) is the condition and is not parsed,
    and a line holding only such text continues the previous line's condition.
    """
    # Each part is a regex string, or ("loop", parts) for a repeated block.
    root: list[Any] = []
    stack: list[tuple[int, list[Any]]] = [(-1, root)]
    for raw in block.splitlines():
        if not raw.strip():
            continue
        indent = len(raw) - len(raw.lstrip())
        text = raw.strip()
        if not (text.startswith(("unison_", "[")) or text.endswith(":")):
            continue  # a condition continued from the line above
        while stack[-1][0] >= indent:
            stack.pop()
        parts = stack[-1][1]
        if text.endswith(":"):
            assert text == "each optimizer step:", f"unknown block header {text!r}"
            body: list[Any] = []
            parts.append(("loop", body))
            stack.append((indent, body))
        elif text.startswith("["):
            names = [n.strip() for n in text[1 : text.index("]")].split(",")]
            parts.append("(?:" + "".join(f"{re.escape(n)} " for n in names) + ")?")
        else:
            parts.append(re.escape(text.split()[0]) + " ")

    def render(parts: list[Any]) -> str:
        return "".join(f"(?:{render(p[1])})*" if isinstance(p, tuple) else p for p in parts)

    return re.compile(render(root))


PATTERN = order_pattern(documented_block(hookspecs.__doc__ or ""))


def fits_documented_order(calls: list[str]) -> bool:
    return PATTERN.fullmatch("".join(f"{c} " for c in calls)) is not None


# --------------------------------------------------------------------------- #
# Real runs
# --------------------------------------------------------------------------- #
class LogAndMaybeStop:
    """Logs a user metric every step (sent at the next logging step, or at the end); stops when told."""

    def __init__(self, stop_after_step: int | None = None) -> None:
        self.stop_after_step = stop_after_step

    @unison.hookimpl
    def unison_on_train_step_end(self, trainer, step):
        trainer.log({"user/step": float(step)})
        if step == self.stop_after_step:
            trainer.should_stop = True


def run(tmp_path: Path, *, max_steps: int, ckpt_path: str | None = None, **settings) -> tuple[list[str], Path]:
    """Fit the ``single`` strategy and return the fired lifecycle hooks, in order."""
    stopper = LogAndMaybeStop(settings.pop("stop_after_step", None))
    settings = {
        # 12 samples, 4 per step: 3 steps per epoch, so an epoch ends at step 2 and the
        # second one is cut short by max_steps=5.
        "global_batch_size": 4,
        "accumulate_grad_batches": 2,
        "log_every_n_steps": 2,
        "val_every_n_steps": 2,
        "checkpoint_every_n_steps": 3,
        "checkpoint_dir": str(tmp_path / "ckpt"),
        **settings,
    }
    trainer = unison.Trainer(strategy="single", max_steps=max_steps, callbacks=[stopper], **settings)
    with trainer.pm.record_hook_calls(prefix="unison_") as calls:
        trainer.fit(
            mlp(),
            regression_data(12),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
            val_dataset=regression_data(8, seed=7),
            ckpt_path=ckpt_path,
        )
    return [c for c in calls if c not in REGISTRATION], tmp_path / "ckpt"


def test_a_fresh_run_fires_the_documented_order(tmp_path):
    calls, _ = run(tmp_path, max_steps=5)
    assert fits_documented_order(calls), calls
    # What this run must have exercised, so that the match is not vacuous:
    # validation at steps 2 and 4 and once more at the end (5); checkpoints at 3 and at the end.
    assert calls.count("unison_on_validation_start") == 3
    assert calls.count("unison_on_save_checkpoint") == 2
    assert calls.count("unison_on_train_epoch_start") == 2 and calls.count("unison_on_train_epoch_end") == 1
    # The end of epoch 0 (step 3) comes before that step's checkpoint.
    end = calls.index("unison_on_train_epoch_end")
    assert calls.index("unison_on_save_checkpoint") > end
    assert calls[-1] == "unison_on_fit_end" and calls[-2] == "unison_log_metrics"  # the kept trainer.log() values


def test_a_resumed_run_fires_the_documented_order(tmp_path):
    run(tmp_path, max_steps=5)
    calls, _ = run(tmp_path, max_steps=7, ckpt_path="last")
    assert fits_documented_order(calls), calls
    assert calls[:3] == ["unison_on_fit_start", "unison_on_load_checkpoint", "unison_on_train_epoch_start"]
    # Step 6 ends epoch 1 and validates and saves (6 % 2 == 6 % 3 == 0); step 7 opens epoch 2.
    assert calls.count("unison_on_train_epoch_end") == 1 and calls.count("unison_on_train_epoch_start") == 2


def test_the_pattern_rejects_the_old_documented_order(tmp_path):
    """Validation and checkpoint before the epoch's end (what the docs used to say) is not accepted."""
    calls, _ = run(tmp_path, max_steps=3)
    assert fits_documented_order(calls)
    end = calls.index("unison_on_train_epoch_end")
    moved = [c for i, c in enumerate(calls) if i != end]
    moved.insert(moved.index("unison_on_save_checkpoint") + 1, "unison_on_train_epoch_end")
    assert not fits_documented_order(moved)
    assert not fits_documented_order([c for c in calls if c != "unison_on_after_backward"])


@pytest.mark.parametrize(
    ("stop_after_step", "validations", "checkpoints"),
    [
        # Stopped on a validation and checkpoint step (step 2): both run once, in the loop.
        (1, 1, ["step-00000002"]),
        # Stopped on step 3, which has neither: the end of fit validates and saves it once.
        (2, 2, ["step-00000002", "step-00000003"]),
    ],
)
def test_should_stop_validates_and_saves_each_step_once(tmp_path, stop_after_step, validations, checkpoints):
    calls, ckpt = run(
        tmp_path, max_steps=10, val_every_n_steps=2, checkpoint_every_n_steps=2, stop_after_step=stop_after_step
    )
    assert fits_documented_order(calls), calls
    assert calls.count("unison_on_train_step_start") == stop_after_step + 1
    assert calls.count("unison_on_validation_start") == validations
    assert calls.count("unison_on_save_checkpoint") == len(checkpoints)
    assert sorted(p.name for p in ckpt.glob("step-*")) == checkpoints


def test_docs_repeat_the_documented_order():
    readme = (ROOT / "docs" / "hooks.md").read_text()
    section = readme[readme.index("# Hooks") :]
    fenced = section[section.index("```") + 3 :]
    readme_block = fenced[fenced.index("\n") + 1 : fenced.index("```")].strip("\n")
    assert readme_block == documented_block(hookspecs.__doc__ or "")


def test_every_lifecycle_hookspec_appears_in_the_documented_order():
    block = documented_block(hookspecs.__doc__ or "")
    specs = [n for n in dir(hookspecs) if n.startswith("unison_on_") or n == "unison_log_metrics"]
    # unison_on_exception replaces the rest; unison_on_trainer_init runs in Trainer(...), before any fit
    # (both are described right after the block).
    missing = [n for n in specs if n not in block and n not in ("unison_on_exception", "unison_on_trainer_init")]
    assert not missing, f"hooks missing from the documented order in unison.plugin.hookspecs: {missing}"
