"""The default environment: torchrun's own options and ``PET_*`` variables, nothing derived."""

from __future__ import annotations

from collections.abc import Mapping

from unison.launch.cluster import ClusterEnvironment, NodeLaunch


class TorchrunEnvironment(ClusterEnvironment):
    """Always applies, at the lowest priority: the options given to ``unison run`` are torchrun's, as given.

    Multi-node by hand: run on every node
    ``unison run --nproc 8 --nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 --rdzv-id=JOB train.py``.
    """

    name = "torchrun"
    priority = 0

    def detect(self, environ: Mapping[str, str]) -> bool:
        return True

    def node_launch(self, environ: Mapping[str, str]) -> NodeLaunch:
        return NodeLaunch(environment=self.name)
