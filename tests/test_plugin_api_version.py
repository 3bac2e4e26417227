"""The versioned plugin API: registration refuses strategies written for an older API, with the migration.

The 1.x strategy below is the one the strategy-plugin page showed before the template method (its
``setup`` takes no ``env``), copied as it was; the current page's strategy registers and trains
(tests/test_plugins_manager.py) and the shipped example is certified (tests/test_conformance.py).
"""

from __future__ import annotations

import re
import sys
import textwrap
import warnings

import pytest
import torch

import unison
from unison.contract import API_VERSION, MIGRATIONS, Migration, ReplicatedStrategy
from unison.contract.env import DistEnv
from unison.contract.settings import TrainerSettings
from unison.contract.version import check_strategy_class, target_version

V1_PLUGIN = """
import torch
import unison
from unison.strategy import StrategySpec, canonical, dcp_load, dcp_save


class MyStrategy(unison.Strategy):
    @property
    def ownership(self):
        return unison.Ownership(
            grad_accumulation=unison.GradAccumulation(
                unison.AccumulationOwner.TRAINER, "no_sync() on non-boundary micro-steps"
            ),
            precision={
                "32-true": unison.PrecisionSupport(unison.PrecisionOwner.TRAINER, "fp32"),
                "bf16-mixed": unison.PrecisionSupport.unsupported("not wired yet"),
                "bf16-true": unison.PrecisionSupport.unsupported("not wired yet"),
                "16-mixed": unison.PrecisionSupport.unsupported("not wired yet"),
            },
            state_dict=unison.StateDictDeclaration(
                unison.StateDictKind.FULL,
                "DCP, keys = module parameter names",
                reshardable=True,
                canonical_export="module.state_dict() on every rank",
            ),
        )

    def setup(self, module, make_optimizer, *, precision, settings):
        self.module = module.to(self.env.device)
        self.model = torch.nn.parallel.DistributedDataParallel(self.module)
        self.optimizer = make_optimizer(self.module.parameters())

    def no_sync(self):
        return self.model.no_sync()

    def clip_grad_norm(self, max_norm):
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm or float("inf"))

    def full_state_dict(self):
        return canonical(self.module.state_dict())

    def save_state(self, directory):
        dcp_save(self.module, self.optimizer, directory)

    def load_state(self, directory):
        dcp_load(self.module, self.optimizer, directory)


@unison.hookimpl
def unison_strategies():
    return [StrategySpec(name="mine", factory=MyStrategy, description="...")]
"""


def _module(name: str, code: str) -> object:
    module = type(sys)(name)
    exec(compile(textwrap.dedent(code), f"{name}.py", "exec"), module.__dict__)
    return module


def test_a_1x_strategy_is_refused_at_registration_with_the_migration():
    pm = unison.PluginManager(plugins=[_module("my_v1_backend", V1_PLUGIN)])
    with pytest.raises(unison.PluginError) as refused:
        pm.strategies.names()
    message = str(refused.value)
    assert "my_v1_backend.MyStrategy" in message and "targets plugin API 1.0" in message
    assert f"speaks API {API_VERSION}" in message
    # What changed and how to migrate, from the table.
    assert MIGRATIONS[0].change in message and MIGRATIONS[0].how in message
    assert "env" in MIGRATIONS[0].change and "configure_module" in MIGRATIONS[0].how


class _Current(ReplicatedStrategy):
    api_version = API_VERSION

    @property
    def ownership(self) -> unison.Ownership:
        raise NotImplementedError  # never read here


def test_versions_are_declared_or_read_from_setup():
    class Undeclared(ReplicatedStrategy):
        ownership = _Current.ownership

    class OwnSetupWithEnv(Undeclared):
        def setup(self, module, make_optimizer, *, env=None, precision, settings):
            super().setup(module, make_optimizer, env=env, precision=precision, settings=settings)

    v1 = _module("v1_read", V1_PLUGIN).MyStrategy
    assert target_version(_Current) == target_version(Undeclared) == target_version(OwnSetupWithEnv) == API_VERSION
    assert target_version(v1) == "1.0"
    for cls in (_Current, Undeclared, OwnSetupWithEnv):
        check_strategy_class(cls, plugin="test")  # no error, no warning


