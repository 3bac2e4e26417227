"""The plugin manager is pluggy all the way: registration through pm.hook, live registries, a typed facade.

Plugins here are real: modules and objects registered through the manager, and a
third-party distribution installed on ``sys.path`` (a ``.dist-info`` with an entry
point, exactly what pip writes) for the autoload and ``UNISON_PLUGINS`` cases.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import unison
from unison.config.load import load_config
from unison.errors import PluginError
from unison.plugin import hookspecs
from unison.plugin.registry import StrategySpec
from unison.strategies.single import SingleStrategy

from helpers import fit, mlp, regression_data, sgd

ROOT = Path(__file__).resolve().parents[1]


class LateStrategies:
    """A plugin registering one more strategy (the real single-process strategy, renamed)."""

    @unison.hookimpl
    def unison_strategies(self):
        return [StrategySpec(name="late", factory=SingleStrategy, description="registered after the first lookup")]


# --------------------------------------------------------------------------- #
# Registries follow registration
# --------------------------------------------------------------------------- #
def test_a_plugin_registered_after_the_first_lookup_is_found_and_trains():
    pm = unison.PluginManager()
    assert "late" not in pm.strategies.names()  # the registry is built here
    plugin = LateStrategies()
    pm.register(plugin)
    assert "late" in pm.strategies.names()
    trainer = unison.Trainer(strategy="late", max_steps=2, global_batch_size=8, plugin_manager=pm)
    assert fit(trainer, optimizer=sgd(0.01)).optimizer_steps == 2
    pm.unregister(plugin)
    with pytest.raises(unison.UnknownStrategyError, match="unknown strategy 'late'"):
        pm.strategies.create("late")


def test_a_strategy_registered_as_a_callback_is_found():
    pm = unison.PluginManager()
    pm.strategies.names()
    trainer = unison.Trainer(
        strategy="late", max_steps=1, global_batch_size=8, plugin_manager=pm, callbacks=[LateStrategies()]
    )
    assert trainer.strategy.name == "late"


def test_unregister_by_name_removes_its_strategies():
    pm = unison.PluginManager()
    assert "ddp" in pm.strategies.names()
    pm.unregister(name="ddp")
    assert "ddp" not in pm.strategies.names() and "single" in pm.strategies.names()


# --------------------------------------------------------------------------- #
# Registration goes through pluggy
# --------------------------------------------------------------------------- #
class WatchRegistration:
    """A new-style wrapper around every strategy registration call; may drop a name."""

    def __init__(self, drop: str | None = None) -> None:
        self.seen: list[str] = []
        self.drop = drop

    @unison.hookimpl(wrapper=True)
    def unison_strategies(self):
        results = yield
        self.seen.extend(spec.name for specs in results for spec in specs)
        return [[spec for spec in specs if spec.name != self.drop] for specs in results]


def test_a_wrapper_sees_every_registered_strategy():
    watch = WatchRegistration()
    pm = unison.PluginManager(plugins=[watch])
    names = pm.strategies.names()
    assert {"single", "ddp", "pipeline", "zero3"} <= set(watch.seen)
    assert set(watch.seen) == {spec.name for spec in pm.strategies.specs()}
    assert "zero3_offload" in names  # aliases come with their spec


def test_a_wrapper_can_change_what_is_registered():
    pm = unison.PluginManager(plugins=[WatchRegistration(drop="ddp")])
    assert "ddp" not in pm.strategies.names() and "single" in pm.strategies.names()


def test_hook_monitoring_records_registration_calls():
    pm = unison.PluginManager()
    with pm.record_hook_calls(prefix="unison_") as calls:
        pm.strategies.names()
        pm.precisions.names()

    # One call per registering plugin, each through pluggy.
    def registering(name):
        return [i for i in getattr(pm.hook, name).get_hookimpls() if not (i.wrapper or i.hookwrapper)]

    assert len(registering("unison_strategies")) >= 6
    assert calls.count("unison_strategies") == len(registering("unison_strategies"))
    assert calls.count("unison_precisions") == len(registering("unison_precisions")) >= 1


def test_duplicate_name_error_names_both_plugins():
    class First:
        @unison.hookimpl
        def unison_strategies(self):
            return [StrategySpec(name="twin", factory=SingleStrategy, description="first")]

    class Second:
        @unison.hookimpl
        def unison_strategies(self):
            return [StrategySpec(name="twin", factory=SingleStrategy, description="second")]

    pm = unison.PluginManager()
    pm.register(First(), name="first-plugin")
    pm.register(Second(), name="second-plugin")
    with pytest.raises(
        PluginError, match="'twin' is registered by both plugin 'first-plugin' and plugin 'second-plugin'"
    ):
        pm.strategies.names()


# --------------------------------------------------------------------------- #
# Near misses
# --------------------------------------------------------------------------- #
def test_unknown_strategy_suggests_the_closest_name():
    with pytest.raises(unison.UnknownStrategyError, match=r"unknown strategy 'dpp' \(did you mean 'ddp'\?\)"):
        unison.Trainer(strategy="dpp", max_steps=1)
    with pytest.raises(unison.UnknownStrategyError) as info:
        unison.Trainer(strategy="qwertyuiop", max_steps=1)
    assert "did you mean" not in str(info.value) and "ddp" in str(info.value)  # still lists the names


def test_unknown_precision_suggests_the_closest_name():
    with pytest.raises(unison.ConfigurationError, match=r"'bf16-mixd' .*did you mean 'bf16-mixed'\?"):
        unison.Trainer(strategy="ddp", precision="bf16-mixd", max_steps=1)
    with pytest.raises(unison.ConfigurationError, match=r"did you mean '32-true'\?"):
        unison.PluginManager().precisions.get("32-tru")


# --------------------------------------------------------------------------- #
# The typed facade
# --------------------------------------------------------------------------- #
def _specs() -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(fn)
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if name.startswith("unison_") and name not in ("unison_strategies", "unison_precisions")
    }


def test_every_hookspec_has_a_typed_facade_method_with_its_arguments():
    for name, spec in _specs().items():
        method = getattr(unison.PluginManager, name, None)
        assert method is not None, f"PluginManager has no facade method for hookspec {name}"
        params = list(inspect.signature(method).parameters.values())[1:]  # without self
        assert [p.name for p in params] == list(spec.parameters), name
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params), f"{name}: keyword-only arguments"


def test_the_facade_reaches_implementations():
    got = []

    class Listener:
        @unison.hookimpl
        def unison_on_train_step_start(self, trainer, step):
            got.append(("step_start", trainer, step))

        @unison.hookimpl
        def unison_plugins_from_config(self, config):
            return [("built from", config)]

    pm = unison.PluginManager(plugins=[Listener()])
    pm.unison_on_train_step_start(trainer="t", step=3)
    assert got == [("step_start", "t", 3)]
    config, _ = load_config(ROOT / "examples" / "tinylm.toml", {})
    plugins = pm.unison_plugins_from_config(config=config)
    # One flat list: this plugin's and the built-in loggers' (JSONL, progress) for this config.
    assert ("built from", config) in plugins and not any(isinstance(p, list) for p in plugins)
    assert len(plugins) >= 2


# --------------------------------------------------------------------------- #
# Installed plugins, autoload and UNISON_PLUGINS
# --------------------------------------------------------------------------- #
PLUGIN_MODULE = """
import unison
from unison.plugin.registry import PrecisionSpec, StrategySpec, missing_modules
from unison.strategies.single import SingleStrategy

