"""The stall watchdog: its detection logic, heartbeat threads on real c10d stores, and a frozen rank under torchrun.

The end-to-end test runs ``tests/watchdog_worlds.py`` (a tiny MLP, DDP on 2 gloo ranks, a checkpoint
every 4 steps, ``ckpt_path="auto"``) through ``unison run``; rank 1 stops itself with SIGSTOP at the end
of step 7, and the job must end within 40 s with exit code 3, the stalled rank named and stacks printed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import unison
from unison.checkpointing.checkpointer import Checkpointer
from unison.errors import EXIT_STALLED, ConfigurationError
from unison.launch.torchrun import free_port
from unison.launch.watchdog import StallDetector, Watchdog, heartbeat_interval

from helpers import mlp, regression_data

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "watchdog_worlds.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


# --------------------------------------------------------------------------- #
# Detection logic
# --------------------------------------------------------------------------- #
def beat(n: int, step: int = 0, phase: str = "forward_backward", state: str = "running") -> dict[str, Any]:
    return {"beat": n, "step": step, "phase": phase, "state": state}


def test_a_heartbeat_that_stops_is_found_and_a_slow_rank_is_not():
    det = StallDetector(world_size=3, stall_timeout_s=10.0, now=0.0)
    for t in range(0, 30):  # 30 s: rank 1 beats but stays in one step (slow); rank 2 stops beating at t=5
        det.observe(1, beat(t, step=3), now=float(t))
        if t <= 5:
            det.observe(2, beat(t, step=4, phase="checkpoint"), now=float(t))
        expected = [2] if t >= 15 else []
        assert det.stalled(float(t), ranks=[1, 2]) == expected, t
    assert det.silent_for(2, 29.0) == 24.0
    assert det.where(2) == "step 4 (checkpoint)" and det.where(1) == "step 3 (forward_backward)"


def test_a_rank_never_heard_from_counts_from_the_start_and_a_finished_rank_is_never_stalled():
    det = StallDetector(world_size=2, stall_timeout_s=5.0, now=100.0)
    assert det.stalled(104.9) == []
    assert det.stalled(105.0) == [0, 1]
    det.observe(0, beat(1, step=9, phase="fit_end", state="done"), now=105.0)
    assert det.stalled(200.0) == [1]


def test_the_interval_is_a_tenth_of_the_timeout_within_bounds():
    assert heartbeat_interval(20) == 2.0 and heartbeat_interval(1) == 0.5 and heartbeat_interval(300) == 5.0


# --------------------------------------------------------------------------- #
# Heartbeat threads on real stores
# --------------------------------------------------------------------------- #
class Reports:
    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []

    def __call__(self, report: str) -> None:
        self.lines.append((time.monotonic(), report))


@pytest.mark.timeout(60)
def test_threads_on_a_store_find_the_rank_whose_heartbeat_stops_but_not_a_slow_or_finished_one():
    store = dist.HashStore()
    reports = [Reports(), Reports(), Reports()]
    dogs = [Watchdog(1.0, r, 3, store=store, prefix="t", on_stall=reports[r], interval=0.1).start() for r in range(3)]
    dogs[1].mark(3, "forward_backward")  # rank 1 is slow: 2.5 timeouts in one phase of one step
    dogs[2].mark(5, "step_end")
    time.sleep(2.5)
    assert all(not r.lines for r in reports)
    dogs[2].stop()  # rank 2 finishes: never blamed
    time.sleep(1.5)
    assert all(not r.lines for r in reports)
    # Rank 1's heartbeat stops (its thread ends without saying it is done): rank 0 names it within the timeout.
    stopped_at = time.monotonic()
    dogs[1]._stop.set()
    dogs[1]._thread.join()
    deadline = stopped_at + 5
    while not reports[0].lines and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reports[0].lines, "rank 0 did not find the stopped heartbeat"
    when, line = reports[0].lines[0]
    # Rank 0 counts the silence from the last beat it saw, written up to one interval before the stop:
    # it never blames before a whole timeout of silence, and blames within a few intervals of it.
    silent = float(re.search(r"rank 1[^:]*: no heartbeat for ([0-9.]+) s", line).group(1))
    assert silent >= 1.0, line
    assert 1.0 - 2 * 0.1 <= when - stopped_at <= 1.0 + 3 * 0.1 + 0.5
    assert line.startswith(f"stalled rank 1 (pid {os.getpid()} on ")
    assert "its last one at step 3 (forward_backward)" in line and "rank 0 (this one) at step 0 (setup)" in line
    assert dogs[0]._thread is not None
    dogs[0]._thread.join(timeout=2)  # the thread ends after reporting
    assert not dogs[0]._thread.is_alive()
    assert not reports[1].lines and not reports[2].lines


@pytest.mark.timeout(90)
def test_a_frozen_store_host_is_named(tmp_path, monkeypatch):
    """The rendezvous store lives in rank 0's process: when it freezes, the store stops answering."""
    port = free_port()
    host = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, torch.distributed as d\n"
            f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False)\n"
            "print('up', flush=True)\ntime.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    dog = None
    try:
        assert host.stdout.readline().strip() == "up"
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        reports, host_reports = Reports(), Reports()
        dog = Watchdog(2.0, 1, 2, on_stall=reports, interval=0.2).start()  # store=None: its own client
        # Rank 0's heartbeat, from a client of its own (its process is not the one that freezes here).
        dog0 = Watchdog(2.0, 0, 2, on_stall=host_reports, interval=0.2).start()
        time.sleep(1.0)
        assert not reports.lines
        host.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        while not reports.lines and time.monotonic() < stopped_at + 15:
            time.sleep(0.05)
        assert reports.lines, "the frozen store host was not named"
        when, line = reports.lines[0]
        assert 2.0 - 0.2 - 0.3 <= when - stopped_at <= 6.0  # counted from its last answer, up to an interval before
        assert line.startswith(f"rank 0 stalled: the control-plane store it hosts (127.0.0.1:{port}) has not answered")
        assert "rank 1 (this one) at step 0 (setup); rank 0's last heartbeat at step 0 (setup)" in line
    finally:
        if dog is not None:
            dog._stop.set()
            dog0._stop.set()
        host.send_signal(signal.SIGCONT)
        host.kill()
        host.wait()


