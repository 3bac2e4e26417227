"""The README's Quickstart, run as written, in order, in a temporary copy of the example.

The commands are read from README.md's "## Quickstart" block, so this test
breaks when the docs change: every ``unison train`` command there must exit
0, each fresh run must get its own run directory, and no run may lose a
checkpoint an earlier run committed. The install command is the one this
environment was made with (the copy links to its ``.venv``); the test-suite
command is this suite itself, so neither is run here.
"""

from __future__ import annotations

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


def quickstart_commands() -> list[str]:
    """The lines of the bash block under README.md's "## Quickstart" heading."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README.md's Quickstart has no bash block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def committed(root: Path) -> set[str]:
    """Every committed checkpoint under the runs (``version_N/checkpoints/step-...`` with a manifest)."""
    return {str(p.parent.relative_to(root)) for p in root.glob("version_*/checkpoints/step-*/manifest.json")}


def test_quickstart_parses_into_install_train_and_test_commands():
    commands = quickstart_commands()
    assert commands[0] == "bash scripts/install.sh"
    assert commands[-1].endswith('-m pytest tests -p no:cacheprovider -m "not full"')
    train = commands[1:-1]
    assert train and all(c.startswith(".venv/bin/unison train examples/tinylm.toml") for c in train), train
    # The sequence this test exists for: a run, the same again, another backend, a resume.
    assert train[0] == train[1] and any("--nproc 2" in c for c in train) and "--resume auto" in train[-1]


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_quickstart_runs_as_written_and_keeps_every_run(tmp_path):
    commands = quickstart_commands()
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")  # the environment `bash scripts/install.sh` made
    runs = tmp_path / "runs" / "tinylm"
    seen: set[str] = set()
    outputs = []
    for command in commands[1:-1]:
        out = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600
        )
        outputs.append(out)
        assert out.returncode == 0, f"{command}: exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        now = committed(runs)
        assert seen <= now, f"{command} lost checkpoints: {sorted(seen - now)}"
        seen = now
    fresh = [c for c in commands[1:-1] if "--resume" not in c]
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
