"""Verified checkpoints: manifest, commit order, retention, run ownership, auto-resume, refusal of bad files.

Single process (``single``) and the real checkpointer; faults are real files changed on disk.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import unison
from unison.checkpointing.checkpointer import Checkpointer, CheckpointWarning
from unison.checkpointing.manifest import CheckpointError, CorruptCheckpointError, Manifest, verify
from unison.checkpointing.safe_io import UnsafeStateError, decode_rng, dumps, encode_rng, loads
from unison.checkpointing.storage import LocalStorage
from unison.contract.state import rng_state, set_rng_state
from unison.launch.lifecycle import PREEMPTED_EXIT_CODE, Preempted

from helpers import max_abs_diff, mlp, regression_data, train

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"accumulate_grad_batches": 2, "global_batch_size": 16, "grad_clip_norm": None}


def run(tmp: Path, **kw: Any) -> dict[str, Any]:
    kw.setdefault("checkpoint_dir", str(tmp))
    return train("single", record=False, scheduler=True, **{**SMALL, **kw})


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def latest(root: Path) -> str:
    return (root / "latest").read_text().strip()


def rewrite_manifest(ckpt: Path, file: str) -> None:
    """What someone who can write the checkpoint can do: make the manifest vouch for a changed file."""
    raw = json.loads((ckpt / "manifest.json").read_text())
    data = (ckpt / file).read_bytes()
    raw["files"][file] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(raw))


# --------------------------------------------------------------------------- #
# The manifest
# --------------------------------------------------------------------------- #
def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    run(tmp_path, max_steps=4, checkpoint_every_n_steps=2)
    ckpt = tmp_path / "step-00000004"
    m = Manifest.read(LocalStorage(), ckpt)
    assert (m.step, m.strategy, m.world_size, m.precision, m.commit) == (4, "single", 1, "32-true", 2)
    assert m.unison_version == unison.__version__ and m.torch_version == torch.__version__
    on_disk = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    assert sorted(m.files) == [f for f in on_disk if f != "manifest.json"]
    assert {"trainer.pt", "rng/rank-00000.pt", "state/.metadata"} <= set(m.files)
    for name, entry in m.files.items():
        data = (ckpt / name).read_bytes()
        assert entry.size == len(data) and entry.sha256 == hashlib.sha256(data).hexdigest()
    assert Manifest.read(LocalStorage(), tmp_path / "step-00000002").run == m.run
    assert not list(tmp_path.glob(".*partial"))


# --------------------------------------------------------------------------- #
# Retention and re-saves
# --------------------------------------------------------------------------- #
def test_pruning_with_higher_numbered_checkpoints_present_keeps_the_new_one_and_latest(tmp_path):
    run(tmp_path, max_steps=20, checkpoint_every_n_steps=5, keep_last_n_checkpoints=2)
    assert names(tmp_path) == ["step-00000015", "step-00000020"]
    # Resume the same run from step 15 and train to 18: steps 16-18 are newer
    # commits than step 20, though their names sort before it.
    run(
        tmp_path,
        max_steps=18,
        checkpoint_every_n_steps=1,
        keep_last_n_checkpoints=2,
        ckpt_path=tmp_path / "step-00000015",
    )
    assert names(tmp_path) == ["step-00000017", "step-00000018"]
    assert latest(tmp_path) == "step-00000018"
    assert Checkpointer(tmp_path).latest() == tmp_path / "step-00000018"
    verify(LocalStorage(), tmp_path / "step-00000018")


def test_keep_one_never_deletes_what_was_just_committed(tmp_path):
    run(tmp_path, max_steps=6, checkpoint_every_n_steps=3, keep_last_n_checkpoints=1)
    # auto would resume at step 6, beyond max_steps 4: refused before anything runs, nothing touched.
    with pytest.raises(unison.ConfigurationError, match="beyond max_steps=4"):
        run(tmp_path, max_steps=4, checkpoint_every_n_steps=1, keep_last_n_checkpoints=1, ckpt_path="auto")
    run(tmp_path, max_steps=8, checkpoint_every_n_steps=1, keep_last_n_checkpoints=1, ckpt_path="auto")
    assert names(tmp_path) == ["step-00000008"] and latest(tmp_path) == "step-00000008"


class CrashAfterCommit(Checkpointer):
    """Dies right after a commit, before the replaced copy of the step is removed."""

    def _remove(self, path: Path) -> None:
        raise KeyboardInterrupt("killed between commit and clean-up")


def test_resaving_a_step_commits_the_new_copy_before_removing_the_old(tmp_path):
    ck = Checkpointer(tmp_path)

    def writer(value: float):
        def write(directory: Path) -> dict[str, Any]:
            (directory / "state").mkdir()
            torch.save({"w": torch.tensor([value])}, directory / "state" / "w.pt")
            return {"strategy": "single", "world_size": 1, "precision": "32-true", "state_dict": {}}

        return write

    first = ck.save(5, writer(1.0))
    crashing = CrashAfterCommit(tmp_path)
    crashing.run_id = ck.run_id
    with pytest.raises(KeyboardInterrupt):
        crashing.save(5, writer(2.0))
    # Both complete copies exist; latest names the new one, which verifies.
    assert names(tmp_path) == ["step-00000005", "step-00000005.1"]
    assert latest(tmp_path) == "step-00000005.1" and ck.latest() == tmp_path / "step-00000005.1"
    verify(LocalStorage(), tmp_path / "step-00000005.1")
    assert torch.load(tmp_path / "step-00000005.1" / "state" / "w.pt")["w"].item() == 2.0
    # A normal re-save replaces the older copies of that step once committed.
    third = ck.save(5, writer(3.0))
    assert names(tmp_path) == [third.name] and first.name == "step-00000005"
    assert torch.load(third / "state" / "w.pt")["w"].item() == 3.0


# --------------------------------------------------------------------------- #
# A directory belongs to one run; auto-resume
# --------------------------------------------------------------------------- #
def test_a_fresh_run_refuses_a_directory_holding_another_runs_checkpoints(tmp_path):
    run(tmp_path, max_steps=4, checkpoint_every_n_steps=2)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    with pytest.raises(unison.ConfigurationError, match=r"checkpoint_dir.*another run.*ckpt_path='auto'"):
        run(tmp_path, max_steps=4)
    other = tmp_path.parent / (tmp_path.name + "-other")
    run(other, max_steps=2)
    with pytest.raises(unison.ConfigurationError, match="outside it"):
        run(tmp_path, max_steps=4, ckpt_path=other / "step-00000002")
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before  # nothing touched


def test_auto_starts_fresh_then_resumes_bitwise(tmp_path):
    full = run(tmp_path / "full", max_steps=12)
    fresh = run(tmp_path / "auto", max_steps=6, ckpt_path="auto")
    assert fresh["history"][0]["step"] == 0
    resumed = run(tmp_path / "auto", max_steps=12, ckpt_path="auto")
    assert resumed["history"] == full["history"][6:]  # the history is the steps this fit ran
    assert max_abs_diff(resumed["state"], full["state"]) == 0.0


def test_last_needs_a_committed_checkpoint(tmp_path):
    with pytest.raises(
        unison.ConfigurationError, match=r"ckpt_path.*'last' but .* holds no committed checkpoint.*'auto'"
    ):
        run(tmp_path, max_steps=2, ckpt_path="last")


# --------------------------------------------------------------------------- #
# Refusing altered, truncated and crafted files
# --------------------------------------------------------------------------- #
def flip_byte(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_flipped_byte_is_refused_naming_the_file_and_auto_falls_back(tmp_path):
    full = run(tmp_path / "full", max_steps=8)
    root = tmp_path / "run"
    run(root, max_steps=6, checkpoint_every_n_steps=3)
    tensors = root / "step-00000006" / "state" / "__0_0.distcp"
    flip_byte(tensors)
    with pytest.raises(CorruptCheckpointError, match=r"step-00000006 is corrupt: state/__0_0\.distcp: sha256"):
        run(root, max_steps=8, ckpt_path=root / "step-00000006")
    with pytest.raises(CorruptCheckpointError, match=r"state/__0_0.distcp"):
        run(root, max_steps=8, ckpt_path="last")
    with pytest.warns(CheckpointWarning, match="step-00000006 is corrupt.*falling back"):
        resumed = run(root, max_steps=8, ckpt_path="auto")
    assert resumed["history"] == full["history"][3:]  # continued from step 3, bitwise
    assert max_abs_diff(resumed["state"], full["state"]) == 0.0


def test_a_truncated_file_is_refused_naming_it(tmp_path):
    run(tmp_path, max_steps=2)
    trainer_pt = tmp_path / "step-00000002" / "trainer.pt"
    trainer_pt.write_bytes(trainer_pt.read_bytes()[:-10])
    with pytest.raises(CorruptCheckpointError, match=r"trainer\.pt: size .*truncated"):
        run(tmp_path, max_steps=4, ckpt_path="last")
    # auto too: the only commit fails and there is nothing to fall back to.
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError, match=r"verifies .*trainer\.pt: size"):
        run(tmp_path, max_steps=4, ckpt_path="auto")


def test_a_file_not_in_the_manifest_is_refused(tmp_path):
    run(tmp_path, max_steps=2)
    (tmp_path / "step-00000002" / "state" / "extra.bin").write_bytes(b"planted")
    with pytest.raises(CorruptCheckpointError, match=r"state/extra.bin: not listed in the manifest"):
        verify(LocalStorage(), tmp_path / "step-00000002")


class Exploit:
    """Unpickling this creates ``marker``: stands for any code a crafted file could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


