"""The lease reads any record defensively, and a live holder on this host is refused at once.

Before, a ``.unison-lease`` whose ``pid`` was ``null`` or ``"1"``, or whose
``heartbeat`` was ``"now"``, crashed every later start with a raw TypeError
(exit 1); a truncated, empty or non-object record was taken over without a
word; a heartbeat of 9e12 or a ttl of 1e308 made a lock that never expired;
and ``unison train --resume auto`` while the same run trained on this host
waited ttl + 5 s (65 s) before it was refused. Now a record that cannot be
judged is taken over with a warning naming what was wrong with it, and a
holder on this host with a live pid is refused in seconds, naming its pid.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import storage_job
import torch

import unison
from unison.checkpointing.checkpointer import Checkpointer
from unison.checkpointing.lease import LEASE, Holder, Lease, LeaseWarning
from unison.checkpointing.storage import LocalStorage

HERE = Path(__file__).resolve().parent
NOW = time.time()
GOOD = {"owner": "o", "run": "r", "host": "elsewhere", "pid": 4242, "started": NOW, "heartbeat": NOW, "ttl": 60.0}


def _with(**fields) -> bytes:
    """A record of this host, heartbeating now (at the call: a module collected long before runs later)."""
    now = time.time()
    return json.dumps({**GOOD, "host": socket.gethostname(), "started": now, "heartbeat": now, **fields}).encode()


ODD = {
    "pid null": (_with(pid=None), "its pid is null"),
    'pid "1"': (_with(pid="1"), 'its pid is "1"'),
    "pid true": (_with(pid=True), "its pid is true"),
    "pid 0": (_with(pid=0), "its pid is 0"),
    "pid 10**40": (_with(pid=10**40), "its pid is 1000"),
    'heartbeat "now"': (_with(heartbeat="now"), 'its heartbeat is "now"'),
    "heartbeat NaN": (_with(heartbeat=float("nan")), "its heartbeat is nan"),
    "heartbeat inf": (_with(heartbeat=float("inf")), "its heartbeat is inf"),
    "heartbeat 9e12": (_with(host="elsewhere", heartbeat=9e12), r"its heartbeat lies \d+ s in the future"),
    "started 9e12": (_with(host="elsewhere", started=9e12), r"its started lies \d+ s in the future"),
    "ttl 1e308": (_with(host="elsewhere", heartbeat=NOW - 100, ttl=1e308), "its ttl of 1e\\+308 s is not above 0"),
    "ttl 0": (_with(host="elsewhere", ttl=0), "its ttl of 0 s"),
    "ttl -1": (_with(host="elsewhere", ttl=-1), "its ttl of -1 s"),
    "no host": (json.dumps({k: v for k, v in GOOD.items() if k != "host"}).encode(), "its host is missing"),
    "truncated": (_with()[:25], r"it is not JSON \(25 bytes"),
    "empty": (b"", "it is empty"),
    "blank": (b" \n", "it is empty"),
    "not UTF-8": (b"\xff\xfe{", "it is not JSON"),
    "a list": (b"[1, 2]", r"it is JSON \[1, 2\], not an object"),
    "a string": (b'"held"', 'it is JSON "held", not an object'),
    "null": (b"null", "it is JSON null, not an object"),
    "deep": (b"[" * 100_000, "it is not JSON"),
}


@pytest.mark.parametrize("name", list(ODD))
def test_a_record_that_cannot_be_judged_is_taken_over_with_a_warning_naming_what_was_wrong(tmp_path, name):
    data, problem = ODD[name]
    (tmp_path / LEASE).write_bytes(data)
    lease = Lease(LocalStorage(), tmp_path)
    assert Holder.parse(data)[0] is None
    assert lease.refuse_if_held() is True  # the read before any process group: nobody live holds it
    with pytest.warns(LeaseWarning, match=rf"took over the stale lease on .*its record is invalid: {problem}"):
        lease.acquire("mine")
    try:
        holder, _ = lease.holder()
        assert holder is not None and holder.owner == lease.owner and holder.pid == os.getpid()
    finally:
        lease.release()
    assert not (tmp_path / LEASE).exists()


def test_valid_records_are_still_judged_by_their_holder():
    # A heartbeat a little ahead (clocks differ) and a day's ttl are valid; extra fields of a newer version too.
    now = time.time()
    for fields in ({"heartbeat": now + 60}, {"ttl": 86_400.0}, {"pid": 7, "comment": "newer"}):
        holder, problem = Holder.parse(json.dumps({**GOOD, "started": now, "heartbeat": now, **fields}).encode())
        assert problem is None and holder is not None and holder.stale(time.time()) is None
        assert holder.describe().endswith("last heartbeat 0 s ago)")


def test_an_odd_record_no_longer_crashes_a_run(tmp_path):
    # Before: TypeError at the start of fit, and at every later start in that directory.
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / LEASE).write_bytes(_with(pid=None))
    trainer = unison.Trainer(
        strategy="single", global_batch_size=8, max_steps=2, checkpoint_dir=str(root), progress="off", loggers=False
    )
    with pytest.warns(LeaseWarning, match="its pid is null"):
        trainer.fit(
            storage_job.model,
            storage_job.datasets()[0],
            loss_fn=storage_job.loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
        )
    assert [c.manifest.step for c in Checkpointer(root).committed()] == [2] and not (root / LEASE).exists()


def test_a_live_holder_on_this_host_is_refused_at_once_even_for_its_own_run(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / LEASE).write_bytes(_with(pid=holder.pid, run="r"))
        lease = Lease(LocalStorage(), tmp_path)
        start = time.monotonic()
        for attempt in (lambda: lease.refuse_if_held(own_run="r"), lambda: lease.acquire("r", own_run=True)):
            with pytest.raises(unison.ConfigurationError, match=rf"pid {holder.pid} on host {socket.gethostname()}"):
                attempt()
        assert time.monotonic() - start < 10.0  # before: acquire waited ttl + 5 s (65 s)
    finally:
        holder.kill()
        holder.wait()


def test_resume_auto_while_the_same_run_trains_here_is_refused_at_once(tmp_path):
    ckpt = tmp_path / "ckpt"
    (tmp_path / "storage_job.py").write_text((HERE / "storage_job.py").read_text())
    config = tmp_path / "run.toml"
    config.write_text(storage_job.config(str(ckpt), max_steps=400, every=2, slow=0.1))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "unison.cli", "train", str(config)]
    job = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        checkpointer, deadline = Checkpointer(ckpt), time.monotonic() + 120
        while not checkpointer.committed() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert checkpointer.committed() and job.poll() is None, "the first job committed nothing"
        start = time.monotonic()
        second = subprocess.run(
            [*argv, "--resume", "auto"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        took = time.monotonic() - start
        out = " ".join((second.stdout + second.stderr).split())
        assert second.returncode == 2, out
        assert f"pid {job.pid} on host {socket.gethostname()}" in out and "is being written by another job" in out
        assert took < 30, f"refused after {took:.0f} s"  # before: 65 s (the ttl + 5 s wait)
        assert job.poll() is None  # the training run is untouched
    finally:
        job.kill()
        job.wait()
