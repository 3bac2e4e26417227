"""SLURM: one ``srun`` task per node runs ``unison run``, which starts torchrun with the job's geometry.

Read (as ``srun`` sets them): ``SLURM_JOB_ID``, ``SLURM_STEP_ID``,
``SLURM_STEP_NUM_NODES``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_NODELIST``
(``SLURM_JOB_NODELIST`` outside a step), ``SLURMD_NODENAME`` (else
``SLURM_NODEID``). Derived: ``--nnodes`` (the step's node count),
``--node-rank`` (this host's index in the node list), ``--rdzv-backend=c10d``,
``--rdzv-endpoint=FIRST_HOST:PORT`` (``MASTER_ADDR``/``MASTER_PORT`` override
host and port; the port defaults to one derived from the job id so
concurrent jobs on shared nodes differ), ``--rdzv-id=JOB.STEP``.

Why one task per node: each task starts a torchrun agent, and one agent per
node starts that node's workers; ``srun --ntasks-per-node=1``. Several tasks
per node are refused with that fix rather than starting agents that would
never agree on the world.
"""

from __future__ import annotations

from collections.abc import Mapping

from unison.errors import ConfigurationError
from unison.launch.cluster import ClusterEnvironment, NodeLaunch, expand_hostlist

#: Rendezvous ports: 20000 + job id modulo this range (away from torch's 29500 default).
_PORT_BASE, _PORT_RANGE = 20000, 9000


class SlurmEnvironment(ClusterEnvironment):
    name = "slurm"
    priority = 20

    def detect(self, environ: Mapping[str, str]) -> bool:
        return "SLURM_JOB_ID" in environ

    def node_launch(self, environ: Mapping[str, str]) -> NodeLaunch:
        job = environ["SLURM_JOB_ID"]
        if "SLURM_STEP_ID" not in environ:
            nodes = int(environ.get("SLURM_JOB_NUM_NODES", environ.get("SLURM_NNODES", "1")))
            if nodes > 1:
                raise ConfigurationError(
                    "SLURM",
                    f"job {job} has {nodes} nodes but this is its batch script, which runs on the first only",
                    "start one launcher per node: srun --ntasks-per-node=1 unison run ...",
                )
            return NodeLaunch(environment=self.name)  # a one-node allocation: nothing to join
        nodes = int(environ.get("SLURM_STEP_NUM_NODES", environ.get("SLURM_NNODES", "1")))
        tasks = int(environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS", str(nodes))))
        if tasks != nodes:
            raise ConfigurationError(
                "SLURM",
                f"srun started {tasks} tasks on {nodes} node(s); each task would start its own torchrun",
                "run one task per node (srun --ntasks-per-node=1 unison run --nproc GPUS_PER_NODE ...)",
            )
        hosts = expand_hostlist(environ.get("SLURM_STEP_NODELIST", environ.get("SLURM_JOB_NODELIST", "")))
        if not hosts:
            raise ConfigurationError(
                "SLURM", "SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are empty", "run under srun, which sets them"
            )
        here = environ.get("SLURMD_NODENAME")
        node_rank = hosts.index(here) if here in hosts else int(environ.get("SLURM_NODEID", "0"))
        host = environ.get("MASTER_ADDR", hosts[0])
        port = environ.get("MASTER_PORT", str(_PORT_BASE + int(job) % _PORT_RANGE))
        step = environ["SLURM_STEP_ID"]
        return NodeLaunch(
            environment=self.name,
            nnodes=str(nodes),
            node_rank=node_rank,
            rdzv_backend="c10d",
            rdzv_endpoint=f"{host}:{port}",
            rdzv_id=f"{job}.{step}",
            notes=(f"job {job} step {step}", f"node {node_rank} of {nodes} ({here or 'SLURM_NODEID'})"),
        )
