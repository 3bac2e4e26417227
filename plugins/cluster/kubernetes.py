"""Kubernetes: a Kubeflow ``PyTorchJob`` pod runs ``unison run``; the operator's variables give the geometry.

A PyTorchJob sets torchrun's own variables in every pod: ``PET_NNODES``,
``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_RDZV_BACKEND``,
``PET_RDZV_ENDPOINT``/``PET_RDZV_ID`` (elastic policy), and
``MASTER_ADDR``/``MASTER_PORT`` (the master pod's service) with the pod-level
``WORLD_SIZE`` (pods) and ``RANK`` (this pod). They become ``--nnodes``,
``--node-rank``, ``--rdzv-backend`` (``c10d`` unless set),
``--rdzv-endpoint`` (``PET_RDZV_ENDPOINT``, else ``MASTER_ADDR:MASTER_PORT``),
``--rdzv-id`` and the workers per node (``PET_NPROC_PER_NODE``, when
``--nproc`` is not given). Detected by ``PET_NNODES``, or by
``KUBERNETES_SERVICE_HOST`` together with ``MASTER_ADDR`` and ``WORLD_SIZE``
(a PyTorchJob without ``nprocPerNode``).
"""

from __future__ import annotations

from collections.abc import Mapping

from unison.errors import ConfigurationError
from unison.launch.cluster import ClusterEnvironment, NodeLaunch


class KubernetesEnvironment(ClusterEnvironment):
    name = "kubernetes"
    priority = 10

    def detect(self, environ: Mapping[str, str]) -> bool:
        pod = "KUBERNETES_SERVICE_HOST" in environ and "MASTER_ADDR" in environ and "WORLD_SIZE" in environ
        # Not inside a worker torchrun already started (LOCAL_RANK): there WORLD_SIZE counts processes.
        return ("PET_NNODES" in environ or pod) and "LOCAL_RANK" not in environ

    def node_launch(self, environ: Mapping[str, str]) -> NodeLaunch:
        nnodes = environ.get("PET_NNODES", environ.get("WORLD_SIZE"))
        node_rank = environ.get("PET_NODE_RANK", environ.get("RANK"))
        endpoint = environ.get("PET_RDZV_ENDPOINT")
        if endpoint is None:
            addr, port = (
                environ.get("PET_MASTER_ADDR", environ.get("MASTER_ADDR")),
                environ.get("PET_MASTER_PORT", environ.get("MASTER_PORT", "29500")),
            )
            if addr is None:
                raise ConfigurationError(
                    "kubernetes",
                    "neither PET_RDZV_ENDPOINT nor MASTER_ADDR is set",
                    "run in a PyTorchJob (it sets both), or pass --rdzv-endpoint=HOST:PORT",
                )
            endpoint = f"{addr}:{port}"
        nproc = environ.get("PET_NPROC_PER_NODE")
        return NodeLaunch(
            environment=self.name,
            nnodes=nnodes,
            node_rank=int(node_rank) if node_rank is not None else None,
            rdzv_backend=environ.get("PET_RDZV_BACKEND", "c10d"),
            rdzv_endpoint=endpoint,
            rdzv_id=environ.get("PET_RDZV_ID", environ.get("PET_JOB_NAME", "unison")),
            nproc_per_node=int(nproc) if nproc and nproc.isdigit() else None,
            notes=(f"pod {node_rank} of {nnodes}",),
        )
