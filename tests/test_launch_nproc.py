"""``Trainer(nproc=N)`` run as ``python train.py`` starts its own workers, or refuses naming the command.

Real jobs of ``tests/launch_nproc_worlds.py`` (ddp on gloo, a tiny MLP, 6 steps): ``python script.py`` with
``nproc=2`` trains a world of 2 whose final weights equal those of ``unison run --nproc 2`` of the same script;
without ``nproc`` and without a launcher the one-process run says so; where there is no script to re-run, or
``nproc`` disagrees with the launcher, the refusal names the fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "launch_nproc_worlds.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

pytestmark = pytest.mark.distributed


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=180)


@pytest.mark.timeout(300)
def test_python_script_with_nproc_2_trains_a_world_of_2_equal_to_unison_run(tmp_path):
    own, launched = tmp_path / "own.pt", tmp_path / "launched.pt"
    job = run(SCRIPT, str(own), "2")
    assert job.returncode == 0, job.stderr[-3000:]
    reference = run("-m", "unison.cli", "run", "--nproc", "2", SCRIPT, str(launched))
    assert reference.returncode == 0, reference.stderr[-3000:]
    a, b = torch.load(own), torch.load(launched)
    assert a["world_size"] == b["world_size"] == 2
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        torch.testing.assert_close(a["state"][k], b["state"][k], rtol=1.3e-6, atol=1e-6)  # fp32 round-off
    assert "trains in 1 process" not in job.stderr


@pytest.mark.timeout(300)
def test_a_distributed_strategy_without_launcher_or_nproc_says_it_trains_one_process(tmp_path):
    job = run(SCRIPT, str(tmp_path / "one.pt"))
    assert job.returncode == 0, job.stderr[-3000:]
    assert torch.load(tmp_path / "one.pt")["world_size"] == 1
    notice = [line for line in job.stderr.splitlines() if "trains in 1 process" in line]
    assert len(notice) == 1 and "nproc=N" in notice[0] and "unison run --nproc N" in notice[0], job.stderr


@pytest.mark.timeout(300)
def test_nproc_without_a_script_refuses_with_the_unison_run_command():
    job = run("-c", "import unison; unison.Trainer(strategy='ddp', nproc=2, max_steps=1)")
    assert job.returncode == 1
    assert "ConfigurationError: nproc:" in job.stderr and "`unison run --nproc 2 train.py`" in job.stderr, job.stderr


@pytest.mark.timeout(300)
def test_nproc_disagreeing_with_the_launcher_exits_2_before_training(tmp_path):
    job = run("-m", "unison.cli", "run", "--nproc", "2", SCRIPT, str(tmp_path / "x.pt"), "3")
    assert job.returncode == 2, job.stderr[-3000:]
    assert job.stderr.count("nproc=3 but the launcher started 2 process(es) on this node") == 1, job.stderr
    assert not (tmp_path / "x.pt").exists()