def test_a_declared_older_or_newer_version_is_refused():
    class Old(_Current):
        api_version = "1.2"

    class New(_Current):
        api_version = "9.0"

    with pytest.raises(unison.PluginError, match=r"targets plugin API 1\.2.*Migrate: delete your setup"):
        check_strategy_class(Old, plugin="test")
    with pytest.raises(
        unison.PluginError, match=rf"targets plugin API 9\.0, newer than this unison's {re.escape(API_VERSION)}"
    ):
        check_strategy_class(New, plugin="test")


def test_a_signature_mismatch_names_the_method_and_both_signatures():
    class NoMaxNorm(_Current):
        def clip_grad_norm(self):
            raise NotImplementedError

    class SetupWithoutSettings(_Current):
        def setup(self, module, make_optimizer, *, env=None, precision):
            raise NotImplementedError

    with pytest.raises(unison.PluginError) as refused:
        check_strategy_class(NoMaxNorm, plugin="test")
    assert "clip_grad_norm(self)" in str(refused.value) and "clip_grad_norm(self, max_norm" in str(refused.value)
    with pytest.raises(unison.PluginError, match=r"setup\(self, module, make_optimizer, \*, env=None, precision\)"):
        check_strategy_class(SetupWithoutSettings, plugin="test")


def test_a_deprecated_change_warns_until_it_is_removed():
    # A synthetic future change: API 2.5 deprecates something 2.4 plugins do, removed in 3.0.
    future = (*MIGRATIONS, Migration("2.5", "the thing 2.4 did", "do the other thing", removed_in="3.0"))
    assert _Current.api_version == "2.4"
    with pytest.warns(
        DeprecationWarning, match=r"the thing 2\.4 did \(deprecated since API 2\.5, removed in API 3\.0\)"
    ):
        check_strategy_class(_Current, plugin="test", api_version="2.5", migrations=future)
    with pytest.raises(unison.PluginError, match="Migrate: do the other thing"):
        check_strategy_class(_Current, plugin="test", api_version="3.0", migrations=future)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_strategy_class(_Current, plugin="test", api_version="2.4", migrations=future)


def test_setup_runs_the_hooks_in_order_and_sets_the_attributes():
    calls: list[str] = []

    class Recording(_Current):
        def configure_module(self, module):
            calls.append("configure_module")
            return super().configure_module(module)

        def apply_features(self, module):
            calls.append("apply_features")
            assert module is self.module  # on its device, before the wrapper
            super().apply_features(module)

        def wrap_module(self, module):
            calls.append("wrap_module")
            return ("wrapped", module)

        def build_optimizer(self, make_optimizer):
            calls.append("build_optimizer")
            assert self.model[1] is self.module  # the wrapper exists before the optimizer
            return super().build_optimizer(make_optimizer)

    strategy, module = Recording(), torch.nn.Linear(2, 1)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    settings = TrainerSettings(max_steps=1)
    strategy.setup(module, lambda p: torch.optim.SGD(p, lr=0.1), env=env, precision=None, settings=settings)
    assert calls == ["configure_module", "apply_features", "wrap_module", "build_optimizer"]
    assert strategy.env is env and strategy.module is module and strategy.model == ("wrapped", module)
    assert strategy.optimizer.param_groups[0]["params"] == list(module.parameters())


def test_a_plugin_written_for_2_0_registers_unchanged_under_2_4():
    """2.1 to 2.4 only added (the apply_features hook, two refusable features, Ownership.mesh; the
    unison_tensor_parallel_plan hookspec and Strategy.plugins; loss normalisation and the build hook;
    reports_step_losses): no migration, no warning."""

    class Written20(ReplicatedStrategy):
        api_version = "2.0"
        ownership = _Current.ownership

    assert API_VERSION == "2.4"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_strategy_class(Written20, plugin="test")
