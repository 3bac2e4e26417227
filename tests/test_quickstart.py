"""The README's first command: reproducible, and the same under single and ddp --nproc 2."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
STEPS = 12


def _config(tmp: Path, name: str) -> Path:
    """The quickstart config with per-step metrics to a file of this run and fewer steps."""
    run_dir = tmp / name
    run_dir.mkdir()
    shutil.copy(ROOT / "examples" / "tinylm.py", run_dir / "tinylm.py")
    text = (ROOT / "examples" / "tinylm.toml").read_text()
    text = re.sub(r"(?m)^log_every_n_steps = .*$", "log_every_n_steps = 1", text)
    text = re.sub(r"(?m)^checkpoint_dir = .*$", f'checkpoint_dir = "{run_dir / "ckpt"}"', text)
    cfg = run_dir / "tinylm.toml"
    cfg.write_text(text)
    return cfg


def _losses(tmp: Path, name: str, *extra: str) -> dict[int, float]:
    cfg = _config(tmp, name)
    metrics = tmp / name / "metrics.jsonl"
    # A logging plugin module of the test's own, given by UNISON_PLUGINS (as a user would).
    plugin = tmp / name / "record_losses.py"
    plugin.write_text(
        "import json, unison\n"
        "class Record:\n"
        "    @unison.hookimpl\n"
        "    def unison_on_train_step_end(self, trainer, step, output):\n"
        "        if trainer.is_global_zero:\n"
        f"            open({str(metrics)!r}, 'a').write(json.dumps({{'step': step, 'loss': output.loss}}) + '\\n')\n"
        "@unison.hookimpl\n"
        "def unison_plugins_from_config(config):\n"
        "    return [Record()]\n"
    )
    env = {**ENV, "UNISON_PLUGINS": "record_losses", "PYTHONPATH": str(tmp / name)}
    out = subprocess.run(
        [sys.executable, "-m", "unison.cli", "train", str(cfg), "--max-steps", str(STEPS), *extra],
        cwd=tmp / name,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_same_seed_same_losses_and_ddp_equals_single(tmp_path):
    first = _losses(tmp_path, "first")
    second = _losses(tmp_path, "second")
    assert sorted(first) == list(range(STEPS))
    assert first == second  # bitwise: the model factory is seeded, the data order is the seed's
    ddp = _losses(tmp_path, "ddp", "--strategy", "ddp", "--nproc", "2")
    assert sorted(ddp) == list(range(STEPS))
    for step in range(STEPS):
        assert ddp[step] == pytest.approx(first[step], rel=1e-5), step