@pytest.mark.parametrize("manifest_too", [False, True], ids=["file-only", "manifest-rewritten"])
def test_a_crafted_trainer_state_is_refused_without_running_it(tmp_path, manifest_too):
    run(tmp_path, max_steps=2)
    ckpt, marker = tmp_path / "step-00000002", tmp_path / "pwned"
    torch.save({"progress": Exploit(marker)}, ckpt / "trainer.pt")
    if manifest_too:
        rewrite_manifest(ckpt, "trainer.pt")
    with pytest.raises(
        CorruptCheckpointError, match="trainer.pt: " + ("would unpickle" if manifest_too else "size|sha256")
    ):
        run(tmp_path, max_steps=4, ckpt_path="last")
    assert not marker.exists()


def test_crafted_dcp_metadata_is_refused_without_running_it(tmp_path):
    run(tmp_path, max_steps=2)
    ckpt, marker = tmp_path / "step-00000002", tmp_path / "pwned"
    (ckpt / "state" / ".metadata").write_bytes(pickle.dumps(Exploit(marker)))
    rewrite_manifest(ckpt, "state/.metadata")
    with pytest.raises(CorruptCheckpointError, match=r"state/\.metadata: refused to unpickle.*posix\.mkdir"):
        run(tmp_path, max_steps=4, ckpt_path="last")
    assert not marker.exists()


