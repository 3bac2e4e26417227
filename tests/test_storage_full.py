"""A full disk as checkpoint directory: a 3 MiB tmpfs (needs root; skipped with the reason otherwise).

The failing save names ENOSPC, the path and about how many bytes it needed,
leaves no partial file, and keeps every committed checkpoint. After space is
freed (the tmpfs is grown, nobody deletes a file) ``ckpt_path="auto"``
completes, cleaning a crashed save's leftovers before its write probe.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

import unison
from unison.checkpointing.checkpointer import Checkpointer
from unison.checkpointing.manifest import CheckpointError, verify


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # 101 k parameters: about 1.2 MB a checkpoint with AdamW's two moments
    return torch.nn.Sequential(
        torch.nn.Linear(8, 256), torch.nn.Tanh(), torch.nn.Linear(256, 384), torch.nn.Linear(384, 1)
    )


def _fit(root: Path, ckpt_path: str | None) -> unison.Trainer:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    trainer = unison.Trainer(
        strategy="single", global_batch_size=8, max_steps=6, checkpoint_dir=str(root), checkpoint_every_n_steps=2
    )
    trainer.fit(
        _model,
        data,
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        ckpt_path=ckpt_path,
    )
    return trainer


def _leftovers(root: Path) -> list[str]:
    return sorted(n for n in (p.name for p in root.iterdir()) if n.endswith(".partial") or n.startswith(".write-probe"))


@pytest.mark.timeout(120)
def test_a_full_disk_is_named_leaves_no_partial_and_resume_completes_once_space_is_freed(small_disk):
    root = small_disk / "ckpt"
    # Steps 2 and 4 fit (about 2.4 MB); step 6 does not.
    with pytest.raises(CheckpointError) as info:
        _fit(root, None)
    message = str(info.value)
    assert re.search(
        rf"ENOSPC: no space left on {re.escape(str(root))} \(\d+ bytes free\), needed about \d+ bytes", message
    )
    needed = int(re.search(r"needed about (\d+) bytes", message).group(1))
    committed = Checkpointer(root).committed()
    assert [c.manifest.step for c in committed] == [2, 4]
    assert needed >= committed[-1].manifest.total_bytes > 500_000
    assert "step-00000004 is untouched" in message and _leftovers(root) == []
    for c in committed:
        verify(Checkpointer(root).storage, c.path)  # every commit intact

    # Free space without deleting anything: grow the tmpfs. Then fill it again with what a SIGKILLed save
    # would leave (a partial directory) and an old write probe, so only the cleanup before the probe helps.
    subprocess.run(["mount", "-o", "remount,size=5m", str(small_disk)], check=True)
    (root / ".step-00000006.partial").mkdir()
    (root / ".write-probe-1-deadbeef").write_bytes(b"")
    with open(root / ".step-00000006.partial" / "state.bin", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
    trainer = _fit(root, "auto")
    assert trainer.progress.history[0]["step"] == 4  # resumed from step 4
    committed = Checkpointer(root).committed()
    assert [c.manifest.step for c in committed] == [2, 4, 6] and _leftovers(root) == []
    for c in committed:
        verify(Checkpointer(root).storage, c.path)
