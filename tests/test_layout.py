"""The layout shows the architecture, and these tests pin it.

Import rules (runtime imports, function-level ones included; ``if TYPE_CHECKING:`` blocks are
annotations only and exempt):

* ``core/`` (package ``unison``) imports no strategy, plugin or suite module: built-ins are found
  through the entry point, like third-party plugins.
* ``strategies/`` and ``plugins/`` import core and their own libraries, never each other.
* Nothing outside the suite and the tests imports the suite.
* Inside core, layers point down: the contract (what a strategy implements) imports neither the
  trainer, the launcher, checkpointing nor config; the launcher, checkpointing, data and config never
  import the trainer or the CLI.

Modules that moved into subpackages keep their old flat path for one minor version, with a
DeprecationWarning naming the new one (tests/test_deprecated_paths.py imports all 33 and their names);
no code of the project uses one.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# directory -> the package it is installed as (pyproject.toml [tool.setuptools.package-dir])
TREES = {
    "core": "unison",
    "strategies": "unison.strategies",
    "plugins": "unison.plugins",
    "conformance_tests": "unison.conformance",
}


def _package_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    base = TREES[rel.parts[0]]
    inner = list(rel.parts[1:-1]) + ([] if rel.stem == "__init__" else [rel.stem])
    return ".".join([base, *inner])


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_imports(path: Path) -> set[str]:
    """Every module ``path`` imports at run time, as absolute dotted names (``from a import b`` gives a.b too)."""
    found: set[str] = set()
    package = _package_of(path)
    if path.stem != "__init__":
        package = package.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _files(tree: str) -> list[Path]:
    return sorted((ROOT / tree).rglob("*.py"))


def _violations(tree: str, forbidden: tuple[str, ...], only: str | None = None) -> list[str]:
    out = []
    for path in _files(tree):
        if only and not _package_of(path).startswith(only):
            continue
        for name in sorted(runtime_imports(path)):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                out.append(f"{path.relative_to(ROOT)} imports {name}")
    return out


def test_core_imports_no_strategy_plugin_or_suite():
    assert _violations("core", ("unison.strategies", "unison.plugins", "unison.conformance")) == []


def test_strategies_and_plugins_do_not_import_each_other_or_the_suite():
    assert _violations("strategies", ("unison.plugins", "unison.conformance")) == []
    assert _violations("plugins", ("unison.strategies", "unison.conformance")) == []


@pytest.mark.parametrize("tree", ["examples", "benchmarks"])
def test_nothing_outside_the_suite_and_tests_imports_it(tree):
    out = []
    for path in sorted((ROOT / tree).rglob("*.py")):
        text = path.read_text()
        if "unison.conformance" in text and any(n.startswith("unison.conformance") for n in _plain_imports(path)):
            out.append(str(path.relative_to(ROOT)))
    assert out == []


def _plain_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_contract_sits_below_the_loop_the_launcher_checkpointing_and_config():
    upper = ("unison.training", "unison.launch", "unison.checkpointing", "unison.config", "unison.cli")
    assert _violations("core", upper, only="unison.contract") == []


@pytest.mark.parametrize("layer", ["unison.launch", "unison.checkpointing", "unison.data", "unison.config"])
def test_lower_layers_never_import_the_trainer_or_the_cli(layer):
    assert _violations("core", ("unison.training", "unison.cli"), only=layer) == []


def test_the_checker_sees_a_forbidden_import():
    """The rules above can fail: a core module importing a strategy is reported."""
    fake = ROOT / "core" / "contract" / "_layout_probe.py"
    fake.write_text("def f():\n    from unison.strategies.ddp import DDPStrategy\n    return DDPStrategy\n")
    try:
        assert _violations("core", ("unison.strategies",)) == [
            "core/contract/_layout_probe.py imports unison.strategies.ddp",
            "core/contract/_layout_probe.py imports unison.strategies.ddp.DDPStrategy",
        ]
    finally:
        fake.unlink()


def test_no_code_in_the_project_uses_an_old_path():
    code = (
        "import warnings, pkgutil, importlib, unison\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "for pkg in ('unison', 'unison.strategies', 'unison.plugins', 'unison.conformance'):\n"
        "    mod = importlib.import_module(pkg)\n"
        "    for m in pkgutil.walk_packages(mod.__path__, pkg + '.'):\n"
        "        importlib.import_module(m.name)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_long_tier_module_exists_and_ci_runs_both_tiers():
    from conftest import FULL_TIER

    tests = Path(__file__).resolve().parent
    assert sorted(m for m in FULL_TIER if not (tests / m).is_file()) == []
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\nscripts/test 2>&1" in ci  # the README's test command: the quick tier
    assert '-m pytest tests -p no:cacheprovider -m "not full"' in (ROOT / "scripts" / "test").read_text()
    assert "-m pytest tests -p no:cacheprovider -m full" in ci
