"""A real Prometheus reads a 2-rank job's metrics: scraped from both ranks, and pushed through a Pushgateway.

The test starts Debian's ``prometheus`` (a temporary config and data directory) and
``prometheus-pushgateway`` on 127.0.0.1, then one ``unison run --nproc 2`` job of ``tests/ops_worlds.py``
(ddp, 16 steps, rank 1 sleeping 0.2 s in each) with two ``PrometheusLogger``: one serving each rank on
``PORT+LOCAL_RANK`` (Prometheus scrapes both every 0.5 s), one pushing to the gateway (which Prometheus
scrapes too). It then asks Prometheus's HTTP API for the loss series and each rank's step time, and
runs the dashboard query of docs/observability.md. Both servers are stopped at the end. ``.ci/run``
installs the two packages.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from unison.launch.torchrun import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "ops_worlds.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
STEPS = 16

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("prometheus-pushgateway") is None,
    reason="Debian's prometheus and prometheus-pushgateway are not installed (.ci/run installs them)",
)


def two_free_ports() -> int:
    """A port ``p`` with ``p + 1`` free too (rank 1 serves on the next port)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port + 1))
            return port
    raise RuntimeError("no two consecutive free ports")


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read())


def wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{url} exited with {proc.returncode}: {log.read_text()[-3000:]}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as reply:
            if reply.status == 200:
                return
        time.sleep(0.2)
    pytest.fail(f"{url} was not ready within 60 s: {log.read_text()[-3000:]}")


class Prometheus:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def query(self, promql: str) -> list[dict[str, Any]]:
        reply = get(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        assert reply["status"] == "success", reply
        return reply["data"]["result"]

    def query_range(self, promql: str, start: float, end: float) -> list[dict[str, Any]]:
        args = {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": "0.25"}
        reply = get(f"{self.url}/api/v1/query_range?" + urllib.parse.urlencode(args))
        assert reply["status"] == "success", reply
        return reply["data"]["result"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prometheus")
    prom_port, gateway_port, first = free_port(), free_port(), two_free_ports()
    config = tmp / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 500ms, scrape_timeout: 500ms}\n"
        "scrape_configs:\n"
        f"  - {{job_name: unison, static_configs: [{{targets: ['127.0.0.1:{first}', '127.0.0.1:{first + 1}']}}]}}\n"
        "  - job_name: pushgateway\n"
        "    honor_labels: true\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{gateway_port}']}}]\n"
    )
    logs = {"prometheus": tmp / "prometheus.log", "gateway": tmp / "gateway.log"}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with logs["prometheus"].open("wb") as plog, logs["gateway"].open("wb") as glog:
            procs.append(
                subprocess.Popen(
                    [
                        "prometheus",
                        f"--config.file={config}",
                        f"--storage.tsdb.path={tmp / 'data'}",
                        f"--web.listen-address=127.0.0.1:{prom_port}",
                    ],
                    stdout=plog,
                    stderr=subprocess.STDOUT,
                )
            )
            procs.append(
                subprocess.Popen(
                    ["prometheus-pushgateway", f"--web.listen-address=127.0.0.1:{gateway_port}"],
                    stdout=glog,
                    stderr=subprocess.STDOUT,
                )
            )
        wait_ready(procs[0], f"http://127.0.0.1:{prom_port}/-/ready", logs["prometheus"])
        wait_ready(procs[1], f"http://127.0.0.1:{gateway_port}/-/ready", logs["gateway"])
        yield Prometheus(prom_port), f"http://127.0.0.1:{gateway_port}", first
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def job(servers):
    prometheus, gateway, first = servers
    started = time.time()
    cmd = [sys.executable, "-m", "unison.cli", "run", "--nproc", "2", SCRIPT, "--steps", str(STEPS)]
    cmd += ["--slow", "1:0.2", "--prometheus", str(first), "--pushgateway", gateway]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The final push reaches Prometheus at its next scrape of the gateway.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        pushed = prometheus.query('unison_step{job="unison-push"}')
        if len(pushed) == 2 and all(float(r["value"][1]) == STEPS for r in pushed):
            break
        time.sleep(0.25)
    return prometheus, started, time.time()


def by_rank(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["metric"]["rank"]: r for r in results}


@pytest.mark.distributed
def test_prometheus_scrapes_both_ranks_a_loss_series_and_each_ranks_step_time(job):
    prometheus, started, ended = job
    loss = by_rank(prometheus.query_range('unison_train_loss{job="unison"}', started, ended))
    assert set(loss) == {"0", "1"}, loss
    for rank, series in loss.items():
        labels = series["metric"]
        assert labels["strategy"] == "ddp" and labels["node"] == socket.gethostname() and labels["run_id"], labels
        values = [float(v) for _, v in series["values"]]
        assert values and all(v > 0 for v in values), (rank, values)
    assert loss["0"]["metric"]["run_id"] == loss["1"]["metric"]["run_id"]
    assert max(len({v for _, v in s["values"]}) for s in loss.values()) >= 2, "a series: the loss changed in between"
    step_time = by_rank(prometheus.query('last_over_time(unison_step_time_seconds{job="unison"}[5m])'))
    assert set(step_time) == {"0", "1"}
    for series in step_time.values():  # rank 1 sleeps 0.2 s per step; rank 0 waits for it as long
        assert 0.15 < float(series["value"][1]) < 10, series


@pytest.mark.distributed
def test_the_pushgateway_holds_each_ranks_final_values(job):
    prometheus, _, _ = job
    step = by_rank(prometheus.query('unison_step{job="unison-push"}'))
    assert {r: float(s["value"][1]) for r, s in step.items()} == {"0": STEPS, "1": STEPS}
    wait = by_rank(prometheus.query('unison_wait_seconds{job="unison-push"}'))
    compute = by_rank(prometheus.query('unison_compute_seconds{job="unison-push"}'))
    # Rank 0 spends rank 1's sleep waiting for it; rank 1 computes (sleeps) it.
    assert float(wait["0"]["value"][1]) > 0.15 and float(wait["1"]["value"][1]) < 0.1
    assert float(compute["1"]["value"][1]) > 0.15
    assert float(prometheus.query('max(unison_slowest_rank{job="unison-push"})')[0]["value"][1]) == 1


@pytest.mark.distributed
def test_the_dashboard_query_of_the_docs_runs_and_names_the_straggler(job):
    prometheus, _, _ = job
    docs = (ROOT / "docs" / "observability.md").read_text()
    queries = re.findall(r"```promql\n(.*?)```", docs, re.S)
    assert queries, "docs/observability.md shows no PromQL query"
    for query in queries:
        results = prometheus.query(query.strip())
        assert results, query
    # The first is the per-rank compute time over the job's median: rank 1 stands out.
    first = by_rank([r for r in prometheus.query(queries[0].strip()) if r["metric"].get("job") == "unison-push"])
    assert float(first["1"]["value"][1]) > 1.5 * float(first["0"]["value"][1]), first
