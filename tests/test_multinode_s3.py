"""``unison train`` on two torchrun agents acting as two nodes, checkpointing to a real S3 server.

Each node stages its own rank's files in its own directory (no shared disk) and uploads them to the
bucket (SeaweedFS on loopback, started by conftest.py); the job resumes from the bucket with
``--resume auto``, and global rank 0 writes both runs' metrics there. Long tier (tests/conftest.py
FULL_TIER): two agents and two jobs, about 40 s.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import s3_server
from test_s3_checkpoints import committed_steps

from unison.launch.torchrun import free_port

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("aws_env")  # conftest.py: the AWS variables point at the test server


def two_nodes_train(tmp_path: Path, config: Path, extra: list[str]) -> list[str]:
    """``unison train`` on two torchrun agents on 127.0.0.1 acting as two nodes, each in its own directory."""
    endpoint = f"127.0.0.1:{free_port()}"
    procs = []
    for node in range(2):
        cwd = tmp_path / f"node{node}"  # no shared disk: each node stages in its own temporary directory
        cwd.mkdir(exist_ok=True)
        argv = [
            str(Path(sys.executable).parent / "unison"),
            "train",
            str(config),
            "--nproc",
            "1",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            "s3",
            *extra,
        ]
        procs.append(
            subprocess.Popen(
                argv,
                cwd=cwd,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = [p.communicate(timeout=200)[0] for p in procs]
    for node, p in enumerate(procs):
        assert p.returncode == 0, f"node {node}: exit {p.returncode}\n{logs[node][-3000:]}"
    return logs


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_unison_train_on_two_nodes_checkpoints_to_the_bucket_and_resumes(s3, tmp_path):
    url = f"s3://{s3_server.BUCKET}/two-nodes"
    text = (ROOT / "examples" / "tinylm.toml").read_text()
    text = text.replace('factory = "tinylm.py', f'factory = "{ROOT}/examples/tinylm.py')
    text = f'[imports]\npaths = ["{ROOT}/examples"]\n' + text  # a trust root beyond the config's directory
    text = re.sub(r"(?m)^root_dir = .*$", f'checkpoint_dir = "{url}"', text)  # (runs in object storage)
    text = text.replace('strategy = "single"', 'strategy = "ddp"').replace("max_bytes = 400000", "max_bytes = 20000")
    text = text.replace("checkpoint_every_n_steps = 75", "checkpoint_every_n_steps = 2")
    text = text.replace("val_every_n_steps = 75", "val_every_n_steps = 100")
    text = text.replace("log_every_n_steps = 10", "log_every_n_steps = 1")
    text = text.replace('dir = "runs/tinylm"', f'dir = "s3://{s3_server.BUCKET}/two-nodes-runs"')
    config = tmp_path / "job.toml"
    config.write_text(text)
    two_nodes_train(tmp_path, config, ["--max-steps", "4"])
    fs = s3.fs()
    keys = s3.objects("two-nodes")
    assert committed_steps(keys) == ["step-00000002", "step-00000004"], keys
    # Each node uploaded its own rank's files from its own disk.
    assert "step-00000004/rng/rank-00000.pt" in keys and "step-00000004/rng/rank-00001.pt" in keys
    manifest = json.loads(fs.cat_file(f"{s3_server.BUCKET}/two-nodes/step-00000004/manifest.json"))
    assert manifest["world_size"] == 2 and manifest["strategy"] == "ddp" and manifest["step"] == 4
    two_nodes_train(tmp_path, config, ["--max-steps", "6", "--resume", "auto"])
    keys = s3.objects("two-nodes")
    assert committed_steps(keys) == ["step-00000004", "step-00000006"], keys  # keep_last_n_checkpoints = 2
    resumed = json.loads(fs.cat_file(f"{s3_server.BUCKET}/two-nodes/step-00000006/manifest.json"))
    assert resumed["run"] == manifest["run"]  # the same run, continued
    # The metrics of both runs (global rank 0's, on node 0) are in the bucket, a version each.
    runs = s3.objects("two-nodes-runs")
    for version in ("version_0", "version_1"):
        assert {f"{version}/run.json", f"{version}/metrics.jsonl", f"{version}/metrics.csv"} <= set(runs), runs
        assert any(k.startswith(f"{version}/tensorboard/") for k in runs), runs
    assert {k.split("/")[0] for k in runs} == {"version_0", "version_1"}, runs
    steps = [
        json.loads(line)["step"]
        for line in fs.cat_file(f"{s3_server.BUCKET}/two-nodes-runs/version_1/metrics.jsonl").decode().splitlines()
    ]
    assert sorted(set(steps)) == [5, 6], steps  # the resumed run logs its own steps
