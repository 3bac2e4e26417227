"""Built-in cluster environments: torchrun/env (the default), SLURM, Kubernetes (PyTorchJob).

Each turns what a scheduler tells a node into torchrun's multi-node options
(:class:`unison.launch.cluster.NodeLaunch`); ``unison run`` and ``unison train`` add
those options to the torchrun they start (an option given on the command line
wins). See :mod:`unison.launch.cluster`.
"""

from __future__ import annotations

from unison.launch.cluster import ClusterEnvironment
from unison.plugin import hookimpl
from unison.plugins.cluster.kubernetes import KubernetesEnvironment
from unison.plugins.cluster.slurm import SlurmEnvironment
from unison.plugins.cluster.torchrun import TorchrunEnvironment


@hookimpl
def unison_cluster_environments() -> list[ClusterEnvironment]:
    return [TorchrunEnvironment(), SlurmEnvironment(), KubernetesEnvironment()]
