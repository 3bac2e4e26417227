"""Built-in callbacks in one process: EarlyStopping, ModelCheckpoint, LearningRateMonitor, Throughput, Profiler.

(Their behaviour across ddp, fsdp and zero2 is in tests/test_loggers_backends.py.)
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

import unison
from unison.config.load import build_callbacks, load_config
from unison.plugins.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint, Profiler, Throughput

from helpers import mlp, regression_data
from observability_worlds import MetricsRecorder, TokenModel, fit, token_data

ROOT = Path(__file__).resolve().parents[1]


class Scripted:
    """Logs ``values[step]`` as ``user/score`` after every step (the public trainer.log)."""

    def __init__(self, values: list[float]) -> None:
        self.values = values

    @unison.hookimpl
    def unison_on_train_step_end(self, trainer, step):
        trainer.log({"user/score": self.values[step]})


class Saves:
    """Steps at which a checkpoint was written (every save calls unison_on_save_checkpoint)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    @unison.hookimpl
    def unison_on_save_checkpoint(self, trainer):
        self.steps.append(trainer.global_step)


def run(callbacks, max_steps=10, data=None, model=None, ckpt_path=None, optimizer=None, **settings):
    settings = {"global_batch_size": 16, "max_steps": max_steps, "progress": "off", **settings}
    trainer = unison.Trainer(strategy="single", callbacks=callbacks, **settings)
    trainer.fit(
        model or TokenModel(),
        data or token_data(),
        loss_fn=torch.nn.functional.cross_entropy,
        optimizer=optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-2)),
        ckpt_path=ckpt_path,
    )
    return trainer


def committed(root: Path) -> list[int]:
    """Steps of the committed checkpoints under ``root`` (``step-00000004`` or a re-save ``step-00000004.1``)."""
    done = [p for p in root.glob("step-*") if (p / "meta.json").exists() or (p / "manifest.json").exists()]
    return sorted(int(p.name.split("-")[1].split(".")[0]) for p in done)


# -- EarlyStopping ------------------------------------------------------------------------ #
@pytest.mark.parametrize(
    "mode,values,min_delta,stop",
    [
        # min: best 4.0 at step 1; 3.99 and 3.95 are within min_delta 0.1; 2 checks later it stops at step 3
        ("min", [5.0, 4.0, 3.99, 3.95, 1.0, 1.0], 0.1, 3),
        ("min", [5.0, 4.0, 3.99, 3.95, 1.0, 1.0], 0.0, None),  # any decrease counts: never stops
        ("max", [1.0, 2.0, 3.0, 2.5, 3.5, 3.0, 3.0, 4.0], 0.0, 6),  # 2.5 then 3.5 resets the count
    ],
)
def test_early_stopping_counts_checks_without_improvement(mode, values, min_delta, stop):
    stopper = EarlyStopping(monitor="user/score", mode=mode, patience=2, min_delta=min_delta)
    trainer = run([Scripted(values), stopper], max_steps=len(values))
    assert stopper.stopped_step == (None if stop is None else stop + 1)  # logged at global step = step + 1
    assert trainer.global_step == (len(values) if stop is None else stop + 1)


def test_early_stopping_stops_at_once_on_a_non_finite_metric():
    stopper = EarlyStopping(monitor="user/score", patience=5)
    trainer = run([Scripted([3.0, 2.0, math.nan, 1.0]), stopper], max_steps=4)
    assert trainer.global_step == 3 and "nan" in stopper.reason


def test_early_stopping_state_survives_resume(tmp_path):
    values = [5.0, 4.0, 4.5, 4.5, 4.5, 4.5]
    first = EarlyStopping(monitor="user/score", patience=3)
    run([Scripted(values), first], max_steps=3, checkpoint_dir=str(tmp_path))
    assert (first.best, first.wait) == (4.0, 1)
    resumed = EarlyStopping(monitor="user/score", patience=3)
    trainer = run([Scripted(values), resumed], max_steps=6, checkpoint_dir=str(tmp_path), ckpt_path="last")
    # 1 check without improvement before the checkpoint + 2 after: stops at step 5, not 6
    assert resumed.stopped_step == 5 and trainer.global_step == 5


@pytest.mark.parametrize(
    "kwargs,match", [({"mode": "lowest"}, "mode"), ({"patience": -1}, "patience"), ({"min_delta": -0.1}, "min_delta")]
)
def test_early_stopping_refuses_bad_arguments(kwargs, match):
    with pytest.raises(unison.ConfigurationError, match=match):
        EarlyStopping(**kwargs)


