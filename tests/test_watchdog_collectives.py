"""The watchdog's report says where each rank is in the collective schedule when one is stopped (SIGSTOP).

``tests/ops_worlds.py`` under ``unison run --nproc 2`` (ddp, 2 micro-batches per step, a 10 s stall
timeout): at the end of step 5 (index 4) rank 1 waits two heartbeats, so its last heartbeat carries
its last collective, then stops itself. Rank 0 goes on into step index 5 and blocks in the gradient
all-reduce of its last micro-step (DDP's reducer, inside ``backward``). The report of rank 0 must name
both ranks' last collectives (operation, group, step, micro-step); rank 1, continued by rank 0's
watchdog, names its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from unison.errors import EXIT_STALLED

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "ops_worlds.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def kill_leftovers(out: Path) -> list[int]:
    """Continue and kill any rank of this job still running; the pids that were."""
    alive = []
    for pid_file in out.parent.glob(out.name + ".pid-*"):
        pid = int(pid_file.read_text())
        with contextlib.suppress(OSError):
            if b"ops_worlds.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                alive.append(pid)
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
    return alive


@pytest.mark.distributed
def test_a_stopped_rank_s_report_names_each_rank_s_last_collective(tmp_path):
    out = tmp_path / "job"
    cmd = [sys.executable, "-m", "unison.cli", "run", "--nproc", "2", SCRIPT, "--steps", "12", "--stall", "10"]
    cmd += ["--freeze", "1:5", "--out", str(out)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
        err = proc.stderr
        assert proc.returncode == EXIT_STALLED, err[-4000:]
        assert (tmp_path / "job.frozen").exists()
        report0 = next((line for line in err.splitlines() if line.startswith("unison: rank 0: stalled rank 1")), None)
        assert report0 is not None, err[-4000:]
        # Rank 0 waits in step 5's gradient all-reduce (the second micro-step's backward); rank 1 last
        # entered step 4's replica loss reduction, after its backward.
        assert (
            "last collective entered: rank 0 (this one): backward (gradient sync) on world (gloo) at step 5, "
            "micro-step 1 (forward_backward); rank 1: all_reduce on world (gloo) at step 4, micro-step 1 "
            "(optimizer_step)"
        ) in report0, report0
        report1 = next((line for line in err.splitlines() if line.startswith("unison: rank 1: rank 1 was frozen")), "")
        assert "its last collective entered: all_reduce on world (gloo) at step 4, micro-step 1" in report1, err[-4000:]
        assert kill_leftovers(out) == [], "a rank outlived the job"
    finally:
        kill_leftovers(out)
