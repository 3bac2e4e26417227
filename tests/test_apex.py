"""NVIDIA apex in unison: the apex_distributed_fused_adam strategy's declaration and refusals, apex's
fused optimizers under any strategy and in config files.

apex's optimizers are CUDA-only and apex is not installed here: the strategy is
listed unavailable with the reason. Where a test needs apex's modules it
installs the CPU stand-in (tests/apex_standin/, not apex) under apex's names in
``sys.modules`` and removes it afterwards. The runs through a real process group
are in tests/test_apex_distributed.py.
"""

from __future__ import annotations

import subprocess
import sys

import apex_standin.plugin as standin_plugin
import pytest
import torch
from apex_standin import modules as standin_modules

import unison
from unison.config.load import ClassConfig, optimizer_factory
from unison.contract.ownership import AccumulationOwner, GradSync, PrecisionOwner, PrecisionSupport, ReplicaInit
from unison.contract.settings import TrainerSettings
from unison.errors import ConfigurationError, DeclaredRefusal, StrategyUnavailableError
from unison.plugin.registry import PrecisionSpec
from unison.strategies.apex import (
    CUDA_ONLY,
    NOT_INSTALLED,
    DistributedFusedAdamStrategy,
    adam_hyperparameters,
    distributed_fused_adam_unavailable,
)
from unison.training.preflight import build_strategy

from helpers import max_abs_diff, mlp, regression_data

NAME = "apex_distributed_fused_adam"
STANDIN = standin_plugin.STANDIN
APEX_INSTALLED = distributed_fused_adam_unavailable() != NOT_INSTALLED


@pytest.fixture
def standin(monkeypatch):
    """The CPU stand-in under apex's module names, for this test only."""
    for name, module in standin_modules().items():
        monkeypatch.setitem(sys.modules, name, module)


def _pm() -> unison.PluginManager:
    return unison.PluginManager(plugins=[standin_plugin])


# --------------------------------------------------------------------------- #
# Availability: listed everywhere, usable only with apex and CUDA
# --------------------------------------------------------------------------- #


@pytest.mark.skipif(APEX_INSTALLED, reason="NVIDIA apex is installed here")
def test_listed_unavailable_here_with_the_precise_reason():
    spec = next(s for s in unison.PluginManager().strategies.specs() if s.name == NAME)
    assert spec.unavailable == NOT_INSTALLED
    assert "PyPI package named apex is unrelated" in spec.unavailable


