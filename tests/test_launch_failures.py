"""``unison run`` reports the first real failure of a job, once, with its exit code.

Each case of ``tests/launch_failures_worlds.py`` is a real 2-process ``unison run --nproc 2`` job (gloo, a tiny
MLP) that fails on cue. What every report must get right:
the rank that failed first, the cause, the exit code, the message printed once, and never torchrun's own
SIGTERM to the surviving workers presented as a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unison.errors import EXIT_CONFIGURATION, EXIT_FAILED, EXIT_STALLED

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "launch_failures_worlds.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

pytestmark = pytest.mark.distributed

#: case -> (exit code, rank that failed first, text its line must hold, text printed exactly once or None)
EXPECTED = {
    "config_rank1": (
        EXIT_CONFIGURATION,
        1,
        "configuration error",
        "max_step: unknown option (did you mean 'max_steps'?)",
    ),
    "raise_rank1": (EXIT_FAILED, 1, "ValueError", "ValueError: loss exploded on rank 1"),
    "callback_rank1": (EXIT_FAILED, 1, "RuntimeError", "RuntimeError: callback bug on rank 1"),
    "sigkill_rank1": (137, 1, "killed by SIGKILL", None),
    "stall_rank1": (EXIT_STALLED, 1, "stalled", None),
    "dataloader_exit": (EXIT_FAILED, 1, "RuntimeError", "DataLoader worker (pid"),
    "pipeline_refusal": (EXIT_CONFIGURATION, None, "configuration error", "splits an nn.Sequential into stages"),
}


@pytest.fixture(scope="module")
def jobs() -> dict[str, subprocess.CompletedProcess]:
    """Every case's job, one after the other."""
    started = time.monotonic()
    done: dict[str, subprocess.CompletedProcess] = {}
    for case in EXPECTED:  # one job at a time: a loaded machine delays a rank's record behind its peer's fallout
        done[case] = subprocess.run(
            [sys.executable, "-m", "unison.cli", "run", "--nproc", "2", SCRIPT, case],
            cwd=ROOT,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
    print(f"{len(done)} failing jobs: {time.monotonic() - started:.1f} s wall")
    return done


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(EXPECTED))
def test_first_real_failure_is_reported_once_with_its_exit_code(jobs, case):
    code, rank, cause, once = EXPECTED[case]
    job = jobs[case]
    report = job.stderr
    assert job.returncode == code, report[-3000:]
    first = [line for line in report.splitlines() if "failed first" in line]
    assert len(first) == 2, report[-3000:]  # the headline and the rank's line
    assert first[0].startswith("unison run: rank ") and f"exits with code {code}" in first[0]
    if rank is not None:
        assert f"rank {rank} failed first" in first[0] and f"  rank {rank} (pid " in first[1], report[-3000:]
    assert cause in first[1], report[-3000:]
    if once is not None:
        # Counted from the last exception on: torch may chain a cause that says it too (the DataLoader's
        # SIGCHLD handler raises "DataLoader worker (pid N) exited", then "(pid(s) N) exited" from it).
        last = report.rsplit("The above exception was the direct cause of the following exception:", 1)[-1]
        assert last.count(once) == 1, report[-3000:]
    # torchrun's SIGTERM to the survivor is named as what it is, never as a failure; torch's own error log
    # and per-rank tracebacks are replaced by this one report.
    assert "SIGTERM" not in report, report[-3000:]
    other = [line for line in report.splitlines() if line.startswith("  rank ") and "failed first" not in line]
    assert len(other) == 1, report[-3000:]  # the survivor: stopped by the launcher, or its own consequence
    assert "ChildFailedError" not in report and "[rank0]" not in report and "[rank1]" not in report
    assert report.count("unison run: ") == 1  # one report (a traceback in it may chain its causes)


@pytest.mark.timeout(300)
def test_a_configuration_error_on_one_rank_prints_only_the_message(jobs):
    report = jobs["config_rank1"].stderr
    assert "Traceback" not in report, report
    assert "error: max_step: unknown option (did you mean 'max_steps'?). Fix: remove or rename it" in report


def test_an_error_record_cut_short_leaves_no_file_for_the_agent_to_misread(tmp_path, monkeypatch):
    # torchrun's agent parses a failed worker's error file; one cut short (the worker killed mid-write after a
    # peer died) made the agent fail on the JSON and end a job it should have restarted.
    import json

    from unison.launch import lifecycle

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    real_dump = json.dump

    def cut_short(data, f):
        f.write('{"message": {"mess')
        f.flush()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(json, "dump", cut_short)
    assert lifecycle.record_error(ValueError("first")) is False
    assert list(tmp_path.iterdir()) == []  # neither the file nor its partial copy
    monkeypatch.setattr(json, "dump", real_dump)
    assert lifecycle.record_error(ValueError("second")) is True
    assert json.loads(path.read_text())["message"]["message"] == "ValueError: second"
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]