# -- ModelCheckpoint ---------------------------------------------------------------------- #
def test_model_checkpoint_keeps_best_k_by_val_loss_never_the_newest_deleted(tmp_path):
    recorder, saves = MetricsRecorder(), Saves()
    checkpoint = ModelCheckpoint(monitor="val/loss", save_top_k=2)
    fit("single", callbacks=[checkpoint, recorder, saves], checkpoint_dir=str(tmp_path))
    val = {s: m["val/loss"] for s, m in recorder.by_step().items() if "val/loss" in m}
    assert sorted(val) == list(range(2, 17, 2)) and saves.steps == sorted(val)  # one save per validation
    best = sorted(val, key=val.get)[:2]
    assert max(val) not in best  # the newest checkpoint is the worst kept...
    assert committed(tmp_path) == sorted({*best, 16})  # ...and still kept
    assert checkpoint.best_steps()[:2] == best
    # a kept best checkpoint is a complete one: training resumes from it
    state = run(
        [],
        max_steps=best[0] + 1,
        data=token_data(),
        ckpt_path=tmp_path / f"step-{best[0]:08d}",
        checkpoint_dir=str(tmp_path / "resumed"),
    )
    assert state.global_step == best[0] + 1


def test_model_checkpoint_ranks_scores_and_keeps_the_newest_even_when_it_is_the_worst(tmp_path):
    scores = [0.5, 0.9, 0.1, 0.7, 0.2, 0.0]  # mode max: best are steps 2 (0.9) and 4 (0.7)
    checkpoint = ModelCheckpoint(monitor="user/score", mode="max", save_top_k=2)
    saves = Saves()
    run([Scripted(scores), checkpoint, saves], max_steps=6, checkpoint_dir=str(tmp_path))
    assert saves.steps == [1, 2, 3, 4, 5, 6]
    assert committed(tmp_path) == [2, 4, 6]  # step 6 scored 0.0, the worst, but it is the newest
    assert (tmp_path / "latest").read_text().strip() == "step-00000006"


def test_model_checkpoint_scores_survive_resume(tmp_path):
    scores = [0.5, 0.9, 0.1, 0.7, 0.2, 0.0]
    run(
        [Scripted(scores), ModelCheckpoint(monitor="user/score", mode="max", save_top_k=1)],
        max_steps=3,
        checkpoint_dir=str(tmp_path),
    )
    assert committed(tmp_path) == [2, 3]
    resumed = ModelCheckpoint(monitor="user/score", mode="max", save_top_k=1)
    run([Scripted(scores), resumed], max_steps=6, checkpoint_dir=str(tmp_path), ckpt_path="last")
    assert resumed.scores[2] == 0.9 and committed(tmp_path) == [2, 6]  # step 2 from the first run is still best


def test_model_checkpoint_every_n_steps_does_not_repeat_the_trainers_saves(tmp_path):
    saves = Saves()
    run(
        [ModelCheckpoint(every_n_steps=2), saves], max_steps=9, checkpoint_dir=str(tmp_path), checkpoint_every_n_steps=4
    )
    assert saves.steps == [2, 4, 6, 8, 9]  # 4 and 8 by the trainer only, 9 is the trainer's final save
    assert committed(tmp_path) == [2, 4, 6, 8, 9]  # no save_top_k: nothing deleted


@pytest.mark.parametrize(
    "settings,kwargs,match",
    [
        ({}, {"every_n_steps": 2}, "checkpoint_dir"),
        (
            {"checkpoint_dir": "x", "keep_last_n_checkpoints": 2},
            {"monitor": "val/loss", "save_top_k": 1},
            "keep_last_n_checkpoints",
        ),
    ],
)
def test_model_checkpoint_refuses_settings_before_any_process_group(settings, kwargs, match):
    with pytest.raises(unison.ConfigurationError, match=match):
        unison.Trainer(strategy="ddp", max_steps=5, callbacks=[ModelCheckpoint(**kwargs)], **settings)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("kwargs", [{}, {"save_top_k": 2}, {"every_n_steps": 0}, {"monitor": "m", "mode": "up"}])
def test_model_checkpoint_refuses_bad_arguments(kwargs):
    with pytest.raises(unison.ConfigurationError):
        ModelCheckpoint(**kwargs)


# -- LearningRateMonitor ------------------------------------------------------------------ #
def test_learning_rate_monitor_logs_named_groups_with_momentum_and_weight_decay():
    recorder = MetricsRecorder()

    def groups(params):
        params = list(params)  # embedding weight, then the head's weight and bias
        return torch.optim.AdamW(
            [
                {"params": params[:1], "name": "embed", "lr": 0.01, "weight_decay": 0.0},
                {"params": params[1:], "name": "head", "lr": 0.02},
            ],
            betas=(0.8, 0.99),
        )

    run(
        [LearningRateMonitor(log_momentum=True, log_weight_decay=True), recorder],
        max_steps=4,
        optimizer=groups,
        log_every_n_steps=2,
    )
    logged = recorder.by_step()
    assert sorted(logged) == [2, 4]
    assert {k: v for k, v in logged[4].items() if k.split("/")[0] in ("lr", "momentum", "weight_decay")} == {
        "lr/embed": 0.01,
        "lr/head": 0.02,
        "momentum/embed": 0.8,
        "momentum/head": 0.8,
        "weight_decay/embed": 0.0,
        "weight_decay/head": 0.01,
    }
    assert logged[4]["train/lr-group1"] == 0.02  # the trainer's own per-group learning rates


