"""Object-storage uploads that outlive the job: a slow link makes the client give up on uploads and retry them.

A proxy on 127.0.0.1 between the job and the S3 server (SeaweedFS, conftest.py) holds the bytes of the
first uploads into a save's ``.step-N.partial/`` prefix for longer than the client's read timeout
(2 s instead of s3fs's 15 s), then still delivers them after the client gave up, as a buffering
proxy or load balancer does. The client retries; the job commits, releases its lease and exits; the
held requests reach the server seconds later. Nothing may appear under a partial prefix then: each
object of a save is a multipart upload, and an upload completed or aborted refuses the parts that
arrive late (core/checkpointing/uploads.py). A second job on the same prefix cleans a planted orphan
prefix, and an unfinished multipart upload, when it starts.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import s3_server

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import sys, s3fs, torch, unison
from torch.utils.data import TensorDataset
url, steps, read_timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s3fs.S3FileSystem.read_timeout = read_timeout  # s3fs's default is 15 s; the test holds uploads 6 s
x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
trainer = unison.Trainer(strategy="single", global_batch_size=16, max_steps=steps, checkpoint_dir=url,
                         checkpoint_every_n_steps=2, progress="off", loggers=False, throughput=False)
trainer.fit(torch.nn.Linear(8, 1), TensorDataset(x, x.sum(dim=1, keepdim=True)), loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1), ckpt_path="auto")
print("finished at step", trainer.progress.global_step, flush=True)
"""


class SlowProxy:
    """TCP proxy to ``upstream``; a connection carrying one of the first ``budget`` PUTs into a ``.partial/``
    prefix has every later client byte delivered ``delay`` seconds after it arrived, even once the client
    has closed (a store-and-forward proxy on a slow link)."""

    def __init__(self, upstream: tuple[str, int], delay: float, budget: int) -> None:
        self.upstream, self.delay, self.budget = upstream, delay, budget
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.held = 0  # requests held back
        self.late = 0  # held requests delivered after their client had closed
        self.last_delivery = 0.0
        self._lock = threading.Lock()
        self._busy = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._up, args=(client, server), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client), daemon=True).start()

    def _down(self, server: socket.socket, client: socket.socket) -> None:
        try:
            while data := server.recv(65536):
                client.sendall(data)
        except OSError:
            pass
        finally:
            client.close()

    def _up(self, client: socket.socket, server: socket.socket) -> None:
        slow = False
        client_closed = False
        held: dict = {"pending": [], "closed": False}
        with self._lock:
            self._busy += 1
        try:
            while True:
                try:
                    data = client.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    client_closed = True
                    break
                if not slow and b"PUT /" in data and b".partial/" in data.split(b"\r\n", 1)[0]:
                    with self._lock:
                        if self.held < self.budget:
                            self.held += 1
                            slow = True
                            held["pending"].append((time.monotonic(), data))
                            threading.Thread(target=self._deliver_late, args=(held, server), daemon=True).start()
                            continue
                if slow:
                    held["pending"].append((time.monotonic(), data))
                else:
                    server.sendall(data)
        finally:
            if not slow:
                with self._lock:
                    self._busy -= 1
                if client_closed:
                    server.close()
            held["closed"] = True

    def _deliver_late(self, held: dict, server: socket.socket) -> None:
        """Send the held bytes, each ``delay`` after it arrived; keep the server connection open to be answered."""
        sent = 0
        try:
            while True:
                if sent < len(held["pending"]):
                    arrived, data = held["pending"][sent]
                    time.sleep(max(0.0, arrived + self.delay - time.monotonic()))
                    server.sendall(data)
                    sent += 1
                    continue
                if held["closed"]:
                    break
                time.sleep(0.05)
            with self._lock:
                self.late += 1
                self.last_delivery = time.monotonic()
            time.sleep(3.0)  # the server's answer goes nowhere; give it time to store what it got
        except OSError:
            pass
        finally:
            server.close()
            with self._lock:
                self._busy -= 1

    def idle(self) -> bool:
        with self._lock:
            return self._busy == 0

    def close(self) -> None:
        self.listener.close()


def run_job(s3, url: str, steps: int, endpoint: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        **s3.env(),
        "AWS_ENDPOINT_URL": endpoint,
        "OMP_NUM_THREADS": "1",
        "UNISON_STORAGE_RETRY_S": "60",
    }
    return subprocess.run(
        [sys.executable, "-c", CHILD, url, str(steps), "2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def partial_keys(s3, prefix: str) -> list[str]:
    return [k for k in s3.objects(prefix) if ".partial" in k]


def unfinished_uploads(s3, prefix: str) -> list[str]:
    answer = s3.fs().call_s3("list_multipart_uploads", Bucket=s3_server.BUCKET, Prefix=prefix + "/")
    return [u["Key"] for u in answer.get("Uploads", [])]


def test_uploads_given_up_and_retried_never_land_after_the_job_and_orphans_are_cleaned(s3, tmp_path):
    prefix = f"late-{os.getpid()}-{int(time.time())}"
    url = f"s3://{s3_server.BUCKET}/{prefix}"
    host, port = s3.endpoint.rsplit("//", 1)[1].rsplit(":", 1)
    proxy = SlowProxy((host, int(port)), delay=6.0, budget=2)
    try:
        job = run_job(s3, url, 4, f"http://127.0.0.1:{proxy.port}", tmp_path)
        ended = time.monotonic()
        assert job.returncode == 0, job.stderr[-4000:]
        assert "finished at step 4" in job.stdout
        assert proxy.held >= 1, "no upload was held back: the fault was not exercised"
        # The held requests reach the server after the job released its lease and exited.
        deadline = time.monotonic() + 30
        while not (proxy.idle() and proxy.late == proxy.held) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proxy.late == proxy.held and proxy.last_delivery > ended, (proxy.late, proxy.held)
        time.sleep(1.0)
        assert partial_keys(s3, prefix) == [], "objects landed under a partial prefix after the job"
        assert sorted({k.split("/")[0] for k in s3.objects(prefix) if k.endswith("manifest.json")}) == [
            "step-00000002",
            "step-00000004",
        ]
    finally:
        proxy.close()

    # An orphan prefix and an unfinished upload, as a killed save would leave them: cleaned at the next start.
    fs = s3.fs()
    fs.pipe_file(f"{s3_server.BUCKET}/{prefix}/.step-00000099.partial/orphan.bin", b"x" * 100)
    fs.call_s3("create_multipart_upload", Bucket=s3_server.BUCKET, Key=f"{prefix}/.step-00000098.partial/trainer.pt")
    assert partial_keys(s3, prefix) and unfinished_uploads(s3, prefix)
    again = run_job(s3, url, 6, s3.endpoint, tmp_path)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "finished at step 6" in again.stdout
    assert partial_keys(s3, prefix) == []
    assert unfinished_uploads(s3, prefix) == []
