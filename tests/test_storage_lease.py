"""One writer per checkpoint directory (unison.checkpointing.lease), on a local directory and on an s3:// prefix.

Two ``unison train`` jobs started together on one directory: exactly one
trains, the other exits 2 naming the owner, and every commit verifies. A
lease left by a SIGKILLed job is taken over by ``--resume auto``. A live
lease refuses a run before any process group; an expired one (another host,
no heartbeat) is taken over with a warning; a finished run gives it back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import s3_server
import storage_job
import torch

import unison
from unison.checkpointing.checkpointer import Checkpointer
from unison.checkpointing.lease import LEASE, Holder, Lease, LeaseWarning
from unison.checkpointing.storage import open_storage
from unison.cli import main

HERE = Path(__file__).resolve().parent


@pytest.fixture(params=["local", "s3"])
def location(request, tmp_path):
    """A checkpoint location: a local directory, or a fresh prefix in the test S3 server's bucket."""
    if request.param == "local":
        return str(tmp_path / "ckpt")
    request.getfixturevalue("aws_env")  # the AWS variables point at the test server (conftest.py)
    return f"s3://{s3_server.BUCKET}/lease-{request.node.name.split('[')[0][-24:]}-{os.getpid()}-{time.time_ns()}"


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)}


def _verify_all(location: str, capsys) -> list[str]:
    """``unison checkpoint verify`` on the location; the run ids of its commits."""
    main(["checkpoint", "verify", location])
    out = capsys.readouterr().out
    assert "ok" in out and "FAIL" not in out, out
    return [c.manifest.run for c in Checkpointer(location).committed()]