@unison.hookimpl
def unison_strategies():
    return [StrategySpec(name="installed_late", factory=SingleStrategy, description="from an installed plugin"),
            StrategySpec(name="needs_extra", factory=SingleStrategy, description="unavailable on purpose",
                         unavailable=missing_modules("unison_no_such_package"))]

@unison.hookimpl
def unison_precisions():
    return [PrecisionSpec("fp8-someday", lambda device, grad_scaler: None, "needs a package that is not installed",
                          unavailable=missing_modules("unison_no_such_package"))]
"""


def install_plugin(site: Path) -> None:
    """Install a distribution into ``site`` the way pip does: a module and a .dist-info with an entry point."""
    (site / "unison_installed_plugin.py").write_text(PLUGIN_MODULE)
    info = site / "unison_installed_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: unison-installed-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[unison]\ninstalled = unison_installed_plugin\n")


@pytest.fixture
def installed_plugin(tmp_path):
    """A directory holding an installed distribution with an entry point (not yet on ``sys.path``)."""
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(site)
    return site


def test_a_plugin_installed_while_the_process_runs_is_found_by_the_next_manager(tmp_path, monkeypatch):
    # The entry points are scanned once per change of what is installed (unison.plugin.entry_points):
    # a package installed into a directory already on sys.path changes that directory, so it is found.
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    assert "installed_late" not in unison.PluginManager().strategies.names()
    install_plugin(site)
    assert "installed_late" in unison.PluginManager().strategies.names()


def test_installed_versions_are_read_again_when_what_is_installed_changes(tmp_path, monkeypatch):
    # What a run records as its versions is read once per change of what is installed, like the entry points.
    from unison.plugin.entry_points import installed_versions

    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    names = ("unison-installed-plugin", "torch")
    assert installed_versions(names) == {"torch": torch.__version__}
    install_plugin(site)
    versions = installed_versions(names)
    assert versions == {"unison-installed-plugin": "0.1", "torch": torch.__version__}
    versions["torch"] = "changed by a caller"
    assert installed_versions(names)["torch"] == torch.__version__  # each call gets its own dict
    # An upgrade the way pip does it: the old .dist-info removed, the new one written.
    old = site / "unison_installed_plugin-0.1.dist-info"
    new = site / "unison_installed_plugin-0.2.dist-info"
    old.rename(new)
    (new / "METADATA").write_text("Metadata-Version: 2.1\nName: unison-installed-plugin\nVersion: 0.2\n")
    assert installed_versions(names)["unison-installed-plugin"] == "0.2"


def test_an_installed_plugin_is_autoloaded_and_can_be_disabled(installed_plugin, monkeypatch):
    monkeypatch.syspath_prepend(str(installed_plugin))
    assert "installed_late" in unison.PluginManager().strategies.names()
    monkeypatch.setenv("UNISON_DISABLE_PLUGIN_AUTOLOAD", "1")
    names = unison.PluginManager().strategies.names()
    assert "installed_late" not in names and "ddp" in names


def test_unison_plugins_naming_an_installed_plugin_loads_it_once(installed_plugin, monkeypatch):
    monkeypatch.syspath_prepend(str(installed_plugin))
    monkeypatch.setenv("UNISON_PLUGINS", "unison_installed_plugin,unison.strategies.ddp")
    pm = unison.PluginManager()
    assert pm.strategies.names().count("installed_late") == 1
    monkeypatch.setenv("UNISON_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert "installed_late" in unison.PluginManager().strategies.names()  # named explicitly


def _cli(*args: str, site: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "400", "PYTHONPATH": str(site), **env}
    return subprocess.run(
        [sys.executable, "-m", "unison.cli", *args], env=environ, capture_output=True, text=True, timeout=120
    )


def test_cli_with_unison_plugins_naming_an_installed_plugin(installed_plugin):
    out = _cli("strategies", site=installed_plugin, UNISON_PLUGINS="unison_installed_plugin")
    assert out.returncode == 0, out.stderr
    assert "installed_late" in out.stdout and "Traceback" not in out.stderr
    # Plugin text is shown as written, not as rich markup (the install hint keeps its extra).
    assert "pip install 'unison[unison_no_such_package]'" in out.stdout


def test_cli_reports_a_broken_plugin_module_without_a_traceback(installed_plugin):
    out = _cli("strategies", site=installed_plugin, UNISON_PLUGINS="unison_no_such_module")
    assert out.returncode == 2
    assert "plugin module 'unison_no_such_module' named in UNISON_PLUGINS failed to import" in out.stdout
    assert "Traceback" not in out.stderr


def test_cli_lists_precision_plugins_with_availability(installed_plugin):
    out = _cli("precisions", site=installed_plugin)
    assert out.returncode == 0, out.stderr
    rows = {
        name: next((line for line in out.stdout.splitlines() if f" {name} " in line), "")
        for name in ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "fp8-someday")
    }
    assert all(rows.values()), out.stdout
    assert "yes" in rows["32-true"]
    assert "no: python package 'unison_no_such_package' is not installed" in rows["fp8-someday"]
    assert "pip install 'unison[unison_no_such_package]'" in rows["fp8-someday"]


# --------------------------------------------------------------------------- #
# The documented strategy plugin (docs/strategy-plugins.md) is the contract as it is
# --------------------------------------------------------------------------- #
def test_documented_strategy_plugin_registers_and_trains(tmp_path):
    readme = (ROOT / "docs" / "strategy-plugins.md").read_text()
    section = readme[readme.index("# Writing a strategy plugin") :]
    code = section[section.index("```python") + len("```python") : section.index("```", section.index("```python") + 9)]
    module = type(sys)("my_backend")
    exec(compile(textwrap.dedent(code), "docs/strategy-plugins.md:my_backend", "exec"), module.__dict__)
    pm = unison.PluginManager(plugins=[module])
    trainer = unison.Trainer(
        strategy="mine",
        max_steps=3,
        global_batch_size=8,
        accumulate_grad_batches=2,
        grad_clip_norm=0.5,
        checkpoint_dir=str(tmp_path),
        plugin_manager=pm,
    )
    progress = fit(trainer, optimizer=sgd(0.01))
    assert progress.optimizer_steps == 3 and (tmp_path / "step-00000003").is_dir()
    with pytest.raises(unison.ConfigurationError, match="why, and what to use instead"):
        unison.Trainer(strategy="mine", max_steps=1, plugin_manager=pm).fit(
            mlp(),
            regression_data(64),
            training_step=lambda model, batch: model(batch[0]).mean(),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
        )
