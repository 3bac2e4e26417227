"""The ``unison`` command line.

* ``unison strategies`` – every registered strategy, available or not (with why).
* ``unison precisions`` – every registered precision plugin, available or not (with why).
* ``unison describe NAME`` – the strategy's ownership declaration.
* ``unison run --nproc N [TORCHRUN_OPTION=VALUE ...] script.py [ARGS]`` – torchrun (multi-node options
  given or derived from SLURM / Kubernetes, see :mod:`unison.launch.cluster`).
* ``unison train CONFIG [--set KEY=VALUE ...] [--strategy NAME] [--nproc N] [--resume auto|PATH]
  [--nnodes N --rdzv-endpoint ...]`` – train from a config file; ``--set`` overrides any key.
* ``unison checkpoint inspect|verify|export PATH`` – see :mod:`unison.cli.checkpoint`.

Plugins add more commands through ``unison_add_cli_commands``
(``unison conformance`` comes from the conformance suite that way).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

# Only light modules here: torch and the plugins load when a command needs them
# (``unison --help`` imports neither; see PluginManager(lazy=True)).
from unison.cli.checkpoint import checkpoint as checkpoint_commands
from unison.errors import UnisonError
from unison.launch import messages
from unison.plugin.manager import PluginManager

if TYPE_CHECKING:
    from unison.checkpointing.resume import ResumeRequest

console = Console()


@click.group()
def cli() -> None:
    """unison: PyTorch training whose distributed backends are swapped by name."""


@cli.command()
def strategies() -> None:
    """List registered strategies, their aliases and availability."""
    pm = PluginManager(lazy=True)
    table = Table(title="unison strategies")
    for col in ("name", "aliases", "available", "description"):
        table.add_column(col)
    for spec in pm.strategies.specs():
        # Plugin text is not markup: rich would eat "[deepspeed]" in an install hint.
        table.add_row(
            escape(spec.name),
            escape(", ".join(spec.aliases) or "-"),
            "yes" if spec.unavailable is None else escape(f"no: {spec.unavailable}"),
            escape(spec.description),
        )
    console.print(table)


@cli.command()
def precisions() -> None:
    """List registered precision plugins and their availability.

    A strategy uses a precision plugin only where its declaration says the
    trainer or a plugin applies that precision (``unison describe NAME``).
    """
    pm = PluginManager(lazy=True)
    table = Table(title="unison precisions")
    for col in ("name", "available", "description"):
        table.add_column(col)
    for spec in pm.precisions.specs():
        table.add_row(
            escape(spec.name),
            "yes" if spec.unavailable is None else escape(f"no: {spec.unavailable}"),
            escape(spec.description),
        )
    console.print(table)


@cli.command()
@click.argument("name")
def describe(name: str) -> None:
    """Print who owns accumulation, precision and state_dict for strategy NAME."""
    pm = PluginManager(lazy=True)
    spec, options = pm.strategies.resolve(name)
    if spec.unavailable:
        console.print(f"[yellow]{escape(name)}: unavailable here: {escape(spec.unavailable)}[/]")
    strategy = spec.factory(**options.model_dump())
    d = strategy.ownership.to_dict()
    console.print(f"[bold]{escape(name)}[/]  {escape(spec.description)}")
    console.print(f"options: {options.model_dump()}")
    ga = d["grad_accumulation"]
    sync = f" (gradients synchronised: {ga['sync']})" if ga["owner"] == "trainer" else ""
    console.print(f"gradient accumulation: owned by [bold]{ga['owner']}[/]{sync} – {escape(ga['mechanism'])}")
    ln = d["loss_normalisation"]
    pairs = "refused" if "item_weighted_loss" in d["refuses"] else "taken"
    console.print(
        f"loss normalisation: backward divides by [bold]{ln['divisor']}[/]; gradients reduced by "
        f"[bold]{ln['replicas']}[/] over {escape(ln['over'])}"
        + ("" if ln["declared"] else " (not declared: the trainer path's default)")
        + f"; (loss_sum, num_items) losses {pairs}: {escape(ln['scaled_by'])}"
    )
    console.print(f"replicas start equal: made so by the [bold]{d['replica_init']}[/]")
    forms = [f for f in ("loss_fn", "training_step") if f not in d["refuses"]]
    console.print(
        f"batch forms accepted: {', '.join(forms) or 'none'}"
        + "".join(f"; {f} refused" for f in ("loss_fn", "training_step") if f in d["refuses"])
    )
    ws = d["world_sizes"]
    if ws["minimum"] > 1 or ws["multiple_of"] > 1:
        console.print(
            f"world sizes: at least {ws['minimum']}, multiples of {ws['multiple_of']} – {escape(ws['reason'])}"
        )
    if d["mesh"] is not None:
        mesh = Table(title=f"device mesh: {escape(d['mesh']['shape'])} (outermost first)")
        for col in ("dimension", "size", "splits", "collectives"):
            mesh.add_column(col)
        for dim in d["mesh"]["dims"]:
            size = "rest of the world" if dim["size"] is None else str(dim["size"])
            mesh.add_row(escape(dim["name"]), size, escape(dim["shards"]), escape(dim["collectives"]))
        console.print(mesh)
    table = Table(title="precision")
    for col in ("precision", "applied by", "detail"):
        table.add_column(col)
    for prec, support in d["precision"].items():
        table.add_row(prec, support["owner"], support["detail"])
    console.print(table)
    sd = d["state_dict"]
    console.print(
        f"state_dict: [bold]{sd['kind']}[/], format: {sd['format']}; reshardable: {sd['reshardable']}; "
        f"canonical export: {sd['canonical_export']}"
    )
    refusals = Table(title="refuses (before any process group)")
    for col in ("feature", "reason"):
        refusals.add_column(col)
    for feature, reason in d["refuses"].items():
        refusals.add_row(feature, escape(reason))
    if d["refuses"]:
        console.print(refusals)
    else:
        console.print("refuses: nothing (every batch form and feature is supported)")
    if d["non_conformant"]:
        console.print(f"[red]non-conformant: {d['non_conformant']}[/]")
    for note in d["notes"]:
        console.print(f"note: {note}")


_NPROC_HELP = "Processes on this node (default: the cluster environment's count, else 1)."
_LOG_FORMAT_HELP = (
    "unison's messages as text lines (default) or one JSON object per line (time, level, rank, node, step, "
    "run_id, message), in this process and every worker; sets UNISON_LOG_FORMAT."
)
_CLUSTER_HELP = "Cluster environment (torchrun, slurm, kubernetes...); default: detected from the environment."


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--nproc", type=click.IntRange(min=1), default=None, help=_NPROC_HELP)
@click.option("--cluster", default=None, metavar="NAME", help=_CLUSTER_HELP)
@click.option("--log-format", type=click.Choice(["text", "json"]), default=None, help=_LOG_FORMAT_HELP)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(nproc: int | None, cluster: str | None, log_format: str | None, args: tuple[str, ...]) -> None:
    """Run a training script under torchrun: ``unison run --nproc 2 train.py --lr 1e-3``.

    Options before the script, in ``--name=value`` form, go to torchrun
    (``--nnodes=2 --node-rank=0 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --rdzv-id=JOB
    --max-restarts=3``). Under SLURM (srun) or a Kubernetes PyTorchJob the
    multi-node options are derived from the scheduler's variables.
    """
    torchrun_args = []
    rest = list(args)
    while rest and rest[0].startswith("-"):
        torchrun_args.append(rest.pop(0))
    if not rest:
        raise click.UsageError("no script given")
    messages.configure(log_format)  # the launcher's report and every worker's messages
    from unison.launch.torchrun import run_script

    sys.exit(run_script(rest[0], nproc, rest[1:], torchrun_args, cluster))


@cli.command()
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option("--strategy", default=None, help="Override [trainer] strategy.")
@click.option("--nproc", type=click.IntRange(min=1), default=None, help=_NPROC_HELP + " Overrides [trainer] nproc.")
@click.option("--max-steps", type=click.IntRange(min=1), default=None, help="Override [trainer] max_steps.")
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override any config key, e.g. --set trainer.checkpoint_dir=runs/b --set optimizer.kwargs.lr=3e-4 "
    "(VALUE is read as a TOML value, else as text); validated like the file. Repeatable.",
)
@click.option(
    "--resume",
    default=None,
    metavar="auto|PATH",
    help="Resume: 'auto' = the newest run's last committed checkpoint (root_dir) or the newest in "
    "checkpoint_dir, or a fresh start if none; or a checkpoint directory.",
)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Restart all workers this many times when one fails (needs --resume auto).",
)
@click.option("--nnodes", default=None, metavar="N|MIN:MAX", help="Nodes in the job (torchrun --nnodes).")
@click.option("--node-rank", type=click.IntRange(min=0), default=None, help="This node's rank (torchrun --node-rank).")
@click.option("--rdzv-backend", default=None, metavar="NAME", help="Rendezvous backend, e.g. c10d.")
@click.option("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="Rendezvous endpoint every node reaches.")
@click.option("--rdzv-id", default=None, metavar="ID", help="Job id shared by the nodes.")
@click.option("--cluster", default=None, metavar="NAME", help=_CLUSTER_HELP)
@click.option("--log-format", type=click.Choice(["text", "json"]), default=None, help=_LOG_FORMAT_HELP)
def train(
    config: str,
    strategy: str | None,
    nproc: int | None,
    max_steps: int | None,
    sets: tuple[str, ...],
    resume: str | None,
    max_restarts: int,
    nnodes: str | None,
    node_rank: int | None,
    rdzv_backend: str | None,
    rdzv_endpoint: str | None,
    rdzv_id: str | None,
    cluster: str | None,
    log_format: str | None,
) -> None:
    """Train from a TOML or YAML CONFIG (see unison.config.load for the layout).

    With ``--nproc`` above 1, multi-node options, or under SLURM (srun) or a
    Kubernetes PyTorchJob, the config is checked here and then trained by
    torchrun's workers (every node runs the same command).
    """
    from unison.checkpointing.resume import ResumeKind, ResumeRequest  # no torch: a bad form fails at once

    messages.configure(log_format)  # before the first line; the workers inherit it (UNISON_LOG_FORMAT)
    request = ResumeRequest.parse(resume)
    if max_restarts and request.kind is not ResumeKind.AUTO:
        # A restarted world must continue from its last checkpoint, not refuse its own directory.
        raise click.UsageError("--max-restarts needs --resume auto")
    if "LOCAL_RANK" not in os.environ:  # at once, before torch loads (seconds); workers stay quiet
        _say(f"unison train {config}: loading torch, checking the config")
    from unison.config.load import load_config, resolve_run
    from unison.training.preflight import build_strategy

    overrides: dict[str, Any] = {}
    if strategy is not None:
        overrides["strategy"] = strategy
    if max_steps is not None:
        overrides["max_steps"] = max_steps
    run_config, base = load_config(config, overrides, sets)
    given = {
        "--nnodes": nnodes,
        "--node-rank": node_rank,
        "--rdzv-backend": rdzv_backend,
        "--rdzv-endpoint": rdzv_endpoint,
        "--rdzv-id": rdzv_id,
    }
    node_args = [f"{flag}={value}" for flag, value in given.items() if value is not None]
    if "LOCAL_RANK" in os.environ:  # a worker torchrun started: train
        _train_here(config, overrides, sets, request)
        return
    from unison.launch.torchrun import cluster_launch, run_script

    pm = PluginManager(lazy=True)
    nproc, node_args, launch = cluster_launch(nproc or run_config.trainer.nproc, node_args, cluster, pm)
    multi_node = launch.multi_node or nnodes is not None
    if nproc > 1 or max_restarts or multi_node:
        # Validate before any worker or process group starts, then relaunch.
        nodes = (nnodes or launch.nnodes or "1").split(":")[-1]
        build_strategy(run_config.trainer, pm, nproc * int(nodes) if nodes.isdigit() else nproc)
        resolve_run(run_config, base)  # every factory, file and keyword
        _config_plugins(run_config, base, pm)  # loggers and callbacks: constructing them checks their options
        if not multi_node:  # (nodes each launch: there rank 0 chooses the run directory for all)
            from unison.training.runs import choose_for_workers

            choose_for_workers(run_config.trainer, request)  # refusals once, here; one version_N for every rank
        # (workers see LOCAL_RANK and train; no --nproc, which torchrun would take as its own)
        argv = [
            "train",
            config,
            *(["--strategy", strategy] if strategy else []),
            *(["--max-steps", str(max_steps)] if max_steps is not None else []),
            *(arg for item in sets for arg in ("--set", item)),
            *(["--resume", resume] if resume is not None else []),
        ]
        sys.exit(
            run_script("unison.cli", nproc, argv, ["--module", f"--max-restarts={max_restarts}", *node_args], cluster)
        )
    _train_here(config, overrides, sets, request)


def _train_here(
    config_path: str, overrides: dict[str, Any], sets: tuple[str, ...] = (), resume: ResumeRequest | None = None
) -> None:
    from unison.config.load import load_config, resolve_run
    from unison.training.trainer import Trainer

    config, base = load_config(config_path, overrides, sets)
    run = resolve_run(config, base)
    pm = PluginManager()  # a training run: every plugin, in registration order
    settings = config.trainer.model_dump()
    if "LOCAL_RANK" in os.environ:  # a worker: the launcher started as many as --nproc or [trainer] nproc asked
        settings["nproc"] = None
    trainer = Trainer(plugin_manager=pm, callbacks=_config_plugins(config, base, pm), **settings)
    train_ds, val_ds = run["data"]()
    progress = trainer.fit(
        # A factory: the trainer seeds before building, so reruns and ranks start alike.
        run["model"],
        train_ds,
        **run["form"],
        optimizer=run["optimizer"],
        lr_scheduler=run["lr_scheduler"],
        val_dataset=val_ds,
        ckpt_path=resume,
    )
    if trainer.is_global_zero:
        last = progress.history[-1] if progress.history else None
        _say(f"final train loss: {last['loss']:.4f}" if last else "no step was run")
        if trainer.last_validation is not None:
            _say(f"final validation loss: {trainer.last_validation['val/loss']:.4f}")
        if progress.checkpoint is not None:
            _say(f"checkpoint: {progress.checkpoint}")
        if progress.run_dir is not None:
            _say(f"run: {progress.run_dir}")


def _say(line: str) -> None:
    """A result line on stdout: plain text, or one JSON object in the json log format."""
    if messages.log_format() == "json":
        messages.say(line, file=sys.stdout)
    else:
        # soft_wrap: no line breaks of rich's own (80 columns off a terminal) inside a path
        console.print(line, highlight=False, markup=False, soft_wrap=True)


def _config_plugins(config: Any, base: Any, pm: PluginManager) -> list[Any]:
    """Plugins a config asks for: ``[logging]`` etc. through ``unison_plugins_from_config``, then ``[[callbacks]]``."""
    from unison.config.load import build_callbacks

    return pm.unison_plugins_from_config(config=config) + build_callbacks(config, base)


cli.add_command(checkpoint_commands)


def main(argv: list[str] | None = None) -> None:
    try:
        # Inside the try: a broken plugin is reported like any other error.
        PluginManager(lazy=True).unison_add_cli_commands(cli=cli)
        cli.main(args=argv, prog_name="unison", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort as exc:
        # Ctrl-C: the shell's convention (128 + SIGINT), so scripts can tell an interrupt from a failure
        sys.exit(130 if isinstance(exc.__cause__, KeyboardInterrupt) else 1)
    except UnisonError as exc:
        if "LOCAL_RANK" in os.environ:  # a worker: recorded for the launcher's one report (or printed once)
            from unison.launch.lifecycle import report_worker_failure

            sys.exit(report_worker_failure(exc))
        # An error in this process itself (before any worker, or a run trained here): printed once, and
        # the error's own exit code (a ConfigurationError or PluginError 2, any other UnisonError 1; unison.errors).
        # escape: messages name extras like unison[tensorboard], which rich would read as markup
        if messages.log_format() == "json":
            messages.say(f"error: {exc}", level="error")
        else:
            # soft_wrap: a path in the message stays whole however long (a terminal wraps it itself)
            console.print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
