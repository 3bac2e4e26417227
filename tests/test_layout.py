"""The layout shows the architecture, and these tests pin it.

Import rules. Every import counts: module level, inside functions, and inside ``if TYPE_CHECKING:``
blocks (a type-only import is a dependency a reader sees, so the picture the imports give is the
architecture):

* ``core/`` (package ``unison``) imports no strategy, plugin or suite module: built-ins are found
  through the entry point, like third-party plugins.
* ``strategies/`` and ``plugins/`` import core and their own libraries, never each other.
* Nothing outside the suite and the tests imports the suite.
* Inside core, layers point down, in the order README.md's "Layout" lists them (the base modules, then
  ``contract/``, ``plugin/``, ``launch/``, ``checkpointing/``, ``data/``, ``config/``, ``training/``,
  ``cli/``, then ``__init__.py``): no module imports a module of a higher layer, so no two subpackages
  import each other. The test reads the order from the README, so the README's description is checked.

Modules that moved into subpackages keep their old flat path for one minor version, with a
DeprecationWarning naming the new one (tests/test_deprecated_paths.py imports all 33 and their names);
no code of the project uses one.
"""

from __future__ import annotations

import ast
import shutil
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


def imports_of(path: Path, package: str) -> set[str]:
    """Every module ``path`` (module ``package``) imports, type-only and function-level imports included,
    as absolute dotted names (``from a import b`` gives a.b too)."""
    found: set[str] = set()
    if path.stem != "__init__":
        package = package.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
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
    return found


def imports(path: Path) -> set[str]:
    """Every module ``path`` of the project imports (type-only imports count)."""
    return imports_of(path, _package_of(path))


def _files(tree: str) -> list[Path]:
    return sorted((ROOT / tree).rglob("*.py"))


def _violations(tree: str, forbidden: tuple[str, ...], only: str | None = None) -> list[str]:
    out = []
    for path in _files(tree):
        if only and not _package_of(path).startswith(only):
            continue
        for name in sorted(imports(path)):
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
    script = (ROOT / "scripts" / "test").read_text()
    assert '-m pytest tests -p no:cacheprovider -m "not full"' in script
    assert "-m pytest tests -p no:cacheprovider -m full" in ci
    # The README quotes the command scripts/test runs, as it runs it (two test processes, a file in one).
    command = script.split("exec .venv/bin/python ", 1)[1].split(' "$@"', 1)[0]
    assert f"`OMP_NUM_THREADS=1 .venv/bin/python {command}`" in " ".join((ROOT / "README.md").read_text().split())
    assert "-n 2 --dist loadfile" in command and "-m full -n 2 --dist loadfile" in ci


