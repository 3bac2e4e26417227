"""A fast start: what ``import unison`` and the ``unison`` command import (sys.modules in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def _imported_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code`` (its own output discarded)."""
    probe = (
        "import contextlib, io, json, sys\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        + "".join(f"    {line}\n" for line in code.splitlines())
        + "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.splitlines()[-1]))


def _main(*args: str) -> str:
    call = f"main({list(args)!r})"
    return f"from unison.cli import main\ntry:\n    {call}\nexcept SystemExit as exc:\n    assert not exc.code\n"


def test_import_unison_and_unison_help_import_no_torch():
    assert "torch" not in _imported_after("import unison")
    help_modules = _imported_after(_main("--help"))
    assert not {"torch", "deepspeed", "transformers", "tensorboard"} & help_modules
    # plugin commands are still listed: the conformance plugin (source names the hook) was imported for it
    assert "unison.conformance.cli" in help_modules
    assert "unison.strategies.ddp" not in help_modules and "unison.plugins.loggers" not in help_modules


def test_describe_imports_strategies_but_no_logger_or_upstream_library():
    modules = _imported_after(_main("describe", "ddp"))
    assert "unison.strategies.ddp" in modules
    assert not {"deepspeed", "transformers", "tensorboard", "mlflow", "wandb", "unison.plugins.loggers"} & modules


#: Loaded by saving, loading or sharding, never by naming or describing a strategy (about a second).
_HEAVY_ON_USE = {
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",  # DTensor
    "torch.distributed.optim",  # ZeroRedundancyOptimizer and the functional optimizers
    "fairscale",
    "deepspeed",
    "apex",
}


@pytest.mark.parametrize("command", [("describe", "ddp"), ("strategies",)])
def test_describing_or_listing_strategies_imports_no_checkpoint_dtensor_or_upstream_library(command):
    modules = _imported_after(_main(*command))
    # every strategy module was imported (their declarations are listed or resolved) ...
    assert {"unison.strategies.fsdp", "unison.strategies.apex", "unison.strategies.torch_zero"} <= modules
    assert "unison.strategies.pipeline.base" in modules and "unison.contract.state" in modules
    # ... and none of them loaded what only a run needs
    assert not _HEAVY_ON_USE & modules, sorted(_HEAVY_ON_USE & modules)


def test_torch_zero_imports_its_sharding_optimizer_when_constructed_before_any_process_group():
    # ZeroRedundancyOptimizer binds the world group at its first import: the strategy takes it at
    # construction, which the trainer does before it starts the process group.
    modules = _imported_after(
        "import torch.distributed as dist\n"
        "from unison.plugin.manager import PluginManager\n"
        "spec, options = PluginManager(lazy=True).strategies.resolve('torch_zero')\n"
        "assert 'torch.distributed.optim' not in sys.modules\n"
        "spec.factory(**options.model_dump())\n"
        "assert not dist.is_initialized()\n"
    )
    assert "torch.distributed.optim" in modules and "torch.distributed.checkpoint" not in modules


def test_unison_names_still_resolve_lazily():
    import unison

    assert unison.Trainer.__name__ == "Trainer" and unison.hookimpl is not None
    assert set(unison.__all__) <= set(dir(unison))
    with pytest.raises(AttributeError, match="no attribute 'Trainr'"):
        unison.Trainr  # noqa: B018


def test_a_lazy_manager_imports_an_entry_point_only_for_a_hook_its_source_names():
    code = (
        "import sys\n"
        "from unison.plugin.manager import PluginManager\n"
        "pm = PluginManager(lazy=True)\n"
        "before = 'unison.strategies.ddp' in sys.modules\n"
        "names = pm.strategies.names()\n"
        "after_strategies = {m for m in ('unison.strategies.ddp', 'unison.plugins.loggers') if m in sys.modules}\n"
        "plugins = dict(pm.list_plugins())\n"
        "eager = [n for n, _ in PluginManager().list_plugins()]\n"
        "lazy = [n for n, _ in pm.list_plugins()]\n"
        "same = sorted(eager) == sorted(lazy)\n"
        "print(json.dumps([before, 'ddp' in names, sorted(after_strategies), 'loggers' in plugins, same]))\n"
    )
    out = subprocess.run([sys.executable, "-c", "import json\n" + code], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    before, has_ddp, after_strategies, loggers_listed, same_plugins = json.loads(out.stdout.splitlines()[-1])
    assert before is False and has_ddp
    assert after_strategies == ["unison.strategies.ddp"]  # registering strategies did not import the loggers
    assert loggers_listed and same_plugins  # list_plugins loads every deferred entry point


def test_unison_train_says_what_it_does_first(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[model]\nfactory = "missing.py:build"\n[data]\nfactory = "missing.py:data"\n')
    out = subprocess.run(
        [sys.executable, "-m", "unison.cli", "train", str(config)],
        capture_output=True,
        text=True,
        timeout=100,
        env={**__import__("os").environ, "COLUMNS": "400"},
    )
    lines = out.stdout.splitlines()
    assert lines and lines[0] == f"unison train {config}: loading torch, checking the config", out.stdout
    assert out.returncode == 2  # and the config's error follows it


def test_deepspeed_on_the_cpu_builds_no_shm_comm_op(tmp_path):
    # deepspeed.comm builds its shared-memory op (inference all-reduce only) when it starts: a minute of
    # compiling on a cold cache. unison's import marks it incompatible on the CPU, so nothing is built.
    code = (
        "import torch\n"
        "from unison._upstream.deepspeed import import_deepspeed\n"
        "import_deepspeed(torch.device('cpu'))\n"
        "from deepspeed.comm.torch import build_shm_op\n"
        "assert build_shm_op() is None\n"
    )
    env = {**__import__("os").environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not (tmp_path / "ext").exists() or not any((tmp_path / "ext").rglob("*.so"))
