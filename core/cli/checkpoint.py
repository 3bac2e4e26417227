"""``unison checkpoint inspect|verify|export``: look at, check and extract checkpoints.

* ``inspect PATH`` – what wrote a checkpoint (from its manifest, nothing is
  hashed); given a ``checkpoint_dir``, every committed checkpoint in commit order.
* ``verify PATH`` – hash every file against the manifest; exit 1 naming the
  first bad file. Given a ``checkpoint_dir``, verifies each committed checkpoint.
* ``export PATH OUT`` – the canonical weights as a safetensors file, for
  ``safetensors.torch.load_file`` and the plain model's ``load_state_dict``;
  ``export --format hf --config RUN.toml PATH OUT`` – a Hugging Face model
  directory (``save_pretrained`` layout) that ``from_pretrained`` loads, the
  model built by the config's model factory.

PATH is a local path or an ``s3://bucket/prefix`` URL (object storage is read
through :func:`unison.checkpointing.storage.open_storage`, configured by the usual AWS
variables).

Exit codes: 0 fine, 1 a checkpoint failed verification, 2 bad input.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from unison.checkpointing.storage import LocalStorage, open_storage

# unison.checkpointing.checkpointer and unison.checkpointing.manifest import torch: each command imports them
# when it runs, so ``unison --help`` does not.

console = Console()


def _open(location: str) -> tuple[Path, LocalStorage]:
    """The path and storage of a location; a local one must exist."""
    path, storage = open_storage(location)
    if isinstance(path, Path) and type(storage) is LocalStorage and not path.exists():
        raise click.BadParameter(f"{location} does not exist", param_hint="PATH")
    return path, storage


def _targets(path: Path, storage: LocalStorage) -> tuple[list[Path], bool]:
    """``([checkpoint], False)`` for a checkpoint, ``([each committed], True)`` for a checkpoint_dir."""
    from unison.checkpointing.checkpointer import Checkpointer
    from unison.checkpointing.manifest import MANIFEST

    if storage.exists(path / MANIFEST):
        return [path], False
    if not storage.is_dir(path):
        raise click.BadParameter(f"{path} is neither a checkpoint nor a directory", param_hint="PATH")
    found = [c.path for c in Checkpointer(path, storage=storage).committed()]
    if not found:
        raise click.BadParameter(f"{path} holds no committed checkpoint (no {MANIFEST})", param_hint="PATH")
    return found, True


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)


@click.group("checkpoint")
def checkpoint() -> None:
    """Inspect, verify and export unison checkpoints."""


@checkpoint.command()
@click.argument("location", metavar="PATH")
def inspect(location: str) -> None:
    """Show what wrote the checkpoint(s) at PATH, oldest commit first (reads manifests only)."""
    from unison.checkpointing.manifest import CheckpointError, Manifest
    from unison.checkpointing.paths import LATEST

    path, storage = _open(location)
    targets, is_root = _targets(path, storage)
    pointer = storage.read_text(path / LATEST).strip() if is_root and storage.exists(path / LATEST) else None
    for target in targets:
        try:
            m = Manifest.read(storage, target)
        except CheckpointError as exc:
            console.print(f"{target.name}  [red]{escape(str(exc))}[/]", highlight=False, soft_wrap=True)
            continue
        mark = " (latest)" if target.name == pointer else ""
        console.print(
            f"{target.name}{mark}  commit {m.commit}  step {m.step}  {m.strategy}  world {m.world_size}  "
            f"{m.precision}  {len(m.files)} files  {_size(m.total_bytes)}  run {m.run}  {m.created}",
            highlight=False,
            soft_wrap=True,
        )
        if not is_root:
            console.print(f"unison {m.unison_version}, torch {m.torch_version}", highlight=False)
            console.print(f"state_dict: {m.state_dict}", highlight=False, soft_wrap=True)
            for name, entry in m.files.items():
                console.print(f"  {name}  {entry.size} bytes  sha256 {entry.sha256}", highlight=False, soft_wrap=True)


@checkpoint.command("verify")
@click.argument("location", metavar="PATH")
def verify_cmd(location: str) -> None:
    """Check every file of the checkpoint(s) at PATH against the manifest (sha256)."""
    from unison.checkpointing.manifest import CheckpointError, verify

    path, storage = _open(location)
    targets, _ = _targets(path, storage)
    failed = 0
    for target in targets:
        try:
            m = verify(storage, target)
        except (CheckpointError, FileNotFoundError) as exc:
            failed += 1
            console.print(f"[red]FAIL[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            continue
        console.print(
            f"[green]ok[/]   {escape(str(target))}: {len(m.files)} files, {_size(m.total_bytes)}, step {m.step}",
            highlight=False,
            soft_wrap=True,
        )
    if failed:
        sys.exit(1)


@checkpoint.command()
@click.argument("location", metavar="PATH")
@click.argument("out", type=click.Path(path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["safetensors", "hf"]),
    default="safetensors",
    show_default=True,
    help="safetensors: one file of the model's weights. hf: a Hugging Face save_pretrained directory.",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="The run's TOML/YAML config; --format hf builds the model with its [model] factory.",
)
@click.option(
    "--max-shard-size",
    default="5GB",
    show_default=True,
    help="--format hf: the largest safetensors shard (e.g. 500MB); more than one writes model.safetensors.index.json.",
)
def export(location: str, out: Path, fmt: str, config_path: str | None, max_shard_size: str) -> None:
    """Write the canonical model weights of checkpoint PATH to OUT (a file, or a directory for --format hf).

    PATH may also be a checkpoint_dir: its latest committed checkpoint is exported.
    """
    from unison.checkpointing.checkpointer import Checkpointer
    from unison.checkpointing.manifest import MANIFEST, CheckpointError

    if fmt == "hf" and config_path is None:
        raise click.BadParameter(
            "--format hf builds the model from the run's config: pass --config RUN.toml", param_hint="--config"
        )
    if fmt == "safetensors" and out.is_dir():
        raise click.BadParameter(f"{out} is a directory; give a file name such as model.safetensors", param_hint="OUT")
    if fmt == "hf" and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise click.BadParameter(f"{out} exists and is not an empty directory", param_hint="OUT")
    path, storage = _open(location)
    if not storage.exists(path / MANIFEST):
        latest = Checkpointer(path, storage=storage).latest() if storage.is_dir(path) else None
        if latest is None:
            raise click.BadParameter(f"{path} is not a committed checkpoint", param_hint="PATH")
        path = latest
    try:
        if fmt == "hf":
            from unison.checkpointing.export import export_hf
            from unison.config.load import load_config, resolve_run

            assert config_path is not None
            build_model = resolve_run(*load_config(config_path))["model"]
            try:
                state = export_hf(path, out, build_model, storage, max_shard_size=max_shard_size)
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint="--config") from None
        else:
            from unison.checkpointing.export import export_safetensors

            state = export_safetensors(path, out, storage)
    except CheckpointError as exc:
        console.print(f"[red]FAIL[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(1)
    total = sum(t.numel() * t.element_size() for t in state.values())
    console.print(f"wrote {out}: {len(state)} tensors, {_size(total)}, from {path}", highlight=False, soft_wrap=True)
