"""Starting worlds of processes.

* :func:`run_script` is what ``unison run --nproc N script.py`` does: it hands
  the script to ``torch.distributed.run`` (torchrun), passing extra torchrun
  options through. The script builds a :class:`~unison.Trainer`, which finds
  the ``env://`` variables torchrun sets. Several nodes: every node runs it,
  with torchrun's multi-node options given or derived from the scheduler by a
  cluster environment (:mod:`unison.launch.cluster`: SLURM, Kubernetes).
* :func:`spawn` runs a picklable function in a fresh world of ``nproc`` local
  processes with an initialised gloo group and returns each rank's result. The
  conformance suite and the tests use it to run many scenarios in one process
  group. On any failure or timeout every process of the world is killed. The
  ranks are forked from multiprocessing's fork server, which imported torch,
  unison's plugin system and DeepSpeed (:mod:`unison.launch._preload`) once for the calling
  process (a world starts in a tenth of a second, not the seconds each rank's
  own imports took); each rank runs with the caller's environment of that call
  and has run nothing of an earlier world.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch.multiprocessing as mp

from unison.errors import ConfigurationError
from unison.launch import messages
from unison.launch.report import summarize_failures, watch_torchrun
from unison.launch.worker import BOOT


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: torchrun options unison run sets unless the caller passes them.
_SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def cluster_launch(
    nproc: int | None, torchrun_args: Sequence[str], cluster: str | None = None, pm: Any = None
) -> tuple[int, list[str], Any]:
    """``(processes on this node, torchrun options, NodeLaunch)`` with the cluster environment's options added.

    Options given explicitly win over derived ones; ``nproc`` (``--nproc``)
    wins over the scheduler's count of workers per node; neither: 1.
    """
    from unison.launch.cluster import node_launch
    from unison.plugin.manager import PluginManager

    launch, args = node_launch(pm or PluginManager(), torchrun_args, os.environ, cluster)
    return nproc or launch.nproc_per_node or 1, args, launch


def run_script(
    script: str,
    nproc: int | None,
    script_args: Sequence[str] = (),
    torchrun_args: Sequence[str] = (),
    cluster: str | None = None,
) -> int:
    """Run ``script`` under torchrun with ``nproc`` processes on this node; return the job's exit code.

    What it does beyond plain torchrun, and why:

    * Multi-node options come from the cluster environment (SLURM, a
      Kubernetes PyTorchJob; :func:`cluster_launch`) where not given, so
      ``srun --ntasks-per-node=1 unison run --nproc 8 train.py`` joins the job;
      one line on stderr says what was derived.

    * ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: torchrun otherwise keeps one
      rendezvous store across worker restarts, and a restarted world reads the
      dead worker's address from the previous attempt, then hangs or is
      refused. With it every attempt gets a fresh store.
    * SIGUSR1 is forwarded to the workers with SIGTERM (SLURM sends it before
      the time limit), so they commit a checkpoint and stop.
    * Each worker runs the script through :mod:`unison.launch.worker` (started
      with the working directory off ``sys.path``: only the script's directory,
      the trust roots and installed packages provide code), which records
      the exception that ends it instead of printing it; the launcher prints
      one report for the job (:func:`unison.launch.report.summarize_failures`): the first real
      failure's message or traceback, one line per other rank, and exits with
      the first failure's code (2 for a ConfigurationError, 1 for an
      exception, 3 for a rank the watchdog found stalled, 128 + N for signal
      N, 75 when the workers stopped on request). The SIGTERM torchrun sends
      the surviving workers after a failure is never reported as a failure.
      ``--no-python`` scripts run as given.
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from unison.launch.lifecycle import LAUNCHER_ENV

    nproc, torchrun_args, launch = cluster_launch(nproc, torchrun_args, cluster)
    if launch.environment != "torchrun":
        messages.say(
            f"unison run: {launch.environment} ({'; '.join(launch.notes) or 'detected'}): "
            f"{' '.join(launch.torchrun_args()) or 'single node'}"
        )
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    torchrun_args = list(torchrun_args)
    target = [script, *script_args]
    if not any(a in ("--no-python", "--no_python") for a in torchrun_args):
        as_module = [a for a in torchrun_args if a in ("--module", "-m")]
        torchrun_args = [a for a in torchrun_args if a not in as_module]
        # The interpreter itself is the "script" (--no-python): torchrun's own `python -m` would put the
        # working directory first on sys.path; worker.BOOT starts without it (unison.launch.worker says why).
        python = os.environ.get("PYTHON_EXEC", sys.executable)  # (the variable torchrun honours)
        target = [python, "-u", "-c", BOOT, *(["--module"] if as_module else []), *target]
        torchrun_args.append("--no-python")
    argv = [f"--nproc-per-node={nproc}", *torchrun_args]
    run_id = None
    if not any(a.startswith(("--rdzv", "--master", "--nnodes", "--standalone")) for a in torchrun_args):
        argv.insert(0, "--standalone")  # single node, free port, no rendezvous server to run
        # One id for the job's messages and metrics (a multi-node job's is its --rdzv-id, TORCHELASTIC_RUN_ID).
        run_id = os.environ.get(messages.RUN_ID_ENV) or uuid.uuid4().hex[:12]
    if not any(a.startswith(("--signals-to-handle", "--signals_to_handle")) for a in torchrun_args):
        argv.append(f"--signals-to-handle={_SIGNALS_TO_HANDLE}")
    argv += target
    previous = os.environ.get(LAUNCHER_ENV)
    previous_id = os.environ.get(messages.RUN_ID_ENV)
    os.environ[LAUNCHER_ENV] = "1"  # the workers record their errors; the report is printed here
    if run_id is not None:
        os.environ[messages.RUN_ID_ENV] = run_id
    try:
        with watch_torchrun() as failed_before_close:
            # torchrun.run, not torchrun.main: main's @record prints the failure
            # table and a stack trace of the launcher itself.
            torchrun.run(torchrun.parse_args(argv))
    except ChildFailedError as exc:
        code, lines = summarize_failures(exc.failures, failed_before_close)
        messages.say("\n".join(lines), level="error")  # the job's one report: one record in the json format
        return code
    except SignalException as exc:  # the launcher itself was told to stop; workers got the signal too
        messages.say(f"unison run: stopped by {exc.sigval.name}; the workers were asked to stop", level="warning")
        return 128 + int(exc.sigval)
    finally:
        if previous is None:
            os.environ.pop(LAUNCHER_ENV, None)
        else:
            os.environ[LAUNCHER_ENV] = previous
        if previous_id is None:
            os.environ.pop(messages.RUN_ID_ENV, None)
    return 0


