"""``unison checkpoint export --format hf``: a save_pretrained directory that from_pretrained loads.

The Hugging Face example's tiny Llama (local config, nothing downloaded)
trains a few steps under ``unison train``; the export, built from the same
config's model factory, must load with ``AutoModelForCausalLM.from_pretrained``
to exactly the trained weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from unison.checkpointing.export import canonical_state

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "hf_causal_lm.py"


def _unison(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "unison.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=240
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(config, checkpoint_dir) of a 4-step single-process run of the example."""
    tmp = tmp_path_factory.mktemp("hf")
    config = tmp / "run.toml"
    config.write_text(
        f"""
[imports]
paths = ["{EXAMPLE.parent}"]  # the example's factories, outside this config's directory

[trainer]
strategy = "single"
global_batch_size = 8
max_steps = 4
seed = 0
progress = "off"
checkpoint_dir = "{tmp / "checkpoints"}"

[model]
factory = "{EXAMPLE}:build_model"
kwargs = {{ hidden_size = 32, layers = 2, heads = 4, seq_len = 16 }}

[data]
factory = "{EXAMPLE}:build_datasets"
kwargs = {{ seq_len = 16, max_bytes = 4096, val_bytes = 512 }}

[training_step]
factory = "{EXAMPLE}:training_step"

[optimizer]
name = "AdamW"
kwargs = {{ lr = 1e-2 }}
"""
    )
    out = _unison("train", str(config), cwd=tmp)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return config, tmp / "checkpoints"


def test_hf_export_loads_with_from_pretrained_to_the_trained_weights(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    config, checkpoints = trained
    out = tmp_path / "hf"
    done = _unison(
        "checkpoint", "export", "--format", "hf", "--config", str(config), "--max-shard-size", "40KB",
        str(checkpoints), str(out), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    # save_pretrained's layout: config, several safetensors shards and the index naming each tensor's shard
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    model = AutoModelForCausalLM.from_pretrained(out)
    trained_state = canonical_state(sorted(checkpoints.glob("step-*"))[-1])
    loaded = model.state_dict()
    assert set(loaded) == set(trained_state)
    for name, tensor in trained_state.items():
        assert torch.equal(loaded[name], tensor), name


def test_hf_export_needs_the_config_and_refuses_a_model_that_is_not_a_transformers_model(trained, tmp_path):
    config, checkpoints = trained
    missing = _unison("checkpoint", "export", "--format", "hf", str(checkpoints), str(tmp_path / "a"), cwd=tmp_path)
    assert missing.returncode == 2 and "--config" in missing.stderr
    plain = tmp_path / "plain.toml"
    plain.write_text(
        config.read_text().replace(f'factory = "{EXAMPLE}:build_model"', 'factory = "plain.py:build_model"')
    )
    (tmp_path / "plain.py").write_text("import torch\n\ndef build_model(**kwargs):\n    return torch.nn.Linear(2, 2)\n")
    refused = _unison(
        "checkpoint", "export", "--format", "hf", "--config", str(plain), str(checkpoints), str(tmp_path / "b"),
        cwd=tmp_path,
    )  # fmt: skip
    assert refused.returncode == 2 and "not a transformers PreTrainedModel" in refused.stderr
    assert not (tmp_path / "b").exists()