# -- Throughput --------------------------------------------------------------------------- #
class Sleeps:
    @unison.hookimpl
    def unison_on_after_backward(self):
        time.sleep(0.03)


def test_throughput_measures_steps_samples_tokens_and_memory_on_logging_steps():
    recorder = MetricsRecorder()
    run([Sleeps(), recorder], max_steps=6, log_every_n_steps=3)
    logged = recorder.by_step()
    assert sorted(logged) == [3, 6]
    for metrics in logged.values():
        assert 0.03 <= metrics["perf/step_time"] < 1.0  # includes the 30 ms sleep of every step
        assert metrics["perf/samples_per_s"] == pytest.approx(16 / metrics["perf/step_time"])
        assert metrics["perf/tokens_per_s"] == pytest.approx(16 * 8 / metrics["perf/step_time"])  # 8 ids per sample
        assert metrics["perf/peak_rss_mib"] > 50  # torch alone is more
        assert "perf/cuda_max_allocated_mib" not in metrics  # CPU training


def test_throughput_has_no_tokens_for_float_inputs_and_is_off_by_setting():
    recorder = MetricsRecorder()
    trainer = unison.Trainer(strategy="single", global_batch_size=16, max_steps=2, progress="off", callbacks=[recorder])
    trainer.fit(
        mlp(),
        regression_data(),
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
    )
    assert "perf/samples_per_s" in recorder.by_step()[2] and "perf/tokens_per_s" not in recorder.by_step()[2]
    recorder = MetricsRecorder()
    trainer = run([recorder], max_steps=2, throughput=False)
    assert not any(k.startswith("perf/") for k in recorder.by_step()[2])
    assert not any(isinstance(p, Throughput) for _, p in trainer.pm.list_plugins())


# -- Profiler ------------------------------------------------------------------------------ #
def _trace_events(path: Path) -> list[dict]:
    return json.loads(path.read_text())["traceEvents"]


def test_profiler_writes_a_chrome_trace_of_exactly_the_chosen_steps(tmp_path):
    profiler = Profiler(dirpath=str(tmp_path), start_step=2, num_steps=2)
    run([profiler], max_steps=6)
    assert len(profiler.traces) == 1 and profiler.traces[0].name.startswith("trace-rank0-steps2-3-")
    events = _trace_events(profiler.traces[0])
    names = {e.get("name") for e in events}
    assert {"unison.step#2", "unison.step#3"} <= names
    assert not {"unison.step#1", "unison.step#4"} & names
    assert any(str(n).startswith("aten::") for n in names)  # the ops of forward and backward
    assert any("Optimizer.step" in str(n) for n in names)


def test_profiler_tensorboard_format_and_a_fit_ending_inside_the_window(tmp_path):
    profiler = Profiler(dirpath=str(tmp_path), start_step=3, num_steps=5, format="tensorboard")
    run([profiler], max_steps=5)  # ends after step 4: the trace holds steps 3 and 4
    (trace,) = profiler.traces
    assert trace.name.startswith("rank0.") and trace.name.endswith(".pt.trace.json")
    names = {e.get("name") for e in _trace_events(trace)}
    assert {"unison.step#3", "unison.step#4"} <= names


def test_profiler_refuses_a_window_that_is_never_reached():
    with pytest.raises(unison.ConfigurationError, match="start_step"):
        unison.Trainer(strategy="single", max_steps=5, callbacks=[Profiler(start_step=5)])
    with pytest.raises(unison.ConfigurationError, match="format"):
        Profiler(format="perfetto")


# -- from a config file ------------------------------------------------------------------- #
def test_callbacks_from_a_config_file(tmp_path):
    text = (ROOT / "examples" / "tinylm.toml").read_text()
    text = text.replace('factory = "tinylm.py', f'factory = "{ROOT}/examples/tinylm.py')
    text = f'[imports]\npaths = ["{ROOT}/examples"]\n' + text  # a trust root beyond the config's directory
    config = tmp_path / "c.toml"
    config.write_text(text + textwrap_callbacks())
    loaded, base = load_config(config)
    stopper, checkpoint = build_callbacks(loaded, base)
    assert isinstance(stopper, EarlyStopping) and (stopper.monitor, stopper.patience) == ("val/loss", 4)
    assert isinstance(checkpoint, ModelCheckpoint) and checkpoint.save_top_k == 2
    config.write_text(text + textwrap_callbacks().replace("patience", "patients"))
    with pytest.raises(unison.ConfigurationError, match=r"callbacks\.0\.kwargs\.patients.*did you mean 'patience'"):
        load_config(config)  # keywords are checked with the file, before anything is built


def textwrap_callbacks() -> str:
    return (
        '\n[[callbacks]]\nfactory = "unison.plugins.callbacks:EarlyStopping"\n'
        'kwargs = { monitor = "val/loss", patience = 4 }\n'
        '\n[[callbacks]]\nfactory = "unison.plugins.callbacks:ModelCheckpoint"\n'
        'kwargs = { monitor = "val/loss", save_top_k = 2 }\n'
    )
