"""Cluster environments: what each derives from a scheduler's variables, and what it refuses.

The worlds these options form are trained in tests/test_multinode.py; here the
derivations themselves, through the real plugin manager and the built-in plugins.
"""

from __future__ import annotations

import pytest

import unison
from unison.launch.cluster import ClusterEnvironment, NodeLaunch, expand_hostlist, node_launch
from unison.plugin.manager import PluginManager

SRUN = {
    "SLURM_JOB_ID": "77",
    "SLURM_STEP_ID": "3",
    "SLURM_NNODES": "3",
    "SLURM_STEP_NUM_NODES": "3",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_STEP_NODELIST": "gpu[07-08],cpu1",
    "SLURMD_NODENAME": "gpu08",
    "SLURM_NODEID": "1",
}


def derive(environ, args=(), name=None):
    return node_launch(PluginManager(), list(args), environ, name)


def test_hostlists_expand_like_scontrol():
    assert expand_hostlist("node[01-03,07],gpu5") == ["node01", "node02", "node03", "node07", "gpu5"]
    assert expand_hostlist("10.0.0.[1-2],a[1-2]b[8-9]") == ["10.0.0.1", "10.0.0.2", "a1b8", "a1b9", "a2b8", "a2b9"]
    assert expand_hostlist("solo") == ["solo"]


def test_plain_environment_adds_nothing():
    launch, args = derive({}, ["--max-restarts=2"])
    assert launch.environment == "torchrun" and args == ["--max-restarts=2"] and not launch.multi_node


def test_slurm_step_gives_the_geometry_and_given_options_win():
    launch, args = derive(SRUN, ["--rdzv-id=mine"])
    assert launch.environment == "slurm" and launch.node_rank == 1  # gpu08 is the second host of the step
    assert args == [
        "--rdzv-id=mine",
        "--nnodes=3",
        "--node-rank=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=gpu07:{20000 + 77}",
    ]
    _, args = derive({**SRUN, "MASTER_ADDR": "head", "MASTER_PORT": "6000"})
    assert "--rdzv-endpoint=head:6000" in args


def test_slurm_refuses_several_tasks_per_node_and_a_batch_script_of_several_nodes():
    with pytest.raises(unison.ConfigurationError, match="ntasks-per-node=1"):
        derive({**SRUN, "SLURM_STEP_NUM_TASKS": "6"})
    batch = {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP")}
    with pytest.raises(unison.ConfigurationError, match=r"batch script.*srun --ntasks-per-node=1"):
        derive(batch)
    launch, args = derive({**batch, "SLURM_NNODES": "1"})  # a one-node allocation runs as it is
    assert launch.environment == "slurm" and args == []


def test_kubernetes_pytorchjob_variables():
    pod = {
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "MASTER_ADDR": "exp1-master-0",
        "MASTER_PORT": "23456",
        "WORLD_SIZE": "4",
        "RANK": "2",
        "PET_NNODES": "4",
        "PET_NPROC_PER_NODE": "8",
        "PET_NODE_RANK": "2",
    }
    launch, args = derive(pod)
    assert launch.environment == "kubernetes" and launch.nproc_per_node == 8
    assert args == [
        "--nnodes=4",
        "--node-rank=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=exp1-master-0:23456",
        "--rdzv-id=unison",
    ]
    # Inside a worker torchrun started, WORLD_SIZE counts processes: not a pod's view.
    assert derive({**pod, "LOCAL_RANK": "0"})[0].environment == "torchrun"


def test_an_explicit_rendezvous_or_standalone_is_left_alone():
    assert derive(SRUN, ["--standalone"])[1] == ["--standalone"]
    assert derive(SRUN, ["--master-addr=h", "--master-port=1"])[1] == ["--master-addr=h", "--master-port=1"]


def test_forcing_an_environment_by_name_and_an_unknown_name():
    assert derive(SRUN, name="torchrun")[0].environment == "torchrun"
    with pytest.raises(unison.ConfigurationError, match="kubernetes, slurm, torchrun"):
        derive({}, name="pbs")


class Pbs(ClusterEnvironment):
    """A third-party environment, registered like any plugin."""

    name, priority = "pbs", 30

    def detect(self, environ):
        return "PBS_JOBID" in environ

    def node_launch(self, environ):
        return NodeLaunch(
            environment=self.name, nnodes=environ["PBS_NUM_NODES"], rdzv_backend="c10d", rdzv_endpoint="head:1"
        )


class PbsPlugin:
    @unison.hookimpl
    def unison_cluster_environments(self):
        return [Pbs()]


def test_a_plugin_environment_is_found_and_wins_by_priority():
    pm = PluginManager()
    pm.register(PbsPlugin())
    launch, args = node_launch(pm, [], {**SRUN, "PBS_JOBID": "1", "PBS_NUM_NODES": "5"})
    assert launch.environment == "pbs" and args == ["--nnodes=5", "--rdzv-backend=c10d", "--rdzv-endpoint=head:1"]
    pm.register(type("Again", (), {"unison_cluster_environments": unison.hookimpl(lambda self: [Pbs()])})())
    with pytest.raises(unison.PluginError, match="pbs"):
        pm.unison_cluster_environments()
