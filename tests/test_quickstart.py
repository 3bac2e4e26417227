"""The README's Quickstart, run as written, in order, in a fresh copy of the repository.

The commands are read from README.md's "## Quickstart" section, so this test breaks when the docs
change. Its first block is exactly two commands, ``scripts/train`` and ``scripts/test``; the walkthrough
block after it goes on with ``scripts/train ARGS``. Every train command must exit 0, each fresh run
must get its own run directory, and no run may lose a checkpoint an earlier run committed.

The copy holds every file of the checkout that git tracks or would track, and links to this checkout's
``.venv``: ``scripts/install.sh`` finds it made from the same ``pyproject.toml`` and installs nothing
(on a clean clone it installs everything, as ``.ci/run`` shows; the test refuses to run when the
environment is stale rather than reinstall it from the copy). ``scripts/test`` runs as written, its
selection narrowed with ``PYTEST_ADDOPTS`` to one test (it is this suite itself).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from unison.plugins.loggers import read_csv, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def quickstart_blocks() -> list[list[str]]:
    """The bash blocks under README.md's "## Quickstart" heading, each as its lines."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert blocks, "README.md's Quickstart has no bash block"
    return [[line.strip() for line in block.splitlines() if line.strip()] for block in blocks]


def install_stamp(root: Path) -> str:
    """What ``scripts/install.sh`` writes into ``.venv/.unison-install`` (so it knows nothing is missing)."""
    return hashlib.sha256(
        (root / "pyproject.toml").read_bytes() + (root / "scripts/install.sh").read_bytes()
    ).hexdigest()


def fresh_copy(target: Path) -> None:
    """The checkout's files as a clone would have them (tracked, or untracked and not ignored)."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def committed(root: Path) -> set[str]:
    """Every committed checkpoint under the runs (``version_N/checkpoints/step-...`` with a manifest)."""
    return {str(p.parent.relative_to(root)) for p in root.glob("version_*/checkpoints/step-*/manifest.json")}


def test_quickstart_starts_with_two_commands_then_the_walkthrough_trains_with_the_same_one():
    first, *walkthrough = quickstart_blocks()
    assert first == ["scripts/train", "scripts/test"]
    train = [first[0], *(line for block in walkthrough for line in block)]
    assert all(c == "scripts/train" or c.startswith("scripts/train ") for c in train), train
    # The sequence this test exists for: a run, the same again, another backend, a resume.
    assert train[0] == train[1] and any("--nproc 2" in c for c in train) and "--resume auto" in train[-1]
    # scripts/test is the README's test command that .ci/run runs: the quick tier.
    assert '-m pytest tests -p no:cacheprovider -m "not full"' in (ROOT / "scripts" / "test").read_text()


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_quickstart_runs_as_written_in_a_fresh_copy_and_keeps_every_run(tmp_path):
    stamp = ROOT / ".venv" / ".unison-install"
    assert stamp.is_file() and stamp.read_text().strip() == install_stamp(ROOT), (
        "the checkout's .venv was not made from the current pyproject.toml and scripts/install.sh: run "
        "`bash scripts/install.sh` first (the copy would otherwise reinstall into this checkout's .venv)"
    )
    blocks = quickstart_blocks()
    (first, test_command), walkthrough = blocks[0], blocks[1:]
    fresh_copy(tmp_path)
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")  # the environment scripts/install.sh made
    commands = [first, *(line for block in walkthrough for line in block)]
    runs = tmp_path / "runs" / "tinylm"
    seen: set[str] = set()
    outputs = []
    for command in commands:
        out = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600
        )
        outputs.append(out)
        assert out.returncode == 0, f"{command}: exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        now = committed(runs)
        assert seen <= now, f"{command} lost checkpoints: {sorted(seen - now)}"
        seen = now
    fresh = [c for c in commands if "--resume" not in c]
    versions = sorted(p.name for p in runs.glob("version_*"))
    assert versions == [f"version_{n}" for n in range(len(fresh))]  # one per fresh run, none for the resume
    for version in versions:
        run = runs / version
        meta = json.loads((run / "run.json").read_text())
        steps = [row["step"] for row in read_csv(run / "metrics.csv")]
        assert steps == sorted(set(steps)) and steps[-1] == meta["config"]["trainer"]["max_steps"], (version, steps)
        assert (run / "checkpoints" / "latest").exists()
    # The fresh runs trained alike: single twice (bitwise), ddp on two processes within float tolerance.
    losses = [
        {r["step"]: r["train/loss"] for r in read_jsonl(runs / v / "metrics.jsonl") if "train/loss" in r}
        for v in versions
    ]
    assert losses[0] == losses[1]
    assert losses[2].keys() == losses[0].keys()
    for step, loss in losses[0].items():
        assert losses[2][step] == pytest.approx(loss, rel=1e-5), step
    # The resume continued the newest run in its own directory, and said so once.
    resumed = json.loads((runs / versions[-1] / "run.json").read_text())
    assert resumed["resumed_from"] is not None and len(resumed["resumes"]) == 1
    said = outputs[-1].stdout + outputs[-1].stderr
    assert said.count("resuming from step") == 1, said[-2000:]
    assert f"resuming from step {resumed['resumed_from']['step']}: {runs / versions[-1]}" in said
    # The second command, as written: it installs nothing and runs the quick tier (narrowed to one test).
    selected = {**ENV, "PYTEST_ADDOPTS": "-q -k test_quickstart_starts_with_two_commands"}
    out = subprocess.run(
        ["bash", "-c", test_command], cwd=tmp_path, env=selected, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, f"{test_command}: exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    # (the test processes deselect, so pytest-xdist's summary has no "deselected")
    assert re.search(r"^1 passed(, \d+ deselected)? in ", out.stdout, re.M), out.stdout[-2000:]
