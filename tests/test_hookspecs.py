"""Every hookspec is documented and fired by a test; a new hookspec that lacks either fails here."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

import unison
from unison.cli import main
from unison.plugin import hookspecs

import hookspec_worlds

ROOT = Path(__file__).resolve().parents[1]
#: Parameters the module docstring documents once for every hook.
CONVENTIONS = {"trainer"}


@pytest.mark.parametrize("name", sorted(hookspec_worlds.specs()))
def test_hookspec_is_documented(name):
    spec = getattr(hookspecs, name)
    doc = inspect.getdoc(spec) or ""
    signature = inspect.signature(spec)
    assert re.search(r"\bCalled\b", doc), f'{name}: say who calls it ("Called by ...") and when'
    assert re.search(r"\branks?\b", doc), f"{name}: say on which ranks it runs"
    for param in signature.parameters:
        if param not in CONVENTIONS:
            assert re.search(rf"\b{param}\b", doc), f"{name}: document the parameter {param!r}"
    if signature.return_annotation not in (None, "None"):
        assert "Returns" in doc, f"{name}: say what its return value means"
    if name.startswith("unison_on_") or name == "unison_log_metrics":
        assert name in hookspecs.__doc__, f"{name}: place it in the documented hook order"


@pytest.mark.parametrize("name", sorted(hookspec_worlds.specs()))
def test_hookspec_is_in_the_hooks_page(name):
    assert f"`{name}`" in (ROOT / "docs" / "hooks.md").read_text(), f"{name}: add it to docs/hooks.md's table"


def _fire_every_hook(tmp_path: Path) -> None:
    """Runs that between them reach every hook, through public entry points only."""
    config = tmp_path / "tiny.toml"
    text = (ROOT / "examples" / "tinylm.toml").read_text()
    text = text.replace('factory = "tinylm.py', f'factory = "{ROOT}/examples/tinylm.py')
    text = f'[imports]\npaths = ["{ROOT}/examples"]\n' + text  # a trust root beyond the config's directory
    text = text.replace('root_dir = "runs/tinylm"', f'root_dir = "{tmp_path}/runs"')
    text = text.replace("max_bytes = 400000", "max_bytes = 40000")
    config.write_text(text.replace('dir = "runs/tinylm"', f'dir = "{tmp_path}/runs"'))
    # the CLI: command registration, config plugins, registries, a whole fit with validation and checkpoints
    main(["train", str(config), "--max-steps", "4"])
    # resume (load_checkpoint) and a crash (exception)
    from helpers import mlp, regression_data

    def fit(**kwargs):
        trainer = unison.Trainer(
            strategy="single", global_batch_size=16, max_steps=6, progress="off", checkpoint_dir=str(tmp_path / "py")
        )
        # 48 samples: an epoch is 3 steps, so epochs end too
        return trainer.fit(
            mlp(),
            regression_data(n=48),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
            **kwargs,
        )

    fit()
    fit(ckpt_path="last")

    def broken_loss(outputs, targets):
        raise RuntimeError("boom")

    # a tensor-parallel strategy asks the plugins for the plan of a model without one (nobody knows the MLP)
    with pytest.raises(unison.DeclaredRefusal, match="unison_tensor_parallel_plan"):
        unison.Trainer(
            strategy="fsdp_tp", strategy_options={"tp_size": 1}, global_batch_size=16, max_steps=1, progress="off"
        ).fit(mlp(), regression_data(), loss_fn=torch.nn.functional.mse_loss, optimizer=torch.optim.SGD)

    # a URL location: the storage backends are asked for its scheme (one nobody registered)
    with pytest.raises(unison.ConfigurationError, match="'gs'"):
        unison.Trainer(strategy="single", max_steps=2, progress="off", checkpoint_dir="gs://bucket/run")

    with pytest.raises(RuntimeError, match="boom"):
        unison.Trainer(strategy="single", global_batch_size=16, max_steps=2, progress="off").fit(
            mlp(), regression_data(), loss_fn=broken_loss, optimizer=lambda params: torch.optim.SGD(params, lr=0.01)
        )


def test_every_hookspec_is_fired(tmp_path, monkeypatch):
    monkeypatch.setenv("UNISON_PLUGINS", "hookspec_worlds")
    monkeypatch.chdir(tmp_path)
    hookspec_worlds.CALLS.clear()
    _fire_every_hook(tmp_path)
    never = sorted(set(hookspec_worlds.specs()) - set(hookspec_worlds.CALLS))
    assert not never, f"hookspecs no test fires (add them to a run here and to a behaviour test): {never}"