def test_a_woken_store_host_is_reported_where_it_froze_not_by_a_stale_or_later_beat(monkeypatch):
    """After SIGCONT, the woken store's first answer for rank 0's heartbeat key can be a beat from before
    the freeze that rank 1 never read (here: step 0, setup). The peer reports the record rank 0 publishes
    on waking, under its woke key (step 6), and falls back to the newer beat only when none comes."""
    import unison.launch.watchdog as watchdog_module

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    dog = Watchdog(2.0, 1, 2, store=store, interval=0.2)
    dog._detector = StallDetector(2, 2.0, time.monotonic())
    host = Watchdog(2.0, 0, 2, store=store, interval=0.2)
    host._publish("running")  # beat 1, read by rank 1
    dog._detector.observe(0, json.loads(store.get(dog._key(0))), time.monotonic())
    host._publish("running")  # beat 2, just before the freeze: never read by rank 1
    monkeypatch.setattr(watchdog_module, "FRESH_WAIT_S", 0.6)
    assert dog._fresh_record(0)["beat"] == 2  # no woke record: the newer beat
    host._publish("running", at=((6, "forward_backward"), None), key=host._woke_key(0))
    record = dog._fresh_record(0)
    assert (record["step"], record["phase"]) == (6, "forward_backward")


FROZEN_THEN_ENDING = """
import json, os, signal, sys, time
import torch.distributed as dist
from unison.launch.watchdog import Watchdog
store = dist.HashStore()
# Rank 1 has finished: it is never blamed, so only this process's own freeze can be found.
store.set("w/1", json.dumps({"beat": 1, "step": 9, "phase": "fit_end", "state": "done"}))
events = []
dog = Watchdog(2.0, 0, 2, store=store, prefix="w", interval=0.2, on_stall=lambda r: events.append("report: " + r))
dog.start()
dog.mark(5, "step_end")
time.sleep(0.5)
os.kill(os.getpid(), signal.SIGSTOP)  # the training thread stops its process; the test continues it
dog.mark(6, "forward_backward")  # the training thread goes on at once after SIGCONT...
events.append("marked step 6")
dog.stop()  # ...and ends its fit
events.append("stopped")
print(json.dumps(events))
"""


