"""Run lifecycle under real torchrun: worker restarts, SIGKILL, SIGTERM/SIGUSR1, kills during a save.

Every job runs ``tests/lifecycle_worlds.py`` (a tiny MLP, AdamW, a checkpoint every step, always
``ckpt_path="auto"``) through ``unison run``, which is torchrun with unison's launcher settings. The
faults are real signals sent at the end of a given step; the final canonical state of a faulted job
is compared bitwise with an uninterrupted job of the same strategy.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from unison.checkpointing.checkpointer import Checkpointer
from unison.checkpointing.manifest import verify
from unison.checkpointing.storage import LocalStorage

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "lifecycle_worlds.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

pytestmark = pytest.mark.distributed


def unison_run(
    tmp: Path,
    name: str,
    *,
    strategy: str = "ddp",
    steps: int = 12,
    restarts: int = 0,
    faults: tuple[str, ...] = (),
    extra: tuple[str, ...] = (),
    timeout: int = 420,
) -> dict[str, Any]:
    """One ``unison run --nproc 2`` job into ``tmp/name``; its exit code, output and result."""
    ckpt, out = tmp / name / "ckpt", tmp / name / "state.pt"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "unison.cli",
        "run",
        "--nproc",
        "2",
        f"--max-restarts={restarts}",
        SCRIPT,
        "--strategy",
        strategy,
        "--steps",
        str(steps),
        "--ckpt",
        str(ckpt),
        "--out",
        str(out),
        *extra,
    ]
    for fault in faults:
        cmd += ["--fault", fault]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    result: dict[str, Any] = {
        "rc": proc.returncode,
        "stderr": proc.stderr,
        "stdout": proc.stdout,
        "ckpt": ckpt,
        "wall_s": time.monotonic() - started,
    }
    if out.exists():
        result["state"] = torch.load(out)
        result.update(json.loads(Path(str(out) + ".json").read_text()))
    return result


def assert_same(run: dict[str, Any], reference: dict[str, Any]) -> None:
    assert run["rc"] == 0, run["stderr"][-3000:]
    # The history holds the steps the last attempt ran (a restarted one resumes mid-run): each equals the
    # uninterrupted run's step of the same number, up to the same last step.
    by_step = {h["step"]: h for h in reference["history"]}
    assert run["history"] and all(h == by_step[h["step"]] for h in run["history"])
    assert run["history"][-1]["step"] == reference["history"][-1]["step"]
    assert run["state"].keys() == reference["state"].keys()
    for k in reference["state"]:
        assert torch.equal(run["state"][k], reference["state"][k]), k  # bitwise, fp32


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted jobs, one per strategy, made on first use."""
    cache: dict[str, dict[str, Any]] = {}
    root = tmp_path_factory.mktemp("reference")

    def get(strategy: str) -> dict[str, Any]:
        if strategy not in cache:
            cache[strategy] = unison_run(root, strategy, strategy=strategy)
            assert cache[strategy]["rc"] == 0, cache[strategy]["stderr"][-3000:]
        return cache[strategy]

    return get