# --------------------------------------------------------------------------- #
# Layers inside core, in README.md's order
# --------------------------------------------------------------------------- #
def readme_layers(readme: Path = ROOT / "README.md") -> list[list[str]]:
    """The parts of ``core/`` as README.md's Layout lists them, lowest layer first: each entry the names
    of one layer (``["errors.py", "_version.py", ...]``, ``["contract"]``, ..., ``["__init__.py"]``)."""
    block = readme.read_text().split("\n## Layout\n", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    core = ("\n" + block).split("\ncore/", 1)[1].split("\n", 1)[1]
    layers = []
    for line in core.splitlines():
        if not line.startswith("  ") or line.startswith("   "):
            if not line.startswith(" "):
                break  # the next top-level directory
            continue  # a continued description
        names = line.strip().split("  ")[0]
        layers.append([n.strip().rstrip("/") for n in names.split(",")])
    return layers


def layer_violations(core: Path, layers: list[list[str]]) -> list[str]:
    """``"core/A imports unison.X (layer X, above A's layer Y)"`` for each import of a higher layer."""
    rank = {name: i for i, names in enumerate(layers) for name in names}

    def layer_of(module: str) -> str | None:
        parts = module.split(".")
        if parts[0] != "unison" or (len(parts) > 1 and parts[1] in ("strategies", "plugins", "conformance")):
            return None
        if len(parts) == 1:
            return "__init__.py"
        if (core / parts[1]).is_dir():
            return parts[1]
        if (core / f"{parts[1]}.py").is_file():
            return f"{parts[1]}.py"
        return "__init__.py"  # a name of the package itself (``from unison import Trainer``)

    out = []
    for path in sorted(core.rglob("*.py")):
        rel = path.relative_to(core)
        own = rel.parts[0] if len(rel.parts) > 1 else rel.name
        package = ".".join(["unison", *rel.parts[:-1], *([] if rel.stem == "__init__" else [rel.stem])])
        for name in sorted(imports_of(path, package)):
            other = layer_of(name)
            if other is None or other == own or name == package:
                continue
            if rank[other] > rank[own]:
                out.append(f"core/{rel.as_posix()} imports {name} (layer {other}, above {own})")
    return out


def test_the_readme_places_every_part_of_core_in_a_layer():
    listed = [name for names in readme_layers() for name in names]
    present = sorted(p.name for p in (ROOT / "core").iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file())
    assert sorted(listed) == present
    assert len(listed) == len(set(listed))


def test_no_module_of_core_imports_a_higher_layer_not_even_for_type_checking():
    assert layer_violations(ROOT / "core", readme_layers()) == []


def test_a_planted_upward_import_fails_the_layering_check(tmp_path):
    core = tmp_path / "core"
    shutil.copytree(ROOT / "core", core, ignore=shutil.ignore_patterns("__pycache__"))
    (core / "contract" / "_probe.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from unison.training.trainer import Trainer\n"
    )
    (core / "checkpointing" / "_probe.py").write_text("def f():\n    from unison.data import batch\n")
    assert layer_violations(core, readme_layers()) == [
        "core/checkpointing/_probe.py imports unison.data (layer data, above checkpointing)",
        "core/checkpointing/_probe.py imports unison.data.batch (layer data, above checkpointing)",
        "core/contract/_probe.py imports unison.training.trainer (layer training, above contract)",
        "core/contract/_probe.py imports unison.training.trainer.Trainer (layer training, above contract)",
    ]


# --------------------------------------------------------------------------- #
# Export lists: one kept by hand per package, the others generated or checked
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    ("package", "init"),
    [("unison", "core"), ("unison.contract", "core/contract"), ("unison.conformance", "conformance_tests")],
)
def test_a_package_s_exports_are_one_list(package, init):
    import importlib

    module = importlib.import_module(package)
    exports = {
        name: (where if where.startswith("unison.") else f"unison.{where}") for name, where in module._EXPORTS.items()
    }
    if package == "unison.contract":
        exports = {name: f"unison.contract.{where}" for name, where in module._EXPORTS.items()}
    assert module.__all__ == sorted(exports)
    # What type checkers see (the ``if TYPE_CHECKING:`` imports), where a package has them: the same names
    # from the same modules.
    tree = ast.parse((ROOT / init / "__init__.py").read_text())
    seen = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for child in ast.walk(node):
                if isinstance(child, ast.ImportFrom):
                    seen.update({alias.name: child.module for alias in child.names})
    if seen:
        assert seen == exports
    for name, where in exports.items():  # every name is where the list says
        assert getattr(module, name) is getattr(importlib.import_module(where), name), name


#: A module is about 400 lines at most; past this, its docstring says why it is one module ("... 400 lines").
MODULE_LINES = 440


def test_a_module_past_400_lines_says_why_in_its_docstring():
    long = []
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            source = path.read_text()
            if source.count("\n") <= MODULE_LINES:
                continue
            doc = ast.get_docstring(ast.parse(source)) or ""
            if "400 lines" not in " ".join(doc.split()):
                long.append(f"{path.relative_to(ROOT)} ({source.count(chr(10))} lines)")
    assert long == [], "split these modules, or say in their docstring why each is one (past 400 lines)"
