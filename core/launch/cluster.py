"""Cluster environments: how torchrun on this node joins a job of several nodes.

unison does not launch across hosts itself: every node runs torchrun
(``torch.distributed.run``, through ``unison run`` / ``unison train``), and the
torchrun agents meet in a rendezvous. A :class:`ClusterEnvironment` reads what
a scheduler tells a node (SLURM's ``SLURM_*`` variables, the ``PET_*`` and
``MASTER_*`` variables a Kubeflow PyTorchJob sets) and answers with torchrun's
multi-node options for this node (:class:`NodeLaunch`).

Environments are plugins: ``unison_cluster_environments`` registers them
(built-ins: ``torchrun`` (the default, options as given), ``slurm``,
``kubernetes``, in :mod:`unison.plugins.cluster`). :func:`node_launch` asks
each whether it detects its scheduler, takes the detected one of highest
``priority``, and merges: an option given on the command line always wins
over one the environment derives.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from unison.contract.cluster import ClusterEnvironment, NodeLaunch
from unison.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from unison.plugin.manager import PluginManager

__all__ = ["ClusterEnvironment", "NodeLaunch", "expand_hostlist", "node_launch", "select_environment"]


def _given(torchrun_args: Sequence[str]) -> set[str]:
    """torchrun option names (``nnodes``, ``rdzv_endpoint``...) present in ``torchrun_args``."""
    names = set()
    for arg in torchrun_args:
        if arg.startswith("--"):
            names.add(arg[2:].split("=", 1)[0].replace("-", "_"))
    return names


def select_environment(pm: PluginManager, environ: Mapping[str, str], name: str | None = None) -> ClusterEnvironment:
    """The environment named ``name``, else the detected one of highest priority."""
    environments = pm.unison_cluster_environments()
    if name is not None:
        for env in environments:
            if env.name == name:
                return env
        known = ", ".join(sorted(e.name for e in environments))
        raise ConfigurationError("--cluster", f"no cluster environment named {name!r}", f"use one of: {known}")
    detected = [env for env in environments if env.detect(environ)]
    if not detected:
        raise ConfigurationError(
            "--cluster",
            "no cluster environment applies (not even the default)",
            "install unison with its built-in plugins (the torchrun environment)",
        )
    return max(detected, key=lambda env: env.priority)


def node_launch(
    pm: PluginManager, torchrun_args: Sequence[str], environ: Mapping[str, str], name: str | None = None
) -> tuple[NodeLaunch, list[str]]:
    """``(the environment's NodeLaunch, torchrun_args with its options added where not given)``."""
    launch = select_environment(pm, environ, name).node_launch(environ)
    given = _given(torchrun_args)
    if "master_addr" in given or "standalone" in given:
        return launch, list(torchrun_args)  # the caller chose its own rendezvous
    extra = [arg for arg in launch.torchrun_args() if _given([arg]).isdisjoint(given)]
    return launch, [*torchrun_args, *extra]


# --------------------------------------------------------------------------- #
# SLURM host lists: "node[01-03,07],gpu5" -> node01 node02 node03 node07 gpu5
# --------------------------------------------------------------------------- #
def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a SLURM host list (what ``scontrol show hostnames`` prints), without calling SLURM."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*|(?<=,)", hostlist):
        if item:
            hosts.extend(_expand_one(item))
    return hosts


def _expand_one(item: str) -> list[str]:
    match = re.match(r"^([^\[]*)\[([^\]]+)\](.*)$", item)
    if match is None:
        return [item]
    prefix, ranges, rest = match.groups()
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if hi:
            width = len(lo)
            out += [f"{prefix}{n:0{width}d}" for n in range(int(lo), int(hi) + 1)]
        else:
            out.append(f"{prefix}{lo}")
    return [host for head in out for host in _expand_one(head + rest)]
