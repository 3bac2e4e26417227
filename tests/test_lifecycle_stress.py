"""Clean exits: every built-in strategy finishes 3 consecutive 2-rank runs with exit code 0 on every rank.

Why this exists: finished runs used to end with ``terminate called without an active exception``
(SIGABRT) in one rank now and then, under strategies whose process groups outlive
``destroy_process_group`` (see ``unison.launch.lifecycle.drain_collective_threads``). The two ranks are
started as plain processes with torchrun's ``env://`` variables, so each rank's own exit code is
observed. The teardown path is shared by the strategies, so the repetitions add up over them (three runs
each: 42 process pairs for the 14 strategies available here). Costly by nature; marked ``stress``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import unison
from unison.launch.torchrun import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "lifecycle_worlds.py")
RUNS = 3

STRATEGIES = [s.name for s in unison.PluginManager().strategies.specs() if s.unavailable is None and s.name != "single"]

pytestmark = [pytest.mark.distributed, pytest.mark.stress]


def two_ranks(strategy: str, directory: Path) -> list[tuple[int, str]]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
        }
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    SCRIPT,
                    "--strategy",
                    strategy,
                    "--steps",
                    "3",
                    "--accumulate",
                    "2",
                    "--every",
                    "100",
                    "--ckpt",
                    str(directory / "ckpt"),
                    "--out",
                    str(directory / "state.pt"),
                ],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    out = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        out.append((proc.returncode, err))
    return out


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_three_finished_runs_exit_zero_on_every_rank(tmp_path, strategy):
    for run in range(RUNS):
        results = two_ranks(strategy, tmp_path / str(run))
        for rank, (code, err) in enumerate(results):
            assert code == 0, f"run {run + 1}/{RUNS}, rank {rank} exited {code}:\n{err[-3000:]}"
        assert (tmp_path / str(run) / "state.pt").exists()
