"""Metrics by default: a Trainer without ``root_dir`` or loggers writes ``runs/NAME/version_N``; ``loggers=False``
writes nothing; info lines (run directory, resume) follow ``progress``; files are read back."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import unison
from unison.plugins.loggers import read_csv, read_jsonl
from unison.training.runs import DEFAULT_ROOT_ENV, run_name

from helpers import fit

pytestmark = pytest.mark.timeout(120)


def _fit(steps: int, ckpt_path=None, **settings):
    trainer = unison.Trainer(strategy="single", global_batch_size=16, max_steps=steps, **settings)
    result = fit(trainer, ckpt_path=ckpt_path)
    return trainer, result


def _train_losses(path: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["train/loss"]) for r in read_jsonl(path / "metrics.jsonl") if "train/loss" in r]


@pytest.fixture
def script_in(tmp_path, monkeypatch):
    """This test as `python train.py` run in an empty working directory, with no runs root configured."""
    monkeypatch.delenv(DEFAULT_ROOT_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "scripts" / "train.py")])
    return tmp_path


def test_a_fit_without_root_dir_or_loggers_writes_runs_name_version_n_in_the_working_directory(script_in, capsys):
    trainer, result = _fit(5, progress="plain")
    run = script_in / "runs" / "train" / "version_0"
    err = capsys.readouterr().err
    assert err.count("unison: run directory:") == 1 and f"unison: run directory: {run}\n" in err
    assert result.run_dir == str(run) and result.checkpoint is None  # metrics only: checkpoints stay opt-in
    assert sorted(p.name for p in run.iterdir()) == ["metrics.csv", "metrics.jsonl", "run.json"]
    losses = _train_losses(run)
    assert [s for s, _ in losses] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in read_csv(run / "metrics.csv")] == [1, 2, 3, 4, 5]
    assert [r["train/loss"] for r in read_csv(run / "metrics.csv")] == [v for _, v in losses]
    # fit's result holds the final metrics: the values the files hold, and the trainer's last step.
    assert result.metrics["train/loss"] == losses[-1][1] == trainer.progress.history[-1].loss
    meta = json.loads((run / "run.json").read_text())
    assert meta["run"] == "version_0" and meta["config"]["trainer"]["root_dir"] is None

    _, again = _fit(2, progress="off")  # the next fit: the next version; progress="off" prints no info line
    assert again.run_dir == str(script_in / "runs" / "train" / "version_1")
    assert "run directory" not in capsys.readouterr().err
    assert sorted(p.name for p in (script_in / "runs").iterdir()) == ["train"]
    assert [s for s, _ in _train_losses(run)] == [1, 2, 3, 4, 5]  # the first run untouched


def test_loggers_false_writes_no_run_directory_and_prints_none(script_in, capsys, monkeypatch):
    elsewhere = script_in / "elsewhere"
    monkeypatch.setenv(DEFAULT_ROOT_ENV, str(elsewhere))
    trainer, result = _fit(3, progress="plain", loggers=False)
    assert list(script_in.iterdir()) == [] and not elsewhere.exists()  # nothing written anywhere
    assert result.run_dir is None and "run directory" not in capsys.readouterr().err
    assert result.metrics["train/loss"] == trainer.progress.history[-1].loss  # the result still holds them
    with pytest.raises(unison.ConfigurationError, match=r"loggers: True is not a list of loggers.*loggers=False"):
        unison.Trainer(max_steps=1, loggers=True)
    # A default root that cannot be made is refused at construction, naming the ways around it.
    (script_in / "a-file").write_text("")
    monkeypatch.setenv(DEFAULT_ROOT_ENV, str(script_in / "a-file" / "runs"))
    with pytest.raises(
        unison.ConfigurationError,
        match=r"loggers: the run directory .*a-file is not a writable directory.*UNISON_RUNS_ROOT",
    ):
        unison.Trainer(max_steps=1)
    unison.Trainer(max_steps=1, loggers=False)  # no metric files: nothing to refuse


def test_the_runs_root_variable_and_a_resume_from_checkpoint_dir(script_in, capsys, monkeypatch):
    shared = script_in / "scratch"
    monkeypatch.setenv(DEFAULT_ROOT_ENV, str(shared))
    ckpt = script_in / "ckpt"
    _, first = _fit(4, progress="off", checkpoint_dir=str(ckpt), checkpoint_every_n_steps=2)
    assert first.run_dir == str(shared / "train" / "version_0") and not (script_in / "runs").exists()
    assert first.checkpoint == str(ckpt / "step-00000004")
    capsys.readouterr()

    # A resume under progress="off" says nothing (the suite's runs); the series goes on after the resumed step.
    _, quiet = _fit(6, ckpt_path=str(ckpt / "step-00000004"), progress="off", checkpoint_dir=str(ckpt))
    assert capsys.readouterr().err == ""
    resumed = Path(quiet.run_dir)
    assert resumed == shared / "train" / "version_1" and quiet.global_step == 6
    assert [s for s, _ in _train_losses(resumed)] == [5, 6]  # no step twice: it starts after step 4
    assert [r["step"] for r in read_csv(resumed / "metrics.csv")] == [5, 6]
    assert json.loads((resumed / "run.json").read_text())["resumed_from"]["step"] == 4

    _, loud = _fit(8, ckpt_path="auto", progress="plain", checkpoint_dir=str(ckpt))
    err = capsys.readouterr().err
    assert err.count(f"unison: resuming from step 6: {ckpt / 'step-00000006'}") == 1
    assert f"unison: run directory: {shared / 'train' / 'version_2'}" in err
    assert [s for s, _ in _train_losses(Path(loud.run_dir))] == [7, 8]


def test_run_names_follow_the_script():
    assert run_name("/home/me/exp/train.py") == "train"
    assert run_name("/home/me/pkg/__main__.py") == "pkg"  # python -m pkg
    assert run_name("-c") == run_name("") == run_name("/x/ipykernel_launcher.py") == "unison"


SCRIPT = """
import os

import torch
import unison
from torch.utils.data import TensorDataset

if __name__ == "__main__":
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    trainer = unison.Trainer(
        strategy="ddp", nproc=2, accelerator="cpu", global_batch_size=16, max_steps=4, progress="plain"
    )
    result = trainer.fit(
        torch.nn.Linear(8, 1),
        TensorDataset(x, x.sum(dim=1, keepdim=True)),
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
    with open(f"rank{os.environ['RANK']}.txt", "w") as f:  # a file per rank: their stdout lines interleave
        f.write(f"{result.run_dir} {result.metrics['train/loss']!r}")
"""


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_world_of_2_started_by_python_train_py_makes_one_version_written_by_rank_0(tmp_path):
    import os
    import subprocess

    (tmp_path / "train.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != DEFAULT_ROOT_ENV} | {"OMP_NUM_THREADS": "1"}
    job = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert job.returncode == 0, job.stderr[-3000:]
    run = tmp_path / "runs" / "train" / "version_0"
    assert sorted(p.name for p in (tmp_path / "runs" / "train").iterdir()) == ["version_0"]
    assert job.stderr.count("unison: run directory:") == 1 and f"unison: run directory: {run}" in job.stderr
    losses = _train_losses(run)
    assert [s for s, _ in losses] == [1, 2, 3, 4]
    assert [r["step"] for r in read_csv(run / "metrics.csv")] == [1, 2, 3, 4]
    said = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert said[0] == f"{run} {losses[-1][1]!r}"  # the final metrics fit returned: the file's last loss
    assert said[1].startswith("None ")  # only rank 0 writes (and names) the run directory
