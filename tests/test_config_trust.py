"""The config trust model: factories load only from the config's trust roots, and nothing refused ever runs.

Each refusal is checked through ``unison train`` (exit 2, the key named) with a
marker file the refused code would have written, and a model factory that
writes its own marker, so "before anything runs" is observed, not assumed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import unison
from unison.cli import main
from unison.config.load import build_callbacks, load_config, resolve_run

pytestmark = pytest.mark.timeout(120)

FACTORIES = """
import pathlib
import torch

def model(width=4):
    pathlib.Path("MODEL_BUILT").write_text("")  # proves a run started building
    return torch.nn.Linear(width, 1)

def datasets():
    x = torch.randn(8, 4)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), None

def loss(out, y):
    return torch.nn.functional.mse_loss(out, y)

def not_a_plugin():
    return 42
"""

BASE = """\
[trainer]
max_steps = 2
global_batch_size = 4
progress = "off"
[model]
factory = "factories.py:model"
[data]
factory = "factories.py:datasets"
[loss]
factory = "factories.py:loss"
[optimizer]
name = "SGD"
kwargs = { lr = 0.1 }
"""

SYSTEM = '{{ command = "touch {marker}" }}'


def setup(tmp_path: Path, text: str) -> Path:
    (tmp_path / "factories.py").write_text(FACTORIES)
    config = tmp_path / "run.toml"
    config.write_text(text)
    return config


def train_in_process(config: Path, capsys, monkeypatch) -> tuple[int, str]:
    monkeypatch.chdir(config.parent)
    with pytest.raises(SystemExit) as exited:
        main(["train", str(config)])
    out = capsys.readouterr()
    assert not torch.distributed.is_initialized()
    return exited.value.code, " ".join((out.out + out.err).split())


def test_an_os_system_callback_is_refused_before_anything_runs_through_the_real_cli(tmp_path):
    marker = tmp_path / "PWNED"
    config = setup(tmp_path, BASE + f'[[callbacks]]\nfactory = "os:system"\nkwargs = {SYSTEM.format(marker=marker)}\n')
    out = subprocess.run(
        [sys.executable, "-m", "unison.cli", "train", str(config)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    text = " ".join(out.stdout.split())
    assert out.returncode == 2, out.stdout + out.stderr
    assert "config key callbacks.0.factory: module 'os' is not allowed" in text and "[imports] allow" in text
    assert not marker.exists() and not (tmp_path / "MODEL_BUILT").exists()


@pytest.mark.parametrize(
    "edit,key,says",
    [
        pytest.param(
            lambda t, m: t.replace('"factories.py:model"', f'"os:system"\nkwargs = {SYSTEM.format(marker=m)}'),
            "model.factory",
            "module 'os' is not allowed",
            id="model os:system",
        ),
        pytest.param(
            lambda t, m: t.replace('"factories.py:loss"', '"../../etc/passwd:x"'),
            "loss.factory",
            "outside the config's trust roots",
            id="path outside the roots",
        ),
        pytest.param(
            lambda t, m: t.replace('"factories.py:datasets"', '"subprocess:run"'),
            "data.factory",
            "module 'subprocess' is not allowed",
            id="data subprocess",
        ),
        pytest.param(
            lambda t, m: t.replace('name = "SGD"', 'name = "os:system"'),
            "optimizer.name",
            "module 'os' is not allowed",
            id="optimizer from a module",
        ),
        pytest.param(lambda t, m: t.replace("lr = 0.1", "lr = -0.1"), "optimizer.kwargs.lr", "negative", id="lr<0"),
        pytest.param(lambda t, m: t.replace("lr = 0.1", "lr = nan"), "optimizer.kwargs.lr", "finite", id="lr nan"),
        pytest.param(
            lambda t, m: t + '[[callbacks]]\nfactory = "factories.py:not_a_plugin"\n',
            "callbacks[0] (factories.py:not_a_plugin)",
            "returned int 42, not a plugin object",
            id="non-plugin callback",
        ),
    ],
)
def test_refused_configs_exit_2_naming_the_key_with_nothing_run(tmp_path, capsys, monkeypatch, edit, key, says):
    marker = tmp_path / "PWNED"
    config = setup(tmp_path, edit(BASE, marker))
    code, text = train_in_process(config, capsys, monkeypatch)
    assert code == 2 and key in text and says in text, text
    assert not marker.exists()
    assert not (tmp_path / "MODEL_BUILT").exists()  # no model was built: training never started


def test_a_symlink_out_of_the_config_directory_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "evil.py").write_text("def loss(out, y):\n    return 0\n")
    inside = tmp_path / "cfg"
    inside.mkdir()
    (inside / "link.py").symlink_to(outside / "evil.py")
    config = setup(inside, BASE.replace('"factories.py:loss"', '"link.py:loss"'))
    with pytest.raises(unison.ConfigurationError, match=r"loss\.factory: 'link\.py:loss' is outside"):
        load_config(config)


def test_imports_paths_and_allow_extend_the_roots(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "losses.py").write_text(
        "import torch\n\ndef mse(out, y):\n    return torch.nn.functional.mse_loss(out, y)\n"
    )
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    text = BASE.replace('"factories.py:loss"', '"../shared/losses.py:mse"')
    text = text.replace('"factories.py:model"\n', '"torch.nn:Linear"\nkwargs = { in_features = 4, out_features = 1 }\n')
    config = setup(cfg_dir, text)
    with pytest.raises(unison.ConfigurationError) as refused:
        load_config(config)
    assert "loss.factory" in str(refused.value) and "model.factory" in str(refused.value)
    config.write_text('[imports]\nallow = ["torch.nn"]\npaths = ["../shared"]\n' + text)
    loaded, base = load_config(config)
    run = resolve_run(loaded, base)
    assert isinstance(run["model"](), torch.nn.Linear) and run["form"]["loss_fn"].__name__ == "mse"


def test_entry_point_modules_are_allowed_and_give_plugins(tmp_path):
    text = (
        BASE + '[[callbacks]]\nfactory = "unison.plugins.callbacks:EarlyStopping"\nkwargs = { monitor = "val/loss" }\n'
    )
    loaded, base = load_config(setup(tmp_path, text))
    (stopper,) = build_callbacks(loaded, base)
    assert type(stopper).__name__ == "EarlyStopping"
