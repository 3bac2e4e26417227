"""Run directories (``root_dir``): a version per fresh fit, resume in place, default metrics, fit's result."""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path

import pytest
import torch

import unison
from unison.plugins.loggers import read_csv, read_jsonl
from unison.training.runs import new_version

from helpers import fit, mlp, regression_data


def _claim(root: str, queue) -> None:
    queue.put(new_version(Path(root)).name)


@pytest.mark.timeout(120)
def test_jobs_started_together_never_share_a_version(tmp_path):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_claim, args=(str(tmp_path), queue)) for _ in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    names = [queue.get(timeout=5) for _ in procs]
    assert sorted(names) == [f"version_{n}" for n in range(8)]


def _fit(root: Path, max_steps: int, ckpt_path=None, progress="off", **settings):
    trainer = unison.Trainer(
        strategy="single",
        global_batch_size=16,
        max_steps=max_steps,
        progress=progress,
        root_dir=str(root),
        checkpoint_every_n_steps=2,
        **settings,
    )
    result = fit(trainer, val_dataset=regression_data(n=32, seed=1), ckpt_path=ckpt_path)
    return trainer, result


@pytest.mark.timeout(120)
def test_python_api_runs_get_versions_metrics_by_default_and_resume_in_place(tmp_path, capsys):
    trainer, first = _fit(tmp_path, 4)
    run = tmp_path / "version_0"
    # fit's result: counters, the final metrics, the last checkpoint and the run directory.
    assert (first.global_step, first.optimizer_steps) == (4, 4)
    assert first.run_dir == str(run.absolute()) and first.checkpoint == str(
        run.absolute() / "checkpoints/step-00000004"
    )
    assert first.metrics["val/loss"] == trainer.last_validation["val/loss"]
    assert first.metrics["train/loss"] == trainer.progress.history[-1].loss
    # No loggers given: JSONL and CSV metrics in the run directory.
    assert [r["step"] for r in read_csv(run / "metrics.csv")] == [1, 2, 3, 4]
    assert json.loads((run / "run.json").read_text())["resumed_from"] is None

    _, again = _fit(tmp_path, 4)  # the same fit again: a new run, the first one untouched
    assert again.run_dir == str((tmp_path / "version_1").absolute())
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == [f"step-{s:08d}" for s in (2, 4)]
    assert [r["train/loss"] for r in read_jsonl(tmp_path / "version_1/metrics.jsonl") if "train/loss" in r] == [
        r["train/loss"] for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r
    ]

    # Resume a step-2 checkpoint of version_0: the run continues in version_0, its series replaced after step 2.
    capsys.readouterr()
    step2 = run.absolute() / "checkpoints/step-00000002"
    _, resumed = _fit(tmp_path, 6, ckpt_path=str(step2), progress="plain")
    assert resumed.run_dir == str(run.absolute()) and resumed.global_step == 6
    err = capsys.readouterr().err
    assert f"unison: resuming from step 2: {step2}" in err and f"unison: run directory: {run.absolute()}\n" in err
    steps = [r["step"] for r in read_csv(run / "metrics.csv")]
    assert steps == [1, 2, 3, 4, 5, 6]  # no step twice
    jsonl_steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r]
    assert jsonl_steps == [1, 2, 3, 4, 5, 6]
    meta = json.loads((run / "run.json").read_text())
    assert meta["resumed_from"] == {"step": 2, "checkpoint": str(step2)} and len(meta["resumes"]) == 1

    # "auto": the newest run (highest version) holding a checkpoint, continued in place.
    _, auto = _fit(tmp_path, 8, ckpt_path="auto")
    assert auto.run_dir == str((tmp_path / "version_1").absolute()) and auto.global_step == 8
    assert sorted(p.name for p in tmp_path.glob("version_*")) == ["version_0", "version_1"]


@pytest.mark.timeout(60)
def test_root_dir_in_object_storage_and_last_without_runs_are_refused_before_training(tmp_path):
    with pytest.raises(unison.ConfigurationError, match=r"root_dir.*object storage.*checkpoint_dir"):
        unison.Trainer(global_batch_size=16, max_steps=2, root_dir="s3://bucket/runs")
    with pytest.raises(unison.ConfigurationError, match=r"ckpt_path.*'last' but no run under"):
        _fit(tmp_path, 2, ckpt_path="last")
    assert not list(tmp_path.glob("version_*"))


@pytest.mark.timeout(60)
def test_a_launcher_refuses_a_foreign_checkpoint_dir_once_before_any_worker(tmp_path):
    import subprocess

    ckpt = tmp_path / "ckpt"
    unison.Trainer(global_batch_size=16, max_steps=2, progress="off", checkpoint_dir=str(ckpt)).fit(
        mlp(), regression_data(n=32), loss_fn=torch.nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, 0.1)
    )
    root = Path(__file__).resolve().parents[1]
    text = (root / "examples" / "tinylm.toml").read_text()
    text = text.replace('factory = "tinylm.py', f'factory = "{root}/examples/tinylm.py')
    text = f'[imports]\npaths = ["{root}/examples"]\n' + text  # a trust root beyond the config's directory
    text = text.replace('root_dir = "runs/tinylm"', f'checkpoint_dir = "{ckpt}"')
    config = tmp_path / "c.toml"
    config.write_text(text.replace('dir = "runs/tinylm"', f'dir = "{tmp_path}/logs"'))
    out = subprocess.run(
        [sys.executable, "-m", "unison.cli", "train", str(config), "--strategy", "ddp", "--nproc", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = out.stdout + out.stderr
    assert out.returncode == 2 and " ".join(said.split()).count("committed checkpoint(s) of another run") == 1, said
    assert "torch.distributed" not in said and not (tmp_path / "logs").exists()
