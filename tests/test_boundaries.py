"""Nothing unison writes leaves the run's directories: symbolic links planted at its names are refused.

A link planted in a checkpoint directory, a run directory or at a metrics file
(``.latest.tmp`` -> a file outside, ``.step-00000010.partial`` -> a directory
outside, ...) is never written, replaced or deleted through
(:mod:`unison.checkpointing.nofollow`): a run refuses it, naming the link
(exit code 2), and every byte outside stays as it was. Links planted after the
checks (during a run) meet the storage's no-follow operations, which refuse
them the same way. A ``checkpoint_dir`` that is itself a link the user made is
followed: that is their choice of where checkpoints go.

No code runs from outside the trust roots: the workers of ``--nproc 2`` start
without the working directory on ``sys.path`` (:mod:`unison.launch.worker`),
so a ``json.py`` there is never imported.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import storage_job
import torch

import unison
from unison.checkpointing.checkpointer import Checkpointer
from unison.checkpointing.nofollow import PlantedLinkError
from unison.checkpointing.storage import LocalStorage
from unison.cli import main

from helpers import fit

HERE = Path(__file__).resolve().parent


def _snapshot(path: Path) -> dict[str, str]:
    """Every file and directory under ``path`` (itself included) with its content's sha256."""
    if path.is_file():
        return {".": hashlib.sha256(path.read_bytes()).hexdigest()}
    out = {}
    for p in sorted(path.rglob("*")):
        out[p.relative_to(path).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


@pytest.fixture
def outside(tmp_path):
    """A file and a directory outside every directory a run is given, and their snapshot."""
    base = tmp_path / "outside"
    base.mkdir()
    (base / "precious.txt").write_text("precious\n")
    (base / "dir").mkdir()
    (base / "dir" / "keep.txt").write_text("keep\n")
    before = _snapshot(base)
    yield base
    assert _snapshot(base) == before, "a file outside the run's directories changed"


def _fit(checkpoint_dir=None, root_dir=None, max_steps=2, ckpt_path=None):
    trainer = unison.Trainer(
        strategy="single",
        global_batch_size=8,
        max_steps=max_steps,
        checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir),
        root_dir=None if root_dir is None else str(root_dir),
        checkpoint_every_n_steps=2,
        progress="off",
        loggers=False if root_dir is None else None,
    )
    return fit(
        trainer,
        model=storage_job.model,
        data=storage_job.datasets()[0],
        loss_fn=storage_job.loss,
        ckpt_path=ckpt_path,
    )


def test_the_planted_links_of_the_report_are_refused_by_unison_train_naming_the_link(tmp_path, outside, capsys):
    # The reported attack: before, the run exited 0 after writing "step-00000010" into the outside file
    # and a whole checkpoint into the outside directory.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".latest.tmp").symlink_to(outside / "precious.txt")
    (ckpt / ".step-00000010.partial").symlink_to(outside / "dir")
    (tmp_path / "storage_job.py").write_text((HERE / "storage_job.py").read_text())
    config = tmp_path / "run.toml"
    config.write_text(storage_job.config(str(ckpt), max_steps=10, every=10, slow=0.0))
    with pytest.raises(SystemExit) as exited:
        main(["train", str(config)])
    out = "".join(capsys.readouterr().out.split())  # (rich wraps long paths anywhere)
    assert exited.value.code == 2, out
    assert f"{ckpt / '.latest.tmp'}isasymboliclink(pointingto{outside / 'precious.txt'})" in out, out
    assert sorted(p.name for p in ckpt.iterdir()) == [".latest.tmp", ".step-00000010.partial"]  # nothing written
    assert not torch.distributed.is_initialized()


#: Every name unison writes, replaces or removes directly under a checkpoint root.
NAMES = [
    "latest",
    ".latest.tmp",
    ".latest.4242.0123abcd.tmp",
    ".unison-lease",
    ".unison-lease.guard",
    ".step-00000002.partial",
    "step-00000002",
    ".write-probe-4242-0123abcd",
]


@pytest.mark.parametrize("name", NAMES)
def test_a_link_at_any_name_unison_writes_in_a_checkpoint_dir_is_refused_before_training(tmp_path, outside, name):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    target = outside / ("dir" if "step" in name else "precious.txt")
    (ckpt / name).symlink_to(target)
    with pytest.raises(PlantedLinkError, match=rf"checkpoint_dir: {ckpt / name} is a symbolic link \(pointing to "):
        _fit(ckpt, ckpt_path="auto" if name.startswith("step") else None)
    assert [p.name for p in ckpt.iterdir() if not p.is_symlink()] == []  # nothing of the run
    assert (ckpt / name).is_symlink()  # not unison's to delete


def test_links_planted_during_a_run_are_never_followed_by_any_storage_operation(tmp_path, outside):
    # After the checks before training, every write, rename and delete still refuses a link.
    storage, root = LocalStorage(), tmp_path / "ckpt"
    root.mkdir()
    file_link, dir_link = root / "file-link", root / ".step-00000004.partial"
    file_link.symlink_to(outside / "precious.txt")
    dir_link.symlink_to(outside / "dir")
    for operation in (
        lambda: storage.write_bytes(file_link, b"x"),
        lambda: storage.replace_file(file_link, "x"),
        lambda: storage.make_dir(dir_link),
        lambda: storage.remove_tree(dir_link),
        lambda: storage.remove_file(file_link),
        lambda: storage.commit_dir(dir_link, root / "step-00000004"),
        lambda: storage.write_if(file_link, b"x", None),
    ):
        with pytest.raises(PlantedLinkError):
            operation()
    assert not (root / "step-00000004").exists()
    # The checkpointer's own save, reached without the checks before training (a script driving it).
    with pytest.raises(PlantedLinkError, match=r"\.step-00000004\.partial"):
        Checkpointer(root).save(4, lambda d: {"strategy": "x", "world_size": 1, "precision": "32", "state_dict": "x"})
    assert dir_link.is_symlink() and file_link.is_symlink()


