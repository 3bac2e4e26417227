"""Loggers in one process: run directories, each logger's own reader, config, missing packages."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import unison
from unison.config.load import load_config
from unison.plugins.loggers import (
    CSVLogger,
    JSONLLogger,
    MLflowLogger,
    TensorBoardLogger,
    WandbLogger,
    loggers_from_config,
    new_version,
    read_csv,
)
from unison.plugins.loggers.tensorboard_logger import read_text

import helpers
from helpers import adamw
from observability_worlds import (
    MetricsRecorder,
    TokenModel,
    as_float32,
    csv_metrics,
    jsonl_metrics,
    same,
    tensorboard_metrics,
    token_data,
    wandb_metrics,
)

ROOT = Path(__file__).resolve().parents[1]


class LogsUserMetrics:
    """A callback using the public trainer.log: one finite value, one infinite, every step."""

    @unison.hookimpl
    def unison_on_train_step_end(self, trainer, step):
        trainer.log({"user/double_step": 2.0 * step, "user/inf": math.inf})


def fit(trainer: unison.Trainer, steps_val: bool = True) -> None:
    """helpers.fit on the token model (cross-entropy, AdamW), validating on held-out tokens unless not ``steps_val``."""
    helpers.fit(
        trainer,
        model=TokenModel(),
        data=token_data(),
        loss_fn=torch.nn.functional.cross_entropy,
        optimizer=adamw(),
        val_dataset=token_data(n=40, seed=9) if steps_val else None,
    )


def make_trainer(loggers, callbacks=(), **settings) -> tuple[unison.Trainer, MetricsRecorder]:
    recorder = MetricsRecorder()
    settings = {
        "global_batch_size": 16,
        "max_steps": 6,
        "log_every_n_steps": 2,
        "val_every_n_steps": 3,
        "progress": "off",
        **settings,
    }
    return unison.Trainer(strategy="single", callbacks=[recorder, *callbacks], loggers=loggers, **settings), recorder


def test_file_loggers_read_back_exactly_what_the_trainer_logged(tmp_path):
    root = tmp_path / "runs"
    loggers = [JSONLLogger(root), CSVLogger(root), TensorBoardLogger(root), WandbLogger(root, project="t")]
    trainer, recorder = make_trainer(loggers, callbacks=[LogsUserMetrics()])
    fit(trainer)
    logged = recorder.by_step()
    assert sorted(logged) == [2, 3, 4, 6]  # logging steps, and the validations at 3 and 6
    assert logged[4]["user/double_step"] == 6.0 and logged[4]["user/inf"] == math.inf  # trainer.log, at step 4
    assert {"train/loss", "val/loss", "perf/tokens_per_s", "perf/peak_rss_mib"} <= set(logged[6])
    # every logger of the fit shares one version directory
    assert {logger.path for logger in loggers} == {root / "version_0"}
    for read in (jsonl_metrics, csv_metrics):
        same(read(root / "version_0"), logged)
    same(tensorboard_metrics(root / "version_0"), as_float32(logged))  # TensorBoard's scalars are float32
    finite = {s: {k: v for k, v in m.items() if k != "user/inf"} for s, m in logged.items()}
    wandb = wandb_metrics(root / "version_0")
    same({s: {k: v for k, v in m.items() if k != "user/inf"} for s, m in wandb.items()}, finite)
    assert all(m["user/inf"] in (math.inf, "Infinity", "inf") for s, m in wandb.items() if "user/inf" in m)
    # train/loss is the global-batch mean the trainer computed for that step
    assert [logged[s]["train/loss"] for s in (2, 4, 6)] == [trainer.progress.history[s - 1]["loss"] for s in (2, 4, 6)]


def test_every_fit_writes_a_new_version_and_never_appends(tmp_path):
    root = tmp_path / "runs"
    loggers = [JSONLLogger(str(root)), CSVLogger(str(root))]  # the same root string: one shared RunDirectory
    for _ in range(2):  # two fits of one Trainer
        trainer, _ = make_trainer(loggers)
        fit(trainer)
    trainer, _ = make_trainer([JSONLLogger(root)])  # and a new logger object for the same root
    fit(trainer)
    assert sorted(p.name for p in root.iterdir()) == ["version_0", "version_1", "version_2"]
    for version in ("version_0", "version_1"):
        jsonl, csv = jsonl_metrics(root / version), csv_metrics(root / version)
        assert sorted(jsonl) == sorted(csv) == [2, 3, 4, 6]  # complete, and only this run's steps
    assert sorted(jsonl_metrics(root / "version_2")) == [2, 3, 4, 6]
    assert not (root / "version_2" / "metrics.csv").exists()
    meta = json.loads((root / "version_1" / "run.json").read_text())
    assert meta["run"] == "version_1" and meta["strategy"]["ownership"] == trainer.ownership.to_dict()
    assert meta["config"]["trainer"] == trainer.settings.model_dump(mode="json")
    assert meta["versions"]["torch"] == torch.__version__


def _claim_versions(root: str, n: int) -> list[str]:
    return [new_version(Path(root)).name for _ in range(n)]


def test_concurrent_runs_never_share_a_version(tmp_path):
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        claimed = pool.starmap(_claim_versions, [(str(tmp_path), 10)] * 4)
    names = [name for chunk in claimed for name in chunk]
    assert len(names) == len(set(names)) == 40
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)


def test_tensorboard_records_the_run_metadata_as_text(tmp_path):
    trainer, _ = make_trainer([TensorBoardLogger(tmp_path)])
    fit(trainer, steps_val=False)
    text = read_text(tmp_path / "version_0" / "tensorboard")
    meta = json.loads(text.strip("`\n"))
    assert meta["strategy"] == {"name": "single", "ownership": trainer.ownership.to_dict()}


def test_metrics_logged_outside_fit_are_refused_with_a_warning(tmp_path):
    trainer, _ = make_trainer([JSONLLogger(tmp_path)])
    with pytest.warns(UserWarning, match="outside fit"):
        trainer.log({"after": 1.0})


@pytest.mark.parametrize(
    "cls,module,extra",
    [
        (TensorBoardLogger, "tensorboard", "tensorboard"),
        (MLflowLogger, "mlflow", "mlflow"),
        (WandbLogger, "wandb", "wandb"),
    ],
)
def test_a_logger_whose_package_is_missing_names_the_extra(tmp_path, monkeypatch, cls, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # how Python marks a package as not importable
    with pytest.raises(unison.ConfigurationError, match=rf"{module!r} package is not installed.*unison\[{extra}\]"):
        cls(tmp_path)


def _write_config(tmp_path: Path, logging: str) -> Path:
    text = (ROOT / "examples" / "tinylm.toml").read_text().split("[logging]")[0]
    config = tmp_path / "c.toml"
    text = f'[imports]\npaths = ["{ROOT}/examples"]\n' + text  # a trust root beyond the config's directory
    config.write_text(text.replace('factory = "tinylm.py', f'factory = "{ROOT}/examples/tinylm.py') + logging)
    return config


def test_config_logging_table_builds_loggers_sharing_one_run(tmp_path):
    config, _ = load_config(
        _write_config(
            tmp_path,
            '[logging]\ndir = "r"\njsonl = true\ncsv = true\n'
            'tensorboard = true\n[logging.wandb]\nproject = "p"\n'
            '[logging.mlflow]\ntracking_uri = "sqlite:///x.db"\n',
        )
    )
    loggers = loggers_from_config(config)
    assert [type(line) for line in loggers] == [MLflowLogger, JSONLLogger, CSVLogger, TensorBoardLogger, WandbLogger]
    runs = {id(line.run) for line in loggers}
    assert len(runs) == 1 and loggers[0].run.config == config.model_dump(mode="json")
    assert loggers[0].tracking_uri == "sqlite:///x.db" and loggers[-1].project == "p"


@pytest.mark.parametrize(
    "logging,match",
    [
        ("[logging]\njsonl = true\n", r"logging.*jsonl write into a run directory.*set dir"),
        ('[logging]\ndir = "r"\njsonll = true\n', r"logging\.jsonll"),
        ('[logging]\ndir = "r"\n[logging.wandb]\nmode = "cloud"\n', r"logging\.wandb\.mode"),
    ],
)
def test_bad_logging_config_is_refused_naming_the_key(tmp_path, logging, match):
    with pytest.raises(unison.ConfigurationError, match=match):
        load_config(_write_config(tmp_path, logging))


def test_missing_logger_package_fails_before_any_worker_starts(tmp_path):
    config = _write_config(tmp_path, '[logging]\ndir = "r"\ntensorboard = true\n')
    # A run whose Python cannot import tensorboard (sys.modules entry None blocks the import).
    code = (
        "import sys; sys.modules['tensorboard'] = None; from unison.cli import main; "
        f"main(['train', {str(config)!r}, '--strategy', 'ddp', '--nproc', '2'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "unison[tensorboard]" in " ".join(out.stdout.split())
    assert "torch.distributed" not in out.stderr and not (tmp_path / "r").exists()


def test_a_resume_continues_its_run_and_a_rerun_makes_a_new_one(tmp_path):
    """A run and its resumed continuation are one series in one version_N; running again starts version_1."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for extra in (["--max-steps", "20"], ["--max-steps", "40", "--resume", "auto"], ["--max-steps", "20"]):
        out = subprocess.run(
            [sys.executable, "-m", "unison.cli", "train", str(ROOT / "examples" / "tinylm.toml"), *extra],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
    root = tmp_path / "runs" / "tinylm"
    assert sorted(p.name for p in root.glob("version_*")) == ["version_0", "version_1"]
    for version, steps in (("version_0", [10, 20, 30, 40]), ("version_1", [10, 20])):
        run = root / version
        jsonl, csv, tb = jsonl_metrics(run), csv_metrics(run), tensorboard_metrics(run)
        # log_every_n_steps = 10 in the example; validation at the end; the resume continued at step 20
        assert sorted(jsonl) == sorted(csv) == sorted(tb) == steps
        assert [row["step"] for row in read_csv(run / "metrics.csv")] == steps  # no step twice
        same(csv, jsonl)
        same(tb, as_float32(jsonl))
        assert {"train/loss", "val/loss", "perf/tokens_per_s"} <= set(jsonl[steps[-1]])
        meta = json.loads((run / "run.json").read_text())
        assert meta["config"]["trainer"]["max_steps"] == steps[-1] and meta["config"]["logging"]["dir"] == "runs/tinylm"
        assert sorted(p.name for p in (run / "checkpoints").glob("step-*"))[-1] == f"step-{steps[-1]:08d}"
    resumed = json.loads((root / "version_0" / "run.json").read_text())
    assert resumed["resumed_from"]["step"] == 20 and [r["step"] for r in resumed["resumes"]] == [20]
    assert json.loads((root / "version_1" / "run.json").read_text())["resumed_from"] is None


def test_trainer_log_from_training_step_reaches_the_loggers_at_logging_steps(tmp_path):
    trainer, recorder = make_trainer([JSONLLogger(tmp_path)], max_steps=4, val_every_n_steps=None)
    calls = []

    def training_step(model, batch):
        inputs, targets = batch
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        calls.append(trainer.global_step)
        trainer.log({"user/step_seen": float(trainer.global_step), "user/loss_tensor": loss.detach()})
        return loss

    trainer.fit(
        TokenModel(),
        token_data(),
        training_step=training_step,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
    )
    logged = recorder.by_step()
    assert sorted(logged) == [2, 4] and calls == [0, 1, 2, 3]
    # the latest value per name goes out with the next logging step's metrics, as a float
    assert logged[2]["user/step_seen"] == 1.0 and logged[4]["user/step_seen"] == 3.0
    assert isinstance(logged[4]["user/loss_tensor"], float)
    same(jsonl_metrics(tmp_path / "version_0"), logged)
