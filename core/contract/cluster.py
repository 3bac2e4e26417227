"""What a cluster-environment plugin implements: :class:`ClusterEnvironment`, and the torchrun options
it answers with, :class:`NodeLaunch`.

A plugin's ``unison_cluster_environments`` hook returns environments; :mod:`unison.launch.cluster`
selects one and merges its options (both names are also importable from there).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["ClusterEnvironment", "NodeLaunch"]

#: torchrun's multi-node options that a NodeLaunch may set, by attribute name.
_OPTIONS = {
    "nnodes": "--nnodes",
    "node_rank": "--node-rank",
    "rdzv_backend": "--rdzv-backend",
    "rdzv_endpoint": "--rdzv-endpoint",
    "rdzv_id": "--rdzv-id",
}


@dataclass(frozen=True)
class NodeLaunch:
    """torchrun's multi-node options for this node (``None``: not set, torchrun's default)."""

    environment: str
    """Name of the cluster environment that derived them."""
    nnodes: str | None = None
    """Nodes in the job: ``"4"``, or ``"2:4"`` for an elastic range."""
    node_rank: int | None = None
    """This node's rank (static rendezvous; c10d assigns ranks itself)."""
    rdzv_backend: str | None = None
    """``c10d`` (a TCP store on the endpoint host) or ``static``/``etcd``..."""
    rdzv_endpoint: str | None = None
    """``host:port`` every node's agent connects to."""
    rdzv_id: str | None = None
    """Job id shared by the nodes of one job."""
    nproc_per_node: int | None = None
    """Workers per node when the scheduler says (``--nproc`` on the command line wins)."""
    notes: tuple[str, ...] = field(default=())
    """What the environment read, for the launcher's log line."""

    def torchrun_args(self) -> list[str]:
        return [f"{flag}={getattr(self, name)}" for name, flag in _OPTIONS.items() if getattr(self, name) is not None]

    @property
    def multi_node(self) -> bool:
        return self.nnodes is not None and self.nnodes not in ("1", "1:1")


class ClusterEnvironment:
    """A scheduler's view of this node. Subclass, set ``name`` and ``priority``, implement both methods."""

    #: Registered name (``unison run --cluster NAME`` forces it).
    name: str = ""
    #: Among the environments that detect their scheduler, the highest priority wins.
    priority: int = 0

    def detect(self, environ: Mapping[str, str]) -> bool:
        """Whether this process runs under this environment's scheduler."""
        raise NotImplementedError

    def node_launch(self, environ: Mapping[str, str]) -> NodeLaunch:
        """torchrun's options for this node; a :class:`ConfigurationError` when the job is set up wrongly."""
        raise NotImplementedError
