"""Two ``fit`` calls in one worker under plain ``torchrun``, which shares its rendezvous store with the workers.

Each fit used to make and destroy its own process group; the second rendezvous read the first group's
addresses from torchrun's shared store and failed (Gloo "Connection refused", or a hang), in 1 to 3 of
4 runs. The group unison makes under a launcher now lives until the process exits, and the second fit
joins it. Three runs of ``tests/two_fits_worlds.py`` (2 ranks, ddp, two fits at two learning rates),
each under a subprocess timeout, all end with exit 0 and both fits trained.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.mark.distributed
def test_two_fits_in_one_worker_under_plain_torchrun_three_runs(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # plain torchrun: the shared store, as users run it
    for run in range(3):
        out = tmp_path / f"run{run}.json"
        cmd = [str(TORCHRUN), "--nproc-per-node", "2", str(HERE / "two_fits_worlds.py"), str(out)]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, text=True, start_new_session=True, **pipes)
        try:
            _, err = proc.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers
            _, err = proc.communicate()
            pytest.fail(f"run {run} hung past 150 s: {err[-3000:]}")
        assert proc.returncode == 0, f"run {run}: {err[-4000:]}"
        result = json.loads(out.read_text())
        assert result["world_size"] == 2 and len(result["losses"]) == 2, result
        assert result["losses"][0] != result["losses"][1]  # two fits, two learning rates, both trained
