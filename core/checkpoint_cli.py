"""``unison checkpoint inspect|verify|export``: look at, check and extract checkpoints.

* ``inspect PATH`` – what wrote a checkpoint (from its manifest, nothing is
  hashed); given a ``checkpoint_dir``, every committed checkpoint in commit order.
* ``verify PATH`` – hash every file against the manifest; exit 1 naming the
  first bad file. Given a ``checkpoint_dir``, verifies each committed checkpoint.
* ``export PATH OUT`` – the canonical weights as a safetensors file, for
  ``safetensors.torch.load_file`` and the plain model's ``load_state_dict``.

PATH is a local path or an ``s3://bucket/prefix`` URL (object storage is read
through :func:`unison.storage.open_storage`, configured by the usual AWS
variables).

Exit codes: 0 fine, 1 a checkpoint failed verification, 2 bad input.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console

from unison.checkpoint import LATEST, Checkpointer
from unison.manifest import MANIFEST, CheckpointError, Manifest, verify
from unison.storage import LocalStorage, open_storage

console = Console()


def _open(location: str) -> tuple[Path, LocalStorage]:
    """The path and storage of a location; a local one must exist."""
    path, storage = open_storage(location)
    if isinstance(path, Path) and type(storage) is LocalStorage and not path.exists():
        raise click.BadParameter(f"{location} does not exist", param_hint="PATH")
    return path, storage


def _targets(path: Path, storage: LocalStorage) -> tuple[list[Path], bool]:
    """``([checkpoint], False)`` for a checkpoint, ``([each committed], True)`` for a checkpoint_dir."""
    if storage.exists(path / MANIFEST):
        return [path], False
    if not storage.is_dir(path):
        raise click.BadParameter(f"{path} is neither a checkpoint nor a directory", param_hint="PATH")
    found = [c.path for c in Checkpointer(path, storage=storage).committed()]
    if not found:
        raise click.BadParameter(f"{path} holds no committed checkpoint (no {MANIFEST})", param_hint="PATH")
    return found, True


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@click.group("checkpoint")
def checkpoint() -> None:
    """Inspect, verify and export unison checkpoints."""


@checkpoint.command()
@click.argument("location", metavar="PATH")
def inspect(location: str) -> None:
    """Show what wrote the checkpoint(s) at PATH, oldest commit first (reads manifests only)."""
    path, storage = _open(location)
    targets, is_root = _targets(path, storage)
    pointer = storage.read_text(path / LATEST).strip() if is_root and storage.exists(path / LATEST) else None
    for target in targets:
        try:
            m = Manifest.read(storage, target)
        except CheckpointError as exc:
            console.print(f"{target.name}  [red]{exc}[/]", highlight=False)
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
    path, storage = _open(location)
    targets, _ = _targets(path, storage)
    failed = 0
    for target in targets:
        try:
            m = verify(storage, target)
        except (CheckpointError, FileNotFoundError) as exc:
            failed += 1
            console.print(f"[red]FAIL[/] {exc}", highlight=False)
            continue
        console.print(
            f"[green]ok[/]   {target}: {len(m.files)} files, {_size(m.total_bytes)}, step {m.step}", highlight=False
        )
    if failed:
        sys.exit(1)


@checkpoint.command()
@click.argument("location", metavar="PATH")
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
def export(location: str, out: Path) -> None:
    """Write the canonical model weights of checkpoint PATH to OUT (safetensors)."""
    from unison.export import export_safetensors

    path, storage = _open(location)
    if not storage.exists(path / MANIFEST):
        latest = Checkpointer(path, storage=storage).latest() if storage.is_dir(path) else None
        if latest is None:
            raise click.BadParameter(f"{path} is not a committed checkpoint", param_hint="PATH")
        path = latest
    try:
        state = export_safetensors(path, out, storage)
    except CheckpointError as exc:
        console.print(f"[red]FAIL[/] {exc}", highlight=False)
        sys.exit(1)
    total = sum(t.numel() * t.element_size() for t in state.values())
    console.print(f"wrote {out}: {len(state)} tensors, {_size(total)}, from {path}", highlight=False, soft_wrap=True)
