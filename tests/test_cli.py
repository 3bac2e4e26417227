"""The unison command line, run as a user runs it (real subprocesses, real torchrun)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNISON = [sys.executable, "-m", "unison.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run(*args: str, cwd: Path = ROOT, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*UNISON, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def test_strategies_table_lists_builtins_with_availability():
    out = run("strategies")
    assert out.returncode == 0, out.stderr
    assert "single" in out.stdout and "ddp" in out.stdout and "yes" in out.stdout


def test_describe_prints_the_declaration():
    out = run("describe", "ddp")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "owned by trainer" in text and "no_sync" in text and "16-mixed" in text and "reshardable: True" in text


def test_describe_unknown_strategy_lists_names():
    out = run("describe", "zero9")
    assert out.returncode == 2
    assert "unknown strategy 'zero9'" in out.stdout and "ddp" in out.stdout


def test_train_rejects_unknown_config_key_before_starting(tmp_path):
    # A path longer than a line: the message keeps it whole on its line (a terminal wraps it, not unison).
    deep = tmp_path / ("a-directory-with-a-long-name-" * 4) / "and-deeper"
    deep.mkdir(parents=True)
    cfg = deep / "bad.toml"
    cfg.write_text((ROOT / "examples" / "tinylm.toml").read_text().replace("max_steps", "max_stepz"))
    out = run("train", str(cfg), "--nproc", "2", timeout=60)
    assert out.returncode == 2
    errors = _error_lines(out)
    assert len(errors) == 1 and str(cfg) in errors[0], out.stdout + out.stderr
    assert "trainer.max_stepz" in out.stdout
    assert "torch.distributed" not in out.stderr  # no worker was started


def _error_lines(out: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("error:")]


def test_a_configuration_error_in_the_launcher_exits_2_with_its_message_once(tmp_path):
    # --nproc 2: the launcher checks the config before it starts any worker, and refuses here.
    out = run("train", str(ROOT / "examples" / "tinylm.toml"), "--nproc", "2", "--strategy", "zero9", cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr[-3000:]
    errors = _error_lines(out)
    assert len(errors) == 1 and "unknown strategy 'zero9'" in errors[0], out.stdout + out.stderr
    assert "torch.distributed" not in out.stderr  # no worker was started
    out = run("run", "--cluster", "nosuch", str(tmp_path / "script.py"), cwd=tmp_path)
    assert out.returncode == 2 and len(_error_lines(out)) == 1, out.stdout + out.stderr
    assert "--cluster: no cluster environment named 'nosuch'" in " ".join(out.stdout.split())


def test_any_other_unison_error_in_the_launcher_process_exits_1(tmp_path):
    # One process: the run trains in the launcher itself, and its loss is not finite at the first step.
    (tmp_path / "nan.py").write_text(
        textwrap.dedent("""
        import torch

        def build_model():
            return torch.nn.Linear(4, 1)

        def build_datasets():
            data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
            return data, None

        def loss_fn(out, target):
            return torch.nn.functional.mse_loss(out, target) * float("nan")
    """)
    )
    (tmp_path / "nan.toml").write_text(
        textwrap.dedent("""
        [trainer]
        global_batch_size = 8
        max_steps = 2
        progress = "off"
        [model]
        factory = "nan.py:build_model"
        [data]
        factory = "nan.py:build_datasets"
        [loss]
        factory = "nan.py:loss_fn"
        [optimizer]
        name = "SGD"
        kwargs = { lr = 0.1 }
    """)
    )
    out = run("train", str(tmp_path / "nan.toml"), cwd=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    errors = _error_lines(out)
    text = " ".join(out.stdout.split())
    assert len(errors) == 1 and "step 0: the loss was non-finite first at micro-batch 0 on rank 0" in text, out.stdout
    assert "no checkpoint holds weights from it" in text and "Traceback" not in out.stderr


@pytest.mark.distributed
def test_run_starts_a_torchrun_world_for_a_plain_script(tmp_path):
    script = tmp_path / "train_ddp.py"
    script.write_text(
        textwrap.dedent(f"""
        import json, sys, torch
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import unison
        from helpers import mlp, regression_data
        t = unison.Trainer(strategy="ddp", global_batch_size=16, accumulate_grad_batches=2, max_steps=3)
        p = t.fit(mlp(), regression_data(), loss_fn=torch.nn.functional.mse_loss,
                  optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        with open(sys.argv[1] + f"/rank{{t.env.rank}}.json", "w") as f:
            json.dump({{"world": t.env.world_size, "steps": p.optimizer_steps}}, f)
    """)
    )
    out = run("run", "--nproc", "2", str(script), str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"world": 2, "steps": 3}


def test_example_trains_end_to_end(tmp_path):
    out = run("train", str(ROOT / "examples" / "tinylm.toml"), "--max-steps", "30", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "final train loss" in out.stdout and "final validation loss" in out.stdout
    lines = [json.loads(line) for line in (tmp_path / "runs/tinylm/version_0/metrics.jsonl").read_text().splitlines()]
    losses = [line["train/loss"] for line in lines if "train/loss" in line]
    assert losses[-1] < losses[0] < 6.0  # it learns from ln(256)=5.5
    assert (tmp_path / "runs/tinylm/version_0/checkpoints/latest").read_text().strip() == "step-00000030"


def test_describe_prints_the_mesh_of_a_composed_strategy():
    out = run("describe", "hsdp")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "device mesh: replicate=world/2 x shard=2" in text
    # Table cells wrap at the terminal's width: look for single words of each row.
    rows = [line for line in out.stdout.splitlines() if line.startswith("│ replicate") or line.startswith("│ shard")]
    assert len(rows) == 2 and "all-reduce" in rows[0] and "2" in rows[1].split("│")[2], rows
    assert "device mesh" not in " ".join(run("describe", "ddp").stdout.split())