def test_with_apex_importable_but_no_cuda_the_reason_is_cuda(standin, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed_fused_adam_unavailable() == CUDA_ONLY
    spec = next(s for s in unison.PluginManager().strategies.specs() if s.name == NAME)
    assert spec.unavailable == CUDA_ONLY


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_refused_before_any_process_group_with_the_reason():
    with pytest.raises(StrategyUnavailableError) as info:
        unison.Trainer(strategy=NAME, max_steps=1)
    assert info.value.option == "strategy"
    assert distributed_fused_adam_unavailable() in str(info.value)
    assert not torch.distributed.is_initialized()


def test_listing_strategies_imports_nothing_of_apex():
    code = (
        "import sys, unison; names = unison.PluginManager().strategies.names(); "
        f"assert {NAME!r} in names, names; assert not any(m.split('.')[0] == 'apex' for m in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --------------------------------------------------------------------------- #
# The declaration
# --------------------------------------------------------------------------- #


def test_declaration():
    own = DistributedFusedAdamStrategy().ownership
    assert own.grad_accumulation.owner is AccumulationOwner.TRAINER
    assert own.grad_accumulation.sync is GradSync.BOUNDARY and "no_sync()" in own.grad_accumulation.mechanism
    assert own.replica_init is ReplicaInit.TRAINER
    assert own.state_dict.reshardable and "state_dict()" in own.state_dict.format
    for name in ("32-true", "bf16-mixed", "16-mixed"):
        assert own.precision[name].owner is PrecisionOwner.TRAINER
    assert not own.precision["bf16-true"].supported and "bf16-mixed" in own.precision["bf16-true"].detail
    assert "unscale_grads" in own.precision["16-mixed"].detail
    assert isinstance(DistributedFusedAdamStrategy(), unison.contract.strategy.DeferredGradSync)


def test_bf16_true_is_refused_before_any_process_group():
    with pytest.raises(DeclaredRefusal) as info:
        unison.Trainer(strategy=STANDIN, precision="bf16-true", max_steps=1, plugin_manager=_pm())
    assert info.value.option == "precision" and "master" in str(info.value)
    assert not torch.distributed.is_initialized()


def test_distributed_size_must_divide_the_world_size():
    settings = TrainerSettings(
        strategy=STANDIN, strategy_options={"distributed_size": 2}, max_steps=1, global_batch_size=24
    )
    build_strategy(settings, _pm(), world_size=4)
    with pytest.raises(DeclaredRefusal, match="world size 3 is not a multiple of 2: distributed_size=2"):
        build_strategy(settings, _pm(), world_size=3)


def test_unknown_option_is_refused():
    with pytest.raises(ConfigurationError, match="overlap_param_sync"):
        unison.Trainer(
            strategy=STANDIN, strategy_options={"overlap_param_sync": True}, max_steps=1, plugin_manager=_pm()
        )


# --------------------------------------------------------------------------- #
# The user's optimizer -> DistributedFusedAdam
# --------------------------------------------------------------------------- #


def _params():
    return list(mlp().parameters())


def test_adamw_adam_and_fused_adam_map_onto_its_arguments(standin):
    from apex.optimizers import FusedAdam

    params = _params()
    mode, defaults, groups = adam_hyperparameters(
        torch.optim.AdamW(
            [{"params": params[:2], "lr": 0.5}, {"params": params[2:], "weight_decay": 0.0}],
            lr=1e-2,
            betas=(0.8, 0.9),
            eps=1e-6,
        ),
        strategy=NAME,
    )
    assert mode is True
    assert defaults == {"lr": 1e-2, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.01, "bias_correction": True}
    assert groups == [
        {"lr": 0.5, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.01, "bias_correction": True},
        {"lr": 1e-2, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.0, "bias_correction": True},
    ]
    assert adam_hyperparameters(torch.optim.Adam(params, weight_decay=0.1), strategy=NAME)[0] is False
    assert adam_hyperparameters(torch.optim.Adam(params, decoupled_weight_decay=True), strategy=NAME)[0] is True
    mode, defaults, groups = adam_hyperparameters(
        FusedAdam(params, lr=3e-3, adam_w_mode=False, bias_correction=False), strategy=NAME
    )
    assert mode is False and defaults["bias_correction"] is False and groups[0]["bias_correction"] is False
    assert groups[0]["lr"] == defaults["lr"] == 3e-3


@pytest.mark.parametrize(
    "make, problem",
    [
        (lambda p: torch.optim.SGD(p, lr=0.1), "an Adam optimizer; the optimizer factory returned torch.optim.sgd.SGD"),
        (lambda p: torch.optim.AdamW(p, amsgrad=True), "amsgrad=True"),
        (lambda p: torch.optim.Adam(p, maximize=True), "maximize=True"),
    ],
)
def test_an_optimizer_it_cannot_take_is_refused_before_any_process_group(make, problem):
    trainer = unison.Trainer(strategy=STANDIN, max_steps=1, global_batch_size=8, plugin_manager=_pm())
    with pytest.raises(ConfigurationError) as info:
        trainer.fit(mlp(), regression_data(n=16), loss_fn=torch.nn.functional.mse_loss, optimizer=make)
    assert info.value.option == "optimizer" and problem in str(info.value)
    assert not trainer.setup_started and not torch.distributed.is_initialized()


def test_mixed_weight_decay_modes_are_refused():
    params = _params()
    optimizer = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:], "decoupled_weight_decay": True}])
    with pytest.raises(ConfigurationError, match="one adam_w_mode"):
        adam_hyperparameters(optimizer, strategy=NAME)


# --------------------------------------------------------------------------- #
# apex's fused optimizers under any strategy, and in config files
# --------------------------------------------------------------------------- #


def _fit_single(make_optimizer) -> dict[str, torch.Tensor]:
    trainer = unison.Trainer(
        strategy="single", accumulate_grad_batches=2, global_batch_size=16, max_steps=10, grad_clip_norm=0.5
    )
    trainer.fit(mlp(), regression_data(n=128), loss_fn=torch.nn.functional.mse_loss, optimizer=make_optimizer)
    return trainer.full_state_dict()


def test_fused_adam_is_the_optimizer_of_any_strategy(standin):
    # apex's FusedAdam.zero_grad() takes no set_to_none argument; the strategies' zero_grad copes.
    from apex.optimizers import FusedAdam

    fused = _fit_single(lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.01))
    torch_adamw = _fit_single(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01))
    assert max_abs_diff(fused, torch_adamw) <= 1e-5