class Opaque:
    """An ordinary object: picklable, but not plain data."""


def test_loads_refuses_arbitrary_objects_and_dumps_refuses_to_write_them(tmp_path):
    marker = tmp_path / "pwned"
    buffer = io.BytesIO()
    torch.save(Exploit(marker), buffer)
    with pytest.raises(UnsafeStateError, match="refusing to unpickle"):
        loads(buffer.getvalue(), "crafted.pt")
    assert not marker.exists()
    with pytest.raises(UnsafeStateError, match=r"test_checkpoint_verified.Opaque"):
        dumps({"plugin": Opaque()}, "the trainer state")


class StoresAnObject:
    @unison.hookimpl
    def unison_on_save_checkpoint(self, checkpoint):
        checkpoint["mine"] = Path("not plain data")


def test_a_plugin_storing_an_arbitrary_object_fails_at_save_with_its_type(tmp_path):
    trainer = unison.Trainer(
        strategy="single", max_steps=2, global_batch_size=16, checkpoint_dir=str(tmp_path), callbacks=[StoresAnObject()]
    )
    with pytest.raises(UnsafeStateError, match=r"pathlib.PosixPath"):
        trainer.fit(
            mlp(),
            regression_data(),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        )
    assert not list(tmp_path.glob("step-*"))


def test_rng_state_survives_plain_data_encoding():
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    state = rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(decode_rng(loads(dumps(encode_rng(state), "rng"), "rng")))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


# --------------------------------------------------------------------------- #
# Preemption (one process; the 2-rank case is in test_lifecycle.py)
# --------------------------------------------------------------------------- #
class SignalAt:
    def __init__(self, step: int, sig: signal.Signals) -> None:
        self.step, self.sig = step, sig

    @unison.hookimpl
    def unison_on_train_step_end(self, step):
        if step + 1 == self.step:
            os.kill(os.getpid(), self.sig)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_commits_the_step_and_exits_75_then_auto_continues_bitwise(tmp_path, sig):
    full = run(tmp_path / "full", max_steps=10)
    root = tmp_path / "run"
    trainer = unison.Trainer(
        strategy="single",
        max_steps=10,
        checkpoint_dir=str(root),
        checkpoint_every_n_steps=4,
        callbacks=[SignalAt(6, sig)],
        **SMALL,
    )
    previous = signal.getsignal(sig)
    with pytest.raises(Preempted) as info:
        trainer.fit(
            mlp(),
            regression_data(),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
            lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5),
        )
    assert isinstance(info.value, SystemExit) and info.value.code == PREEMPTED_EXIT_CODE == 75
    assert info.value.step == 6 and info.value.signal_name == sig.name
    assert signal.getsignal(sig) == previous  # handlers restored
    assert names(root) == ["step-00000004", "step-00000006"] and latest(root) == "step-00000006"
    verify(LocalStorage(), root / "step-00000006")
    resumed = run(root, max_steps=10, ckpt_path="auto")
    assert resumed["history"] == full["history"][6:]
    assert max_abs_diff(resumed["state"], full["state"]) == 0.0


