"""Plugins written against each released plugin API (tests/compat_plugins/) register as their version promises.

1.x is refused at registration with the migration it needs; 2.0 to 2.3 register unchanged, without a
warning. The 2.0 one overrides ``setup`` (the 2.0 migration's "add env=None"): its declaration refuses the
module features that came in 2.1, with the reason, and a run asking for one is refused before any process
group; a run without them trains (the trainer binds ``env`` before calling the override). Their
certification by the conformance suite is tests/test_compat_plugins_certified.py (long tier).
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from compat_plugins import PLUGINS

import unison
from unison.contract import MIGRATIONS
from unison.contract.compat import SETUP_OVERRIDE_REASON

SUPPORTED = [module for module, (version, _) in PLUGINS.items() if version != "1.x"]
FEATURES = {"compile": True, "activation_checkpointing": "full"}


def _manager(module: str) -> unison.PluginManager:
    return unison.PluginManager(plugins=[importlib.import_module(module)])


def test_a_1x_plugin_is_refused_at_registration_with_its_migration():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # it imports from the 0.1 path unison.strategy
        pm = _manager("compat_plugins.api_1x")
    with pytest.raises(unison.PluginError) as refused:
        pm.strategies.names()
    message = str(refused.value)
    assert "compat_plugins.api_1x.MyStrategy" in message and "targets plugin API 1.0" in message
    assert MIGRATIONS[0].change in message and MIGRATIONS[0].how in message


@pytest.mark.parametrize("module", SUPPORTED)
def test_a_2x_plugin_registers_unchanged_without_a_warning(module):
    _, name = PLUGINS[module]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pm = _manager(module)
        strategy = pm.strategies.create(name)
    assert name in pm.strategies.names()
    refuses = {f.value: why for f, why in strategy.ownership.refuses.items()}
    reason = SETUP_OVERRIDE_REASON.format(version="2.0")
    if module.endswith("api_2_0"):
        # Its own setup predates the features: declared refused, with the reason, next to its own refusal.
        assert refuses == {
            "training_step": "why, and what to use instead",
            "compile": reason,
            "activation_checkpointing": reason,
        }
        assert reason.startswith("the strategy overrides setup and does not apply features")
    else:
        assert not {"compile", "activation_checkpointing"} & set(refuses)


@pytest.mark.parametrize("option", sorted(FEATURES))
def test_a_2_0_setup_override_is_refused_a_feature_before_any_process_group(option):
    trainer = unison.Trainer(
        strategy="compat_2_0", plugin_manager=_manager("compat_plugins.api_2_0"), max_steps=1, progress="off"
    )
    with pytest.raises(unison.DeclaredRefusal) as refused:
        unison.Trainer(
            strategy="compat_2_0",
            plugin_manager=_manager("compat_plugins.api_2_0"),
            max_steps=1,
            progress="off",
            **{option: FEATURES[option]},
        )
    assert refused.value.feature == option and "overrides setup and does not apply features" in str(refused.value)
    assert not torch.distributed.is_initialized() and trainer.settings.compile is False


def test_a_2_0_setup_override_trains_in_one_process():
    """The override uses the env= it is given and never binds self.env; the trainer bound it before the call."""
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    trainer = unison.Trainer(
        strategy="compat_2_0",
        plugin_manager=_manager("compat_plugins.api_2_0"),
        max_steps=2,
        global_batch_size=8,
        progress="off",
        throughput=False,
        loggers=[],
    )
    progress = trainer.fit(
        torch.nn.Linear(4, 1),
        data,
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
    )
    assert progress.optimizer_steps == 2