def test_config_names_apex_fused_optimizers(standin):
    factory = optimizer_factory(ClassConfig(name="apex.FusedAdam", kwargs={"lr": 1e-2, "weight_decay": 0.01}))
    from apex.optimizers import FusedAdam

    assert type(factory(_params())) is FusedAdam
    assert max_abs_diff(_fit_single(factory), _fit_single(lambda p: torch.optim.AdamW(p, lr=1e-2))) <= 1e-5
    assert type(optimizer_factory(ClassConfig(name="apex.FusedLAMB"))(_params())).__name__ == "FusedLAMB"
    with pytest.raises(ConfigurationError, match=r"apex.optimizers has no 'FusedAdamm'.*FusedAdam"):
        optimizer_factory(ClassConfig(name="apex.FusedAdamm"))


@pytest.mark.skipif(APEX_INSTALLED, reason="NVIDIA apex is installed here")
def test_config_apex_name_without_apex_is_a_clear_error():
    with pytest.raises(ConfigurationError) as info:
        optimizer_factory(ClassConfig(name="apex.FusedAdam"))
    assert info.value.option == "optimizer.name"
    assert NOT_INSTALLED in str(info.value) and "github.com/NVIDIA/apex" in str(info.value)


def test_config_module_colon_class_and_bad_names():
    assert type(optimizer_factory(ClassConfig(name="torch.optim:Adagrad"))(_params())) is torch.optim.Adagrad
    with pytest.raises(ConfigurationError, match="cannot import 'no_such_module:Opt'"):
        optimizer_factory(ClassConfig(name="no_such_module:Opt"))
    with pytest.raises(ConfigurationError, match=r"not a torch.optim.Optimizer subclass"):
        optimizer_factory(ClassConfig(name="torch.nn:Linear"))
    with pytest.raises(ConfigurationError, match=r"torch.optim has no 'Adamm'"):
        optimizer_factory(ClassConfig(name="Adamm"))


# --------------------------------------------------------------------------- #
# PrecisionOwner.PLUGIN: third-party precision plugins (the slot apex AMP used to fill)
# --------------------------------------------------------------------------- #


class _HalvedLoss(unison.Precision):
    """A toy third-party precision: scales the loss by 1/2 and unscales the gradients by 2."""

    name = "halved"

    def scale_loss(self, loss):
        return loss / 2

    def unscale_gradients(self, optimizer):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(2)


class _PrecisionPlugin:
    def __init__(self, unavailable=None):
        self.unavailable = unavailable

    @unison.hookimpl
    def unison_precisions(self):
        return [PrecisionSpec("halved", lambda device, grad_scaler: _HalvedLoss(), "toy", unavailable=self.unavailable)]

    @unison.hookimpl
    def unison_strategies(self):
        from unison.strategies.single import SingleStrategy

        class WithPlugin(SingleStrategy):
            @property
            def ownership(self):
                base = super().ownership
                precision = {**base.precision, "halved": PrecisionSupport(PrecisionOwner.PLUGIN, "the halved plugin")}
                return unison.Ownership(base.grad_accumulation, precision, base.state_dict)

        return [
            unison.StrategySpec("single_with_plugin", factory=WithPlugin, description="single + a plugin precision")
        ]


def test_a_plugin_precision_is_driven_by_the_trainer_and_refused_when_unavailable():
    def fit(precision, plugin):
        trainer = unison.Trainer(
            strategy="single_with_plugin",
            precision=precision,
            max_steps=5,
            global_batch_size=16,
            plugin_manager=unison.PluginManager(plugins=[plugin]),
        )
        trainer.fit(
            mlp(),
            regression_data(n=80),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        )
        return trainer

    halved = fit("halved", _PrecisionPlugin())
    assert type(halved.precision) is _HalvedLoss
    # Scaled and unscaled again: the same training as fp32 (SGD is proportional to the gradient).
    assert max_abs_diff(halved.full_state_dict(), fit("32-true", _PrecisionPlugin()).full_state_dict()) <= 1e-6
    with pytest.raises(ConfigurationError, match="'halved' is unavailable here: needs a widget"):
        unison.Trainer(
            strategy="single_with_plugin",
            precision="halved",
            max_steps=1,
            plugin_manager=unison.PluginManager(plugins=[_PrecisionPlugin("needs a widget")]),
        )
    assert not torch.distributed.is_initialized()