def test_run_directories_refuse_planted_links_and_a_linked_checkpoint_dir_is_followed(tmp_path, outside):
    runs = tmp_path / "runs"
    _fit(root_dir=runs, max_steps=2)  # version_0 with its checkpoints, run.json, metrics
    version = runs / "version_0"
    # run.json, a metrics file or the checkpoints of the version a resume continues: each refused, named.
    for name in ("run.json", "metrics.jsonl", "metrics.csv", "checkpoints"):
        moved = version / f"{name}.moved"
        (version / name).rename(moved)
        # (checkpoints: a link to the real ones, so that the resume finds a checkpoint to continue)
        (version / name).symlink_to(moved if name == "checkpoints" else outside / "precious.txt")
        with pytest.raises(PlantedLinkError, match=rf"root_dir: {version / name} is a symbolic link"):
            _fit(root_dir=runs, max_steps=4, ckpt_path="auto")
        (version / name).unlink()
        moved.rename(version / name)
    # A version_N that is a link: refused when a resume looks for the run to continue.
    (runs / "version_7").symlink_to(outside / "dir")
    with pytest.raises(PlantedLinkError, match=r"version_7 is a symbolic link"):
        _fit(root_dir=runs, max_steps=4, ckpt_path="auto")
    (runs / "version_7").unlink()
    _fit(root_dir=runs, max_steps=4, ckpt_path="auto")  # the same resume, the links gone: it continues
    # The checkpoint_dir the user names may itself be a link: followed, the checkpoints land in its target.
    # A link at a name unison never uses there (a person's note) is left alone: the run trains beside it.
    real = tmp_path / "real"
    real.mkdir()
    (real / "notes.txt").symlink_to(outside / "precious.txt")
    (tmp_path / "linked").symlink_to(real)
    _fit(tmp_path / "linked")
    assert (real / "step-00000002" / "manifest.json").is_file() and os.path.islink(tmp_path / "linked")
    assert sorted(p.name for p in real.iterdir()) == [".unison-lease.guard", "latest", "notes.txt", "step-00000002"]


# --------------------------------------------------------------------------- #
# No code from the working directory: workers start with a safe sys.path.
# --------------------------------------------------------------------------- #
#: A module named like the standard library's json that leaves a marker when imported, then behaves as json.
SHADOW = """
import os, sys
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"IMPORTED-{os.getpid()}"), "w").close()
here = os.path.dirname(os.path.abspath(__file__))
del sys.modules["json"]
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != here]
import json as _json
sys.modules["json"] = _json
globals().update(_json.__dict__)
"""


def _markers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("IMPORTED-*"))


def test_workers_never_import_from_the_working_directory(tmp_path):
    # Before: `python -m unison.launch.worker` put the working directory first on sys.path, and the json.py
    # there ran in both workers of --nproc 2 (not with --nproc 1).
    cwd, configs = tmp_path / "cwd", tmp_path / "configs"
    cwd.mkdir()
    configs.mkdir()
    (cwd / "json.py").write_text(SHADOW)
    (configs / "storage_job.py").write_text((HERE / "storage_job.py").read_text())
    config = configs / "run.toml"
    text = storage_job.config(str(tmp_path / "ckpt"), max_steps=2, every=2, slow=0.0)
    config.write_text(text.replace("[trainer]", '[trainer]\nstrategy = "ddp"'))
    unison_cli = Path(sys.executable).with_name("unison")  # the console script, as a user runs it
    out = subprocess.run(
        [str(unison_cli), "train", str(config), "--nproc", "2"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "final train loss" in out.stdout and (tmp_path / "ckpt" / "step-00000002").is_dir()
    assert _markers(cwd) == [], "a worker imported json.py from the working directory"


def test_the_worker_boot_puts_only_the_script_directory_or_an_installed_module_on_the_path(tmp_path):
    # The same command line the launcher gives torchrun, run directly (no world): cheap, every form.
    from unison.launch.worker import BOOT

    cwd, scripts = tmp_path / "cwd", tmp_path / "scripts"
    cwd.mkdir()
    scripts.mkdir()
    (cwd / "json.py").write_text(SHADOW)
    (scripts / "job.py").write_text("import json, sys\nprint(json.dumps(sys.path[0]))\n")
    (cwd / "mine.py").write_text("import sys\nprint(sys.path[0])\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}

    def worker(*argv: str) -> str:
        done = subprocess.run(
            [sys.executable, "-u", "-c", BOOT, *argv],
            cwd=cwd,
            input="[1]",
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert worker(str(scripts / "job.py")) == f'"{scripts}"'  # the script's directory, not the cwd
    assert worker("--module", "json.tool", "--compact") == "[1]"  # an installed module: the cwd stays off
    assert worker("--module", "mine") == str(cwd)  # a module only the cwd has: found there, as python -m would
    assert _markers(cwd) == []