@pytest.mark.timeout(180)
def test_two_jobs_started_together_exactly_one_trains(location, tmp_path, capsys):
    (tmp_path / "storage_job.py").write_text((HERE / "storage_job.py").read_text())
    (tmp_path / "run.toml").write_text(storage_job.config(location, max_steps=30, every=10, slow=0.2))
    argv = [sys.executable, "-m", "unison.cli", "train", str(tmp_path / "run.toml")]
    jobs = [
        subprocess.Popen(argv, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    outs = [job.communicate(timeout=150)[0] for job in jobs]
    codes = sorted(job.returncode for job in jobs)
    assert codes == [0, 2], outs
    winner, loser = (0, 1) if jobs[0].returncode == 0 else (1, 0)
    refusal = " ".join(outs[loser].split())
    assert "is being written by another job" in refusal and f"pid {jobs[winner].pid} " in refusal, refusal
    runs = _verify_all(location, capsys)
    assert len(runs) == 3 and len(set(runs)) == 1  # steps 10, 20, 30 of one run: nothing of the loser
    path, storage = open_storage(location)
    assert not storage.exists(path / LEASE)  # the winner gave its lease back


@pytest.mark.timeout(180)
def test_lease_of_a_killed_job_is_taken_over_by_resume_auto(location, capsys):
    job = subprocess.Popen(
        [sys.executable, str(HERE / "storage_job.py"), location, "40", "4", "0.2"],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    checkpointer = Checkpointer(location)
    deadline = time.monotonic() + 120
    while not checkpointer.committed() and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.3)
    assert checkpointer.committed(), "the job committed nothing"
    os.kill(job.pid, signal.SIGKILL)  # no cleanup of any kind: its lease stays behind
    job.wait(timeout=30)
    holder, _ = checkpointer.lease.holder()
    assert holder.pid == job.pid
    trainer = unison.Trainer(
        strategy="single", global_batch_size=8, max_steps=40, checkpoint_dir=location, checkpoint_every_n_steps=4
    )
    with pytest.warns(LeaseWarning, match=rf"took over the stale lease .*pid {job.pid} .*process {job.pid} .* gone"):
        progress = trainer.fit(
            storage_job.model,
            storage_job.datasets()[0],
            loss_fn=storage_job.loss,
            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
            ckpt_path="auto",
        )
    assert progress.global_step == 40 and progress.history[0]["step"] >= 4  # resumed, not restarted
    runs = _verify_all(location, capsys)
    assert len(set(runs)) == 1 and checkpointer.committed()[-1].manifest.step == 40
    assert checkpointer.lease.holder() is None


def _record(lease: Lease, **fields) -> None:
    now = time.time()
    holder = Holder(**{"owner": "other", "run": "r1", "host": "elsewhere", "pid": 1, "started": now,
                       "heartbeat": now, "ttl": 60.0, **fields})  # fmt: skip
    assert lease.storage.write_if(lease.path, holder.to_bytes(), None) is not None


def test_a_live_lease_refuses_before_any_process_group_and_an_expired_one_is_taken_over(tmp_path):
    root = tmp_path / "ckpt"
    lease = Lease(open_storage(root)[1], root)
    _record(lease)  # a live job on another host, heartbeating
    trainer = unison.Trainer(strategy="ddp", global_batch_size=8, max_steps=2, checkpoint_dir=str(root))
    with pytest.raises(
        unison.ConfigurationError, match=r"checkpoint_dir: .* another job: run r1 \(pid 1 on host elsewhere"
    ):
        trainer.fit(
            storage_job.model,
            storage_job.datasets()[0],
            loss_fn=storage_job.loss,
            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        )
    assert not trainer.setup_started and not torch.distributed.is_initialized()
    # The same job, silent for longer than its ttl: stale, taken over with a warning, then given back.
    lease.storage.remove_file(lease.path)
    _record(lease, heartbeat=time.time() - 61)
    with pytest.warns(LeaseWarning, match=r"run r1 .*: no heartbeat for 6\d s \(ttl 60 s\)"):
        trainer.fit(
            storage_job.model,
            storage_job.datasets()[0],
            loss_fn=storage_job.loss,
            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        )
    assert [c.manifest.step for c in Checkpointer(root).committed()] == [2]
    assert not (root / LEASE).exists()


def test_heartbeat_renews_and_a_lease_taken_over_stops_the_commit(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    storage = open_storage(root)[1]
    mine = Lease(storage, root, ttl=0.4)
    mine.acquire("run-a")
    first = json.loads((root / LEASE).read_text())["heartbeat"]
    time.sleep(0.5)
    assert json.loads((root / LEASE).read_text())["heartbeat"] > first  # renewed every ttl / 4
    mine.check()  # still ours: no error
    # Another job overwrites the record (as a takeover after a missed ttl would): the holder notices.
    (root / LEASE).write_text(json.dumps({**json.loads((root / LEASE).read_text()), "owner": "thief", "pid": 2}))
    time.sleep(0.3)
    with pytest.raises(unison.errors.UnisonError, match=r"taken over by run run-a \(pid 2 "):
        mine.check()
    mine.release()
    assert json.loads((root / LEASE).read_text())["owner"] == "thief"  # not deleted: it is not ours any more


def _fit_with_a_late_rank(checkpoint_dir: str) -> int:
    """In a world whose process group exists before ``fit``: rank 1 reaches the lease's preflight read late."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(2.0)  # rank 0 is at the lease by then
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    trainer = unison.Trainer(
        strategy="ddp",
        global_batch_size=8,
        max_steps=2,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every_n_steps=2,
        progress="off",
    )
    trainer.fit(
        torch.nn.Linear(4, 1),
        data,
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
    return trainer.global_step


def test_a_rank_late_to_the_lease_does_not_refuse_its_own_job(tmp_path):
    # The lease taken by rank 0 for this job is not "another job" to a slower rank: every rank finishes
    # its preflight read before rank 0 takes it, so both ranks train (before, rank 1 alone refused and the
    # ranks met in different collectives).
    from unison.launch.torchrun import spawn

    assert spawn(_fit_with_a_late_rank, 2, str(tmp_path / "ckpt"), timeout=120) == [2, 2]
