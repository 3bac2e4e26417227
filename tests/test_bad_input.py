"""Bad input fails before any process group starts, naming the option and the fix."""

from __future__ import annotations

import pytest
import torch

import unison
from unison.config.load import load_config
from unison.contract.ownership import PrecisionSupport
from unison.plugin.registry import StrategySpec
from unison.strategies.single import SingleStrategy

from helpers import mlp, regression_data


@pytest.fixture(autouse=True)
def no_process_group():
    yield
    assert not torch.distributed.is_initialized(), "a process group was started"


def test_unknown_strategy_lists_available_names():
    with pytest.raises(unison.UnknownStrategyError) as info:
        unison.Trainer(max_steps=1, strategy="dpp")
    msg = str(info.value)
    assert "'dpp'" in msg and "ddp" in msg and "single" in msg and msg.startswith("strategy")


def test_unknown_strategy_option_names_it_and_valid_ones():
    with pytest.raises(unison.ConfigurationError, match=r"bucket_cap_mbb.*bucket_cap_mb"):
        unison.Trainer(max_steps=1, strategy="ddp", strategy_options={"bucket_cap_mbb": 10})


def test_unknown_trainer_setting_names_it():
    with pytest.raises(unison.ConfigurationError, match="max_stepz"):
        unison.Trainer(max_steps=1, strategy="single", max_stepz=3)


class NoBf16True(SingleStrategy):
    @property
    def ownership(self):
        base = super().ownership
        precision = dict(base.precision)
        precision["bf16-true"] = PrecisionSupport.unsupported("this backend keeps fp32 master weights")
        return unison.Ownership(base.grad_accumulation, precision, base.state_dict)


class NoBf16TruePlugin:
    @unison.hookimpl
    def unison_strategies(self):
        return [StrategySpec(name="fp32_master", factory=NoBf16True, description="test strategy")]


def test_precision_the_strategy_declares_unsupported():
    pm = unison.PluginManager(plugins=[NoBf16TruePlugin()])
    with pytest.raises(unison.ConfigurationError) as info:
        unison.Trainer(max_steps=1, strategy="fp32_master", precision="bf16-true", plugin_manager=pm)
    msg = str(info.value)
    assert msg.startswith("precision") and "fp32 master weights" in msg and "describe fp32_master" in msg


def test_unknown_precision_name():
    with pytest.raises(unison.ConfigurationError, match=r"precision.*'fp8'"):
        unison.Trainer(max_steps=1, strategy="single", precision="fp8")


@pytest.mark.parametrize(
    "settings,match",
    [
        ({"global_batch_size": 30, "accumulate_grad_batches": 4}, "multiple of accumulate_grad_batches"),
        ({"global_batch_size": 12, "accumulate_grad_batches": 4}, "does not split over 2"),
    ],
)
def test_batch_sizes_that_do_not_divide(monkeypatch, settings, match):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(unison.ConfigurationError, match=match) as info:
        unison.Trainer(strategy="ddp", max_steps=1, **settings)
    assert str(info.value).startswith("global_batch_size")


def test_dataset_smaller_than_one_global_batch():
    trainer = unison.Trainer(max_steps=1, strategy="single", global_batch_size=64, accumulate_grad_batches=1)
    with pytest.raises(unison.ConfigurationError, match="fewer than one global batch"):
        trainer.fit(
            mlp(),
            regression_data(n=32),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        )


def test_single_refuses_a_multi_process_launch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(unison.ConfigurationError, match="use strategy='ddp'"):
        unison.Trainer(max_steps=1, strategy="single")


def test_resume_last_without_checkpoint_dir():
    trainer = unison.Trainer(max_steps=1, strategy="single", global_batch_size=8, accumulate_grad_batches=1)
    with pytest.raises(unison.ConfigurationError, match="ckpt_path"):
        trainer.fit(
            mlp(),
            regression_data(),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            ckpt_path="last",
        )


def test_unknown_config_key_is_rejected_with_its_path(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        '[trainer]\nmax_stepz = 3\n[model]\nfactory = "m.py:f"\n'
        '[data]\nfactory = "m.py:d"\n[loss]\nfactory = "m.py:l"\n'
    )
    with pytest.raises(unison.ConfigurationError, match=r"config key trainer\.max_stepz.*remove or rename"):
        load_config(cfg)


def test_yaml_config_nested_unknown_key(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "trainer: {max_steps: 1}\nmodel: {factory: 'm.py:f', kwarg: {}}\ndata: {factory: 'm.py:d'}\n"
        "loss: {factory: 'm.py:l'}\n"
    )
    with pytest.raises(unison.ConfigurationError, match=r"model\.kwarg"):
        load_config(cfg)


@pytest.mark.parametrize("strategy", ["single", "pipeline"])
def test_loss_that_needs_more_than_outputs_and_targets(monkeypatch, strategy):
    if strategy == "pipeline":
        monkeypatch.setenv("WORLD_SIZE", "2")
    trainer = unison.Trainer(max_steps=1, strategy=strategy, global_batch_size=8, accumulate_grad_batches=2)

    def loss_with_inputs(outputs, targets, inputs):
        return ((outputs - targets) ** 2).mean() + inputs.mean()

    with pytest.raises(unison.ConfigurationError, match=r"loss_fn.*outputs, targets.*last stage") as info:
        trainer.fit(mlp(), regression_data(), loss_fn=loss_with_inputs, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert str(info.value).startswith("loss_fn")
