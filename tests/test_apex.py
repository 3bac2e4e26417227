"""apex precisions: registered everywhere, usable only with NVIDIA apex, never replaced by torch.amp."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import unison
from unison.errors import ConfigurationError
from unison.plugins.apex import NOT_INSTALLED, apex_unavailable

APEX_MISSING = apex_unavailable() is not None


def test_apex_precisions_are_registered_with_the_reason_they_are_unavailable():
    registry = unison.PluginManager().precisions
    assert {"apex-O1", "apex-O2"} <= set(registry.names())
    for name in ("apex-O1", "apex-O2"):
        assert registry.get(name).unavailable == apex_unavailable()


@pytest.mark.skipif(not APEX_MISSING, reason="NVIDIA apex is importable here")
def test_apex_o1_is_unavailable_here_with_the_precise_reason():
    spec = unison.PluginManager().precisions.get("apex-O1")
    try:
        import apex  # noqa: F401
    except ImportError:
        assert spec.unavailable == NOT_INSTALLED
    assert "NVIDIA apex" in spec.unavailable and "PyPI package named apex is unrelated" in spec.unavailable


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_trainer_asking_for_apex_fails_before_any_process_group(strategy):
    with pytest.raises(ConfigurationError) as info:
        unison.Trainer(max_steps=1, strategy=strategy, precision="apex-O1")
    assert info.value.option == "precision"
    assert "apex-O1" in str(info.value)
    assert not torch.distributed.is_initialized()


def test_an_apex_name_is_never_served_by_torch_autocast():
    # With the apex plugin blocked, no other plugin answers for the name: it
    # is unknown, not quietly mapped onto torch.autocast.
    blocked = subprocess.run(
        [sys.executable, "-c", "import unison; print('apex-O1' in unison.PluginManager().precisions.names())"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "UNISON_BLOCK_PLUGINS": "apex"},
    )
    assert blocked.returncode == 0, blocked.stderr
    assert blocked.stdout.strip() == "False"


def test_registering_apex_imports_nothing_when_it_is_missing():
    code = "import sys, unison; unison.PluginManager().precisions.names(); assert 'apex' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
