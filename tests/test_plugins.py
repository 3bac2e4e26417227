"""The plugin system: hookspecs, registration order, validation, blocking, monitoring."""

from __future__ import annotations

import inspect
import re
import types

import pluggy
import pydantic
import pytest

import unison
from unison.errors import PluginError
from unison.plugin import hookspecs
from unison.plugin.registry import StrategySpec


def all_specs():
    return [(name, fn) for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("unison_")]


def test_every_hookspec_is_documented_with_caller_and_timing():
    specs = all_specs()
    assert len(specs) >= 15
    for name, fn in specs:
        doc = inspect.getdoc(fn) or ""
        assert len(doc) > 80, f"{name} needs a real docstring"
        assert re.search(r"\bcalled\b", doc, re.IGNORECASE), f"{name}: say who calls it and when"


def test_every_lifecycle_hookspec_is_named_in_the_documented_order():
    order_doc = hookspecs.__doc__
    for name, _ in all_specs():
        if name.startswith("unison_on_") or name == "unison_log_metrics":
            assert name in order_doc, f"{name} missing from the documented hook order"


def test_builtins_are_registered_through_the_entry_point_group():
    pm = unison.PluginManager()
    names = {name for name, _ in pm.list_plugins()}
    assert {"single", "ddp", "precision", "loggers", "callbacks", "progress"} <= names
    assert {"single", "ddp"} <= set(pm.strategies.names())


def test_wrong_hook_argument_is_rejected_naming_plugin_and_hook():
    class Bad:
        @unison.hookimpl
        def unison_on_train_step_end(self, trainer, stepp):
            pass

    with pytest.raises(PluginError, match=r"unison_on_train_step_end.*stepp|stepp.*unison_on_train_step_end"):
        unison.Trainer(max_steps=1, strategy="single", callbacks=[Bad()])


def test_unknown_hook_is_rejected_naming_plugin_and_hook():
    class Typo:
        @unison.hookimpl
        def unison_on_trian_step_end(self, trainer):
            pass

    with pytest.raises(PluginError, match="unison_on_trian_step_end") as info:
        unison.Trainer(max_steps=1, strategy="single", callbacks=[Typo()])
    assert "Typo" in str(info.value) or "plugin" in str(info.value)


def test_autoload_disabled_keeps_builtins_and_env_plugins(monkeypatch):
    third_party = types.ModuleType("unison_test_third_party")

    @unison.hookimpl
    def unison_strategies():
        return []

    third_party.unison_strategies = unison_strategies
    import sys

    monkeypatch.setitem(sys.modules, "unison_test_third_party", third_party)
    monkeypatch.setenv("UNISON_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("UNISON_PLUGINS", "unison_test_third_party")
    pm = unison.PluginManager()
    names = {name for name, _ in pm.list_plugins()}
    assert "ddp" in names and "unison_test_third_party" in names


def test_plugin_blocked_by_name(monkeypatch):
    monkeypatch.setenv("UNISON_BLOCK_PLUGINS", "ddp")
    pm = unison.PluginManager()
    assert "ddp" not in pm.strategies.names()
    with pytest.raises(unison.UnknownStrategyError, match="single"):
        pm.strategies.create("ddp")


def test_duplicate_strategy_name_names_both_plugins():
    class Clash:
        @unison.hookimpl
        def unison_strategies(self):
            return [StrategySpec(name="ddp", factory=object, description="clash")]

    pm = unison.PluginManager(plugins=[Clash()])
    with pytest.raises(PluginError, match=r"'ddp'.*both"):
        pm.strategies.names()


def test_record_hook_calls_sees_what_plugins_see():
    pm = unison.PluginManager()
    with pm.record_hook_calls() as calls:
        pm.hook.unison_on_train_step_start(trainer=None, step=0)
        pm.hook.unison_on_train_step_start(trainer=None, step=1)
    assert calls == ["unison_on_train_step_start"] * 2


def test_hookimpl_marker_is_pluggys():
    assert isinstance(unison.hookimpl, pluggy.HookimplMarker)
    assert unison.hookimpl.project_name == "unison"


class _Opts(__import__("pydantic").BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    bucket: int = 1


class AliasAndUnavailable:
    @unison.hookimpl
    def unison_strategies(self):
        from unison.strategies.single import SingleStrategy

        class WithOpts(SingleStrategy):
            def __init__(self, bucket):
                super().__init__()
                self.bucket = bucket

        return [
            StrategySpec(
                name="opt_single",
                factory=WithOpts,
                description="with options",
                options=_Opts,
                aliases={"opt_single_big": {"bucket": 64}},
            ),
            StrategySpec(
                name="needs_gpu",
                factory=WithOpts,
                description="cuda only",
                unavailable="needs CUDA, which this machine does not have",
            ),
        ]


def test_alias_resolves_with_preset_options_and_user_options_win():
    pm = unison.PluginManager(plugins=[AliasAndUnavailable()])
    assert pm.strategies.create("opt_single_big").bucket == 64
    assert pm.strategies.create("opt_single_big", {"bucket": 3}).bucket == 3
    assert pm.strategies.create("opt_single").bucket == 1
    assert pm.strategies.create("opt_single_big").name == "opt_single_big"


def test_unavailable_strategy_is_listed_with_reason_and_refused():
    pm = unison.PluginManager(plugins=[AliasAndUnavailable()])
    spec = {s.name: s for s in pm.strategies.specs()}["needs_gpu"]
    assert spec.unavailable == "needs CUDA, which this machine does not have"
    with pytest.raises(unison.ConfigurationError, match="unavailable here: needs CUDA"):
        unison.Trainer(max_steps=1, strategy="needs_gpu", plugin_manager=pm)