# --------------------------------------------------------------------------- #
# unison checkpoint inspect | verify | export
# --------------------------------------------------------------------------- #
def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "unison.cli", "checkpoint", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )


def test_checkpoint_cli_inspect_verify_export(tmp_path):
    out = run(tmp_path, max_steps=4, checkpoint_every_n_steps=2)
    ckpt = tmp_path / "step-00000004"
    shown = cli("inspect", str(tmp_path))
    assert shown.returncode == 0, shown.stderr
    assert "step-00000004 (latest)  commit 2  step 4  single  world 1  32-true" in shown.stdout
    ok = cli("verify", str(tmp_path))
    assert ok.returncode == 0 and ok.stdout.count("ok ") == 2, ok.stdout + ok.stderr

    exported = cli("export", str(ckpt), str(tmp_path / "model.safetensors"))
    assert exported.returncode == 0, exported.stderr
    from safetensors.torch import load_file

    model = mlp()
    model.load_state_dict(load_file(str(tmp_path / "model.safetensors")))  # strict: every name matches
    assert max_abs_diff(model.state_dict(), out["state"]) == 0.0

    flip_byte(ckpt / "trainer.pt", 50)
    bad = cli("verify", str(ckpt))
    assert bad.returncode == 1 and "trainer.pt" in bad.stdout and "sha256" in bad.stdout
    refused = cli("export", str(ckpt), str(tmp_path / "again.safetensors"))
    assert refused.returncode == 1 and "trainer.pt" in refused.stdout
    assert not (tmp_path / "again.safetensors").exists()


def test_verify_all_bad_manifests_under_auto_is_an_error(tmp_path):
    run(tmp_path, max_steps=2)
    (tmp_path / "step-00000002" / "manifest.json").write_text("{ not json")
    with (
        pytest.raises(CheckpointError, match=r"no committed checkpoint .* verifies"),
        pytest.warns(CheckpointWarning, match="manifest.json: unreadable"),
    ):
        run(tmp_path, max_steps=4, ckpt_path="auto")


# --------------------------------------------------------------------------- #
# unison train --resume
# --------------------------------------------------------------------------- #
FACTORIES = """
import torch
from torch.utils.data import TensorDataset


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def datasets():
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(128, 8, generator=g), torch.randn(128, 1, generator=g)), None


loss = torch.nn.functional.mse_loss
"""


def test_unison_train_refuses_a_used_directory_and_resumes_with_resume_auto(tmp_path):
    (tmp_path / "factories.py").write_text(FACTORIES)
    ckpt = tmp_path / "ckpt"
    (tmp_path / "run.toml").write_text(f'''
[trainer]
global_batch_size = 8
max_steps = 4
checkpoint_dir = "{ckpt}"
checkpoint_every_n_steps = 2
progress = "off"
[model]
factory = "factories.py:model"
[data]
factory = "factories.py:datasets"
[loss]
factory = "factories.py:loss"
''')

    def train_cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "unison.cli", "train", str(tmp_path / "run.toml"), *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )

    first = train_cli()
    assert first.returncode == 0, first.stderr
    again = train_cli()
    assert again.returncode == 2 and "--resume auto" in " ".join(again.stdout.split())
    resumed = train_cli("--resume", "auto", "--max-steps", "6")
    assert resumed.returncode == 0, resumed.stderr
    manifests = [Manifest.read(LocalStorage(), ckpt / n) for n in names(ckpt)]
    assert [(m.step, m.commit) for m in manifests] == [(2, 1), (4, 2), (6, 3)]
    assert len({m.run for m in manifests}) == 1  # one run, resumed
    no_resume = train_cli("--max-restarts", "1")
    assert no_resume.returncode == 2 and "--max-restarts needs --resume auto" in no_resume.stdout + no_resume.stderr