@pytest.mark.timeout(600)
def test_ten_worker_restarts_in_a_row_complete_bitwise(tmp_path, reference):
    """Attempt a (0..9) SIGKILLs rank a % 2 at step a + 2; attempt 10 finishes. Every restart must rendezvous."""
    faults = tuple(f"{a}:{a % 2}:{a + 2}:KILL" for a in range(10))
    run = unison_run(tmp_path, "restarts", restarts=10, faults=faults)
    print(f"10 restarts: {run['wall_s']:.1f} s wall")
    assert run["rc"] == 0, run["stderr"][-3000:]
    assert run["attempt"] == 10  # the job finished in the 11th attempt: all 10 restarts happened
    assert_same(run, reference("ddp"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2"])
def test_sigkill_mid_run_restarts_and_equals_uninterrupted(tmp_path, reference, strategy):
    run = unison_run(tmp_path, strategy, strategy=strategy, restarts=2, faults=("0:1:7:KILL",))
    assert run["attempt"] == 1
    assert_same(run, reference(strategy))
    # The final checkpoint exports to plain weights whatever the strategy's own format.
    weights = tmp_path / "model.safetensors"
    exported = subprocess.run(
        [sys.executable, "-m", "unison.cli", "checkpoint", "export", str(run["ckpt"]), str(weights)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert exported.returncode == 0, exported.stdout + exported.stderr
    from safetensors.torch import load_file

    sys.path.insert(0, str(ROOT / "tests"))
    from lifecycle_worlds import model

    plain = model()
    plain.load_state_dict(load_file(str(weights)))
    assert all(torch.equal(v, run["state"][k]) for k, v in plain.state_dict().items())


@pytest.mark.timeout(600)
def test_restarts_exhausted_exit_nonzero_naming_the_killed_rank_and_the_last_checkpoint_verifies(tmp_path):
    run = unison_run(tmp_path, "exhausted", restarts=1, faults=("*:1:5:KILL",))
    assert run["rc"] == 128 + signal.SIGKILL
    assert "rank 1" in run["stderr"] and "failed first: killed by SIGKILL" in run["stderr"]
    assert "ChildFailedError" not in run["stderr"]  # not torchrun's own report
    latest = Checkpointer(run["ckpt"]).latest()
    assert latest is not None and verify(LocalStorage(), latest).step == 4


@pytest.mark.timeout(600)
def test_sigterm_to_one_rank_stops_every_rank_with_a_checkpoint_and_auto_resume_is_bitwise(tmp_path, reference):
    stopped = unison_run(tmp_path, "term", faults=("0:1:6:TERM",), extra=("--every", "4"))
    assert stopped["rc"] == 75, stopped["stderr"][-3000:]
    assert "stopped on request" in stopped["stderr"]
    # Signalled at the end of step 6, which saves nothing: the ranks agree one step late (without blocking)
    # and both stop after step 7.
    assert verify(LocalStorage(), Checkpointer(stopped["ckpt"]).latest()).step == 7  # rank 0 stopped there too
    resumed = unison_run(tmp_path, "term", extra=("--every", "4"))
    assert_same(resumed, reference("ddp"))


@pytest.mark.timeout(600)
def test_sigusr1_to_the_launcher_reaches_the_workers_and_auto_resume_is_bitwise(tmp_path, reference):
    stopped = unison_run(tmp_path, "usr1", faults=("0:PARENT:5:USR1",), extra=("--every", "4"))
    assert stopped["rc"] == 128 + signal.SIGUSR1, stopped["stderr"][-3000:]
    # The launcher forwards the signal asynchronously: the workers stop after the step they are in when it
    # arrives (5 or a later one), all at the same step, committed there.
    step = verify(LocalStorage(), Checkpointer(stopped["ckpt"]).latest()).step
    assert 5 <= step < 12 and f"stopped by SIGUSR1 after step {step} " in stopped["stderr"], stopped["stderr"][-3000:]
    resumed = unison_run(tmp_path, "usr1", extra=("--every", "4"))
    assert_same(resumed, reference("ddp"))


@pytest.mark.timeout(300)
def test_sigkill_during_a_save_keeps_the_previous_checkpoint_which_resumes(tmp_path):
    """A model large enough (100 MB per checkpoint) that a save takes a while; killed while it writes."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "state.pt"
    args = [
        sys.executable,
        SCRIPT,
        "--strategy",
        "single",
        "--steps",
        "3",
        "--hidden",
        "2048",
        "--layers",
        "3",
        "--ckpt",
        str(ckpt),
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    partial = ckpt / ".step-00000002.partial"
    deadline = time.monotonic() + 240
    while not partial.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert partial.exists(), "the job was not killed while saving"
    assert Checkpointer(ckpt).latest() == ckpt / "step-00000001"
    verify(LocalStorage(), ckpt / "step-00000001")

    resumed = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not partial.exists()  # ignored, then removed
    # (the lease's lock file stays, as flock's guard files do; the lease itself is given back at the end)
    left = sorted(p.name for p in ckpt.iterdir() if p.name != ".unison-lease.guard")
    assert left == ["latest", "step-00000001", "step-00000002", "step-00000003"]
    history = json.loads(Path(str(out) + ".json").read_text())["history"]
    assert [h["step"] for h in history] == [1, 2]  # resumed after step 1, the last commit
    full = subprocess.run(
        [*args[:-4], "--ckpt", str(tmp_path / "full"), "--out", str(tmp_path / "full.pt")],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert full.returncode == 0, full.stderr[-3000:]
    reference, state = torch.load(tmp_path / "full.pt"), torch.load(out)
    assert all(torch.equal(state[k], reference[k]) for k in reference)


@pytest.mark.timeout(120)
def test_a_missing_rank_fails_the_start_within_the_rendezvous_timeout(tmp_path):
    """Rank 1 never comes: rank 0 must fail after UNISON_RENDEZVOUS_TIMEOUT, not after torch's 10 minutes."""
    from unison.launch.torchrun import free_port

    env = {
        **ENV,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "UNISON_RENDEZVOUS_TIMEOUT": "5",
    }
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--ckpt", str(tmp_path / "c"), "--out", str(tmp_path / "o")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode != 0
    assert "timed out" in proc.stderr.lower() or "timeout" in proc.stderr.lower(), proc.stderr[-2000:]
    assert elapsed < 60, elapsed


@contextlib.contextmanager
def _sigint_as_at_a_terminal() -> Iterator[None]:
    """Start children with Ctrl-C handled, as a terminal's foreground job is.

    A shell starts background jobs (``cmd &`` without job control, ``nohup``)
    with SIGINT ignored, and an ignored signal stays ignored across exec: such
    a test run would send a Ctrl-C its child never sees. A handled signal is
    reset to the default on exec, so the child's Python installs its own.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.timeout(400)
def test_ctrl_c_during_a_save_is_an_interrupt_and_the_previous_checkpoint_verifies(tmp_path):
    """SIGINT while DCP writes: the process ends as interrupted (the shell's 130), not as a failed save.

    The signal is sent once the save's ``state`` directory appears; on a loaded
    machine the save can still commit before the signal lands (the run may even
    finish). Such a run proves nothing, so it is repeated (at most six times);
    every other outcome is judged.
    """
    for attempt in range(6):
        ckpt, out = tmp_path / f"ckpt{attempt}", tmp_path / f"state{attempt}.pt"
        args = [sys.executable, SCRIPT, "--strategy", "single", "--steps", "3", "--hidden", "2048", "--layers", "3"]
        args += ["--ckpt", str(ckpt), "--out", str(out)]
        with _sigint_as_at_a_terminal():
            proc = subprocess.Popen(
                args, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
        writing = ckpt / ".step-00000002.partial" / "state"
        deadline = time.monotonic() + 100
        while not writing.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        assert proc.poll() is None, f"the job ended before its second save: {proc.returncode}\n{proc.stderr.read()}"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
        latest = Checkpointer(ckpt).latest()
        if latest is not None and latest.name > "step-00000001":
            continue  # the step-2 save committed before the signal landed (or the run even finished): again
        break  # the signal landed during the save, or something went wrong: judged below
    assert writing.parent.exists(), f"the job was not interrupted while saving (exit {proc.returncode})\n{stderr}"
    # Python ends an uncaught KeyboardInterrupt by SIGINT itself: the shell reports 130.
    assert proc.returncode == -signal.SIGINT, stderr[-3000:]
    assert "KeyboardInterrupt" in stderr and "CheckpointException" not in stderr
    assert Checkpointer(ckpt).latest() == ckpt / "step-00000001"
    assert f"last committed checkpoint: {ckpt / 'step-00000001'}" in stderr  # named, once
    assert stderr.count("last committed checkpoint") == 1
    verify(LocalStorage(), ckpt / "step-00000001")