def check_nproc(nproc: int | None) -> bool:
    """Whether ``Trainer(nproc=...)`` must start its workers: ``True`` outside any launcher with ``nproc > 1``.

    Inside a launcher's worker (``LOCAL_RANK`` set) ``nproc`` must equal the
    processes it started on this node (``LOCAL_WORLD_SIZE``); a mismatch is a
    ConfigurationError before any process group starts.
    """
    if nproc is None:
        return False
    if "LOCAL_RANK" in os.environ:
        started = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if started != nproc:
            raise ConfigurationError(
                "nproc",
                f"nproc={nproc} but the launcher started {started} process(es) on this node",
                f"drop nproc (the launcher decides), or launch with --nproc {nproc}",
            )
        return False
    return nproc > 1


def start_workers(nproc: int) -> NoReturn:
    """Re-run this program under torchrun with ``nproc`` workers, as ``unison run --nproc N`` would; exit with its code.

    What ``Trainer(nproc=N)`` does in a process no launcher started. The
    program is re-run from the top in every worker (``python train.py ARGS``:
    the script; ``python -m pkg.train ARGS``: the module), so this process
    only waits: everything after the line that made the Trainer runs in the
    workers, and it exits with the job's exit code and one failure report.
    A program without a script file (an interactive session, a notebook,
    ``python -c``) cannot be re-run: a ConfigurationError names the command.
    """
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    path = getattr(main, "__file__", None)
    if spec is not None and spec.name and spec.name != "__main__":  # python -m pkg.train (or pkg/__main__.py)
        code = run_script(spec.name.removesuffix(".__main__"), nproc, sys.argv[1:], ["--module"])
    elif path and os.path.isfile(path):
        code = run_script(path, nproc, sys.argv[1:])
    else:
        raise ConfigurationError(
            "nproc",
            f"nproc={nproc} starts the workers by re-running this program's script, and this process has none "
            "(an interactive session, a notebook or python -c)",
            f"save the code as a script and run `unison run --nproc {nproc} train.py` (or `python train.py`)",
        )
    sys.exit(code)