@pytest.mark.timeout(60)
def test_a_continued_process_judges_its_own_freeze_before_its_training_thread_goes_on():
    """After SIGCONT every thread of a frozen rank runs again, the training thread first as often as not. Its
    next mark, or the end of its fit, waits for the watchdog's judgement: the freeze is reported (where it
    froze) before training goes on, and a fit that ends right after waking cannot end it unreported."""
    proc = subprocess.Popen([sys.executable, "-c", FROZEN_THEN_ENDING], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
            assert time.monotonic() < deadline and proc.poll() is None, "the process never stopped"
            time.sleep(0.02)
        time.sleep(3.0)  # frozen for longer than the 2 s stall timeout
        proc.send_signal(signal.SIGCONT)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    events = json.loads(out.strip().splitlines()[-1])
    assert len(events) == 3 and events[1:] == ["marked step 6", "stopped"], events
    assert events[0].startswith("report: rank 0 was frozen for "), events
    assert " at step 5 (step_end)" in events[0], events


# --------------------------------------------------------------------------- #
# Bad input
# --------------------------------------------------------------------------- #
def test_a_stall_timeout_below_one_second_is_refused():
    with pytest.raises(ConfigurationError, match="stall_timeout_s"):
        unison.Trainer(max_steps=1, stall_timeout_s=0.5)


def test_a_stall_timeout_the_collective_timeout_would_beat_is_refused_before_any_process_group(monkeypatch):
    monkeypatch.setenv("UNISON_COLLECTIVE_TIMEOUT", "60")
    trainer = unison.Trainer(max_steps=1, global_batch_size=8, stall_timeout_s=60)
    with pytest.raises(ConfigurationError, match=r"stall_timeout_s: 60 s is not below the collective timeout \(60 s\)"):
        trainer.fit(
            mlp(),
            regression_data(64),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        )
    assert not trainer.setup_started and not dist.is_initialized()


# --------------------------------------------------------------------------- #
# A frozen rank under torchrun
# --------------------------------------------------------------------------- #
def job(tmp: Path, name: str, *extra: str, timeout: int = 300) -> dict[str, Any]:
    """One ``unison run --nproc 2`` job of watchdog_worlds.py into ``tmp/name``; its exit code, output and result."""
    ckpt, out = tmp / name / "ckpt", tmp / name / "state.pt"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "unison.cli", "run", "--nproc", "2", SCRIPT, "--ckpt", str(ckpt), "--out", str(out)]
    proc = subprocess.run([*cmd, *extra], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    result: dict[str, Any] = {"rc": proc.returncode, "stderr": proc.stderr, "ckpt": ckpt, "ended": time.time()}
    if out.exists():
        result["state"] = torch.load(out)
        result["history"] = json.loads(Path(str(out) + ".json").read_text())["history"]
    frozen = Path(str(out) + ".frozen")
    if frozen.exists():
        result["frozen_at"] = float(frozen.read_text())
    result["pids"] = [int(p.read_text()) for p in out.parent.glob("state.pt.pid-*")]
    return result


def leave_nothing_behind(pids: list[int]) -> list[int]:
    """Continue then kill any of ``pids`` still running this test's script; return those that were."""
    alive = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"watchdog_worlds.py" in cmdline:
            alive.append(pid)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
    return alive


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_sigstopped_rank_ends_the_job_in_seconds_with_code_3_and_auto_resume_is_bitwise(tmp_path):
    pids: list[int] = []
    try:
        stalled = job(tmp_path, "stalled", "--stall", "20", "--freeze", "1:7")
        pids += stalled["pids"]
        err = stalled["stderr"]
        assert stalled["rc"] == EXIT_STALLED, err[-4000:]
        took = stalled["ended"] - stalled["frozen_at"]
        assert took < 40, f"the job ended {took:.1f} s after rank 1 froze"
        # Rank 0 names rank 1 and where both are, then prints its Python stacks: its main thread waits in
        # the gradient all-reduce of step 7 for rank 1 (the stop agreement after step 6 does not block).
        assert "unison: rank 0: stalled rank 1 (pid " in err, err[-4000:]
        assert "rank 0 (this one) at step 7 (forward_backward)" in err
        report0 = err[err.index("unison: rank 0: stalled rank 1") :]
        assert "most recent call first" in report0 and "in forward_backward" in report0
        # Rank 1, continued, says it was frozen (in step 6: it may have moved on to the next phase by the
        # time its watchdog thread runs) and prints its own stacks.
        assert "unison: rank 1: rank 1 was frozen for " in err and "s at step 6 (" in err
        report1 = err[err.index("unison: rank 1: rank 1 was frozen") :]
        assert "Python stacks of rank 1 follow" in report1 and "most recent call first" in report1
        # The launcher's summary: the stall first, with its code.
        assert "failed first: exit code 3: StallError: stalled rank 1" in err
        assert leave_nothing_behind(stalled["pids"]) == [], "a worker outlived the job"

        verified = subprocess.run(
            [sys.executable, "-m", "unison.cli", "checkpoint", "verify", str(stalled["ckpt"])],
            cwd=ROOT,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert Checkpointer(stalled["ckpt"]).latest().name == "step-00000004"

        resumed = job(tmp_path, "stalled", "--stall", "20")  # same directory, ckpt_path="auto"
        pids += resumed["pids"]
        assert resumed["rc"] == 0, resumed["stderr"][-4000:]
        assert [h["step"] for h in resumed["history"]] == list(range(4, 12))

        reference = job(tmp_path, "reference", "--stall", "20")
        pids += reference["pids"]
        assert reference["rc"] == 0, reference["stderr"][-4000:]
        assert resumed["history"] == reference["history"][4:]
        assert resumed["state"].keys() == reference["state"].keys()
        for k in reference["state"]:
            assert torch.equal(resumed["state"][k], reference["state"][k]), k  # bitwise
    finally:
        leave_nothing_behind(pids)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_sigstopped_rank_0_is_continued_and_named_with_its_last_step(tmp_path):
    """Rank 0 hosts the control-plane store: stopped, it silences every heartbeat. Rank 1 names it, continues
    it (SIGCONT) and reports the step its heartbeat gives on waking; rank 0 reports its own freeze; both exit 3
    and no process stays stopped."""
    stalled: dict[str, Any] = {"pids": []}
    try:
        stalled = job(tmp_path, "rank0", "--stall", "10", "--freeze", "0:7", timeout=240)
        err = stalled["stderr"]
        assert stalled["rc"] == EXIT_STALLED, err[-4000:]
        took = stalled["ended"] - stalled["frozen_at"]
        assert took < 35, f"the job ended {took:.1f} s after rank 0 froze"
        report1 = next((line for line in err.splitlines() if line.startswith("unison: rank 1: rank 0 stalled")), "")
        assert "the control-plane store it hosts" in report1, err[-6000:]
        assert "it was a stopped process on this host and was continued (SIGCONT)" in report1
        # The step rank 0 froze at (the end of step 7, the trainer's step 6), not its first heartbeat's.
        assert "rank 0's last heartbeat at step 6 (" in report1, report1
        assert "no heartbeat seen" not in err and "step 0 (setup)" not in report1
        report0 = next((line for line in err.splitlines() if line.startswith("unison: rank 0: rank 0 was frozen")), "")
        assert "at step 6 (" in report0, err[-6000:]
        assert "exit code 3: StallError" in err
        assert leave_nothing_behind(stalled["pids"]) == [], "a worker outlived the job (stopped or running)"
        verified = Checkpointer(stalled["ckpt"]).latest()
        assert verified is not None and verified.name == "step-00000004"
    finally:
        leave_nothing_behind(stalled["pids"])
