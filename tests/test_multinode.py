"""Several nodes through torchrun: two torchrun agents on 127.0.0.1 act as two nodes.

Each agent is a real ``unison run`` with one worker; they meet in a c10d
rendezvous and train ddp and zero2 to the single-process result within 1e-5.
The same world forms from SLURM's variables (as ``srun`` sets them on two
nodes) and from a Kubernetes PyTorchJob's, with no multi-node option on the
command line.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import max_abs_diff
from multinode_worlds import reference

pytestmark = pytest.mark.distributed

HERE = Path(__file__).resolve().parent
UNISON = str(Path(sys.executable).parent / "unison")
STRATEGIES = ["ddp", "zero2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def single() -> dict[str, torch.Tensor]:
    return reference()


def run_nodes(
    tmp_path: Path, per_node_env: list[dict[str, str]], per_node_args: list[list[str]], command: str = "run"
) -> dict:
    """Start one ``unison run`` agent per node, wait for all; rank 0's result."""
    out = tmp_path / "result.pt"
    procs = []
    for extra_env, args in zip(per_node_env, per_node_args):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "PET_", "KUBERNETES"))}
        env.update(PYTHONPATH=f"{HERE}{os.pathsep}{env.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1", **extra_env)
        argv = [UNISON, "run", *args, str(HERE / "multinode_worlds.py"), str(out), ",".join(STRATEGIES)]
        procs.append(
            subprocess.Popen(
                argv,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=tmp_path,
                start_new_session=True,
            )
        )
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    for node, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"node {node} exited {p.returncode}:\n{log[-4000:]}"
    return {"result": torch.load(out, weights_only=False), "logs": logs}


def check(got: dict, single: dict[str, torch.Tensor]) -> None:
    result = got["result"]
    assert result["world_size"] == 2
    assert sorted(result["ranks"]) == [("0", "0"), ("1", "0")]  # one worker on each of two nodes
    for strategy in STRATEGIES:
        assert max_abs_diff(result["states"][strategy], single) <= 1e-5, strategy


@pytest.mark.timeout(300)
def test_two_agents_c10d_rendezvous_train_ddp_and_zero2_like_single(tmp_path, single):
    endpoint = f"127.0.0.1:{free_port()}"
    args = [
        [
            "--nproc",
            "1",
            "--nnodes=2",
            f"--node-rank={n}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            "--rdzv-id=two-nodes",
        ]
        for n in range(2)
    ]
    check(run_nodes(tmp_path, [{}, {}], args), single)


@pytest.mark.timeout(300)
def test_slurm_variables_as_srun_sets_them_form_the_same_world(tmp_path, single):
    port = str(free_port())
    # srun --nodes=2 --ntasks-per-node=1 on hosts 127.0.0.1 and 127.0.0.2 (both loopback).
    common = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_JOB_NODELIST": "127.0.0.[1-2]",
        "SLURM_STEP_NODELIST": "127.0.0.[1-2]",
        "SLURM_LOCALID": "0",
        "MASTER_PORT": port,
    }
    envs = [
        {**common, "SLURM_NODEID": str(n), "SLURM_PROCID": str(n), "SLURMD_NODENAME": f"127.0.0.{n + 1}"}
        for n in range(2)
    ]
    got = run_nodes(tmp_path, envs, [["--nproc", "1"], ["--nproc", "1"]])
    check(got, single)
    for n, log in enumerate(got["logs"]):
        assert f"--nnodes=2 --node-rank={n} --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:{port}" in log, log


@pytest.mark.timeout(300)
def test_kubernetes_pytorchjob_variables_form_the_same_world(tmp_path, single):
    port = str(free_port())
    # What the training operator sets in each pod of a PyTorchJob with nprocPerNode: 1 and 2 replicas.
    envs = [
        {
            "KUBERNETES_SERVICE_HOST": "10.96.0.1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "WORLD_SIZE": "2",
            "RANK": str(n),
            "PET_NNODES": "2",
            "PET_NPROC_PER_NODE": "1",
            "PET_NODE_RANK": str(n),
        }
        for n in range(2)
    ]
    got = run_nodes(tmp_path, envs, [[], []])  # no --nproc: the job says 1 per node
    check(got, single)
    assert "unison run: kubernetes" in got["logs"][0]