class WorldError(RuntimeError):
    """A rank of a spawned world failed; carries that rank's traceback."""


def _context() -> Any:
    """multiprocessing's fork server (started by this process's first world), importing
    :mod:`unison.launch._preload` before it forks any rank."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["unison.launch._preload"])
    return ctx


def _worker(
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    backend: str,
    fn: Callable[..., Any],
    args: tuple,
    env: dict[str, str],
) -> None:
    # The rank is forked from the server, whose environment is the one of the first world's start: it takes
    # the caller's environment of this call (what a fresh interpreter started now would have seen).
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    import multiprocessing

    import torch
    import torch.distributed as dist

    # A rank started here must behave like one torchrun starts: the platform's
    # default start method for its own children (DataLoader workers), not the
    # "spawn" this world was created with (which re-imports torch per worker).
    multiprocessing.set_start_method("fork" if sys.platform == "linux" else "spawn", force=True)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    path = Path(out_dir) / f"rank-{rank}.pkl"
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(*args)
        payload: tuple[str, Any] = ("ok", result)
    except BaseException:  # report, then let the parent kill the world
        payload = ("error", traceback.format_exc())
    with open(path, "wb") as f:
        pickle.dump(payload, f)
    if payload[0] == "ok":
        dist.barrier()
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], nproc: int, *args: Any, timeout: float = 600.0, backend: str = "gloo") -> list[Any]:
    """Run ``fn(*args)`` on every rank of a new ``nproc``-process world; return results by rank.

    ``fn`` must be importable (a module-level function). The ranks are forked from the fork server
    (see the module's docstring) and take this process's environment and ``sys.path`` as they are now. Raises
    :class:`WorldError` with the first failing rank's traceback; kills the
    whole world on failure or after ``timeout`` seconds.
    """
    ctx = _context()
    env = dict(os.environ)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="unison-world-") as out_dir:
        procs = [
            # Not daemonic: a rank may start DataLoader workers (daemonic
            # processes cannot have children); the finally below kills them all.
            ctx.Process(target=_worker, args=(r, nproc, port, out_dir, backend, fn, args, env), daemon=False)
            for r in range(nproc)
        ]
        # Python 3.11+: the fork server's interpreter (started by the first world) starts without the working
        # directory on sys.path (multiprocessing runs `python -c ...`, which would put it first while its
        # bootstrap imports; a rank then takes this process's sys.path).
        added = "PYTHONSAFEPATH" not in os.environ
        if added:
            os.environ["PYTHONSAFEPATH"] = "1"
        try:
            for p in procs:
                p.start()
        finally:
            if added:
                os.environ.pop("PYTHONSAFEPATH", None)
        deadline = time.monotonic() + timeout
        results: dict[int, tuple[str, Any]] = {}
        try:
            while len(results) < nproc:
                for r in range(nproc):
                    path = Path(out_dir) / f"rank-{r}.pkl"
                    if r not in results and path.exists() and not procs[r].is_alive():
                        with open(path, "rb") as f:
                            results[r] = pickle.load(f)
                failed = [r for r, (status, _) in results.items() if status == "error"]
                if failed:
                    raise WorldError(f"rank {failed[0]} failed:\n{results[failed[0]][1]}")
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if not p.is_alive() and r not in results and not (Path(out_dir) / f"rank-{r}.pkl").exists()
                ]
                if dead:
                    raise WorldError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} and no report")
                if time.monotonic() > deadline:
                    raise WorldError(f"world of {nproc} timed out after {timeout:.0f}s (ranks done: {sorted(results)})")
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
                p.join(timeout=10)
    return [results[r][1] for r in range(nproc)]
