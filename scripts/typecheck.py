"""Type-check unison with mypy, under the package names it is imported by.

Why a script: pyproject.toml maps the package ``unison`` onto ``core/`` (and
``unison.strategies``, ``unison.plugins``, ``unison.conformance`` onto their own
directories) with ``[tool.setuptools.package-dir]``. An editable install resolves that
mapping through an import hook, which mypy does not run, and mypy cannot rename a
directory to a package by configuration. So this script builds the installed layout as
a tree of symbolic links under ``build/mypy/`` (read from the same ``package-dir`` table,
so the two cannot drift apart), runs mypy there with the ``[tool.mypy]`` settings of
pyproject.toml, and prints each reported path as the file's path in this repository.

Usage: ``python scripts/typecheck.py [extra mypy arguments]``; the exit status is mypy's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "mypy"


def link_tree() -> dict[str, str]:
    """(Re)build ``build/mypy/unison`` from the package-dir table; returns link prefix -> repository prefix."""
    mapping: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(TREE, ignore_errors=True)
    top = TREE / "unison"
    top.mkdir(parents=True)
    # The top package's directory holds the subpackage links too, so it is a real directory whose
    # entries link into core/ one by one.
    for entry in (ROOT / mapping["unison"]).iterdir():
        if entry.name != "__pycache__":
            (top / entry.name).symlink_to(entry)
    back = {f"{top.relative_to(ROOT)}/": f"{mapping['unison']}/"}
    for package, directory in mapping.items():
        if package == "unison":
            continue
        link = TREE / Path(*package.split("."))
        link.symlink_to(ROOT / directory, target_is_directory=True)
        back[f"{link.relative_to(ROOT)}/"] = f"{directory}/"
    return back


def main(argv: list[str]) -> int:
    back = link_tree()
    # Longest link prefix first: build/mypy/unison/strategies/ before build/mypy/unison/.
    prefixes = sorted(back, key=len, reverse=True)
    env = {**os.environ, "MYPYPATH": str(TREE)}
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "-p", "unison", *argv]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, check=False)
    for line in proc.stdout.splitlines():
        line = line.removeprefix(f"{ROOT}/")
        for prefix in prefixes:
            if line.startswith(prefix):
                line = back[prefix] + line[len(prefix) :]
                break
        print(line)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
