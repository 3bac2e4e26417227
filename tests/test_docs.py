"""The documentation is code: every shell and Python block in README.md and docs/*.md runs.

Each fenced block names its language. A ``bash`` or ``python`` block is run, in document order, by
one process per page in a temporary directory holding a copy of ``examples/`` (the relative paths
the pages use), with ``unison`` and ``python`` of this environment first on ``PATH``: Python blocks
share one namespace per page, as in a session; shell blocks run with ``bash -e -o pipefail``.
An HTML comment on the line before a block changes that:

* ``<!-- file: NAME -->``: the block is written to ``NAME`` in that directory (a script a later
  shell block runs, such as ``unison run --nproc 2 train.py``), not run itself;
* ``<!-- not-run: REASON -->``: the block cannot run on a test machine (two hosts, a bucket, an
  install); the reason is required and says where the same code is tested, if anywhere.

``toml`` blocks must parse. The pages' links are checked by ``mkdocs build --strict``, the
README's (files and anchors) here, and every ``pip install`` extra the docs name must exist.

``python tests/test_docs.py PAGE WORKDIR`` runs one page's blocks the way the test does.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
SHELL = {"bash", "sh", "shell"}
PYTHON = {"python", "py"}
#: Blocks run by another test, which parses them from the page itself (the section cannot carry a marker).
RUN_ELSEWHERE = {("README.md", "Quickstart"): "tests/test_quickstart.py"}

_FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[^\s`]*)[^\n`]*\n(?P<body>.*?)^(?P=indent)```[ ]*$", re.M | re.S)
_MARK = re.compile(r"^\s*<!--\s*(?P<kind>not-run|file):(?P<arg>.*?)-->\s*$")
_HEADING = re.compile(r"^(#{1,6}) (.+)$", re.M)


@dataclass
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    body: str
    section: str  # the nearest heading above
    mark: str | None = None  # "not-run" | "file"
    arg: str = ""


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def parse_blocks(text: str, page: str) -> list[Block]:
    blocks = []
    fences = list(_FENCE.finditer(text))
    headings = [
        (m.start(), m.group(2).strip())
        for m in _HEADING.finditer(text)
        if not any(f.start() < m.start() < f.end() for f in fences)  # a shell comment is no heading
    ]
    for m in fences:
        start = m.start()
        line = text.count("\n", 0, start) + 1
        before = text[:start].rstrip("\n").rsplit("\n", 1)[-1]
        section = next((h for pos, h in reversed(headings) if pos < start), "")
        block = Block(page, line, m.group("lang"), textwrap.dedent(m.group("body")), section)
        mark = _MARK.match(before)
        if mark:
            block.mark, block.arg = mark.group("kind"), mark.group("arg").strip()
        blocks.append(block)
    return blocks


def problems(blocks: list[Block]) -> list[str]:
    """What makes a page's blocks unfit: no language, a not-run without a reason, a file without a name."""
    out = []
    for b in blocks:
        where = f"{b.page}:{b.line}"
        if not b.lang:
            out.append(f"{where}: a block without a language (label it bash, python, toml, text...)")
        elif b.mark == "not-run" and len(b.arg.split()) < 4:
            out.append(f"{where}: `not-run` needs the reason it cannot run here, got {b.arg!r}")
        elif b.mark == "file" and not re.fullmatch(r"[\w.-]+(/[\w.-]+)*", b.arg):
            out.append(f"{where}: `file:` needs a relative file name, got {b.arg!r}")
        elif b.mark == "not-run" and b.lang not in SHELL | PYTHON:
            out.append(f"{where}: `not-run` on a {b.lang} block, which is never run")
    return out


def runnable(block: Block) -> bool:
    if (block.page, block.section) in RUN_ELSEWHERE:
        return False
    return block.mark != "not-run" and (block.mark == "file" or block.lang in SHELL | PYTHON)


def run_page(page: Path, workdir: Path) -> None:
    """Run one page's blocks in ``workdir``; exit non-zero naming the first block that fails."""
    rel = page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else str(page)
    os.chdir(workdir)
    sys.argv = [rel]
    namespace: dict = {"__name__": "__main__"}
    for b in parse_blocks(page.read_text(), rel):
        if not runnable(b):
            continue
        where = f"{rel}:{b.line}"
        print(f"--- {where} ({b.mark or b.lang})", flush=True)
        if b.mark == "file":
            target = workdir / b.arg
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(b.body)
        elif b.lang in PYTHON:
            exec(compile(b.body, where, "exec"), namespace)
        else:
            done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", b.body], cwd=workdir)
            if done.returncode != 0:
                sys.exit(f"{where}: the shell block exited {done.returncode}")


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #
def _env() -> dict[str, str]:
    bindir = str(Path(sys.executable).parent)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}


def _run(page: Path, workdir: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, __file__, str(page), str(workdir)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    shutil.copytree(ROOT / "examples", work / "examples", ignore=shutil.ignore_patterns("__pycache__", "runs"))
    return work


def _pages_to_run() -> list[str]:
    return [
        p.relative_to(ROOT).as_posix()
        for p in doc_pages()
        if any(runnable(b) and b.mark != "file" for b in parse_blocks(p.read_text(), p.name))
    ]


@pytest.mark.parametrize("page", _pages_to_run())
@pytest.mark.timeout(900)
def test_page_blocks_run_as_written(page, tmp_path):
    out = _run(ROOT / page, _workdir(tmp_path))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]


def test_every_block_is_run_or_says_why_not():
    blocks = [b for p in doc_pages() for b in parse_blocks(p.read_text(), p.relative_to(ROOT).as_posix())]
    assert not problems(blocks), "\n".join(problems(blocks))
    code = [b for b in blocks if b.lang in SHELL | PYTHON]
    assert code, "no shell or python block found: the parser is broken"
    elsewhere = [b for b in code if (b.page, b.section) in RUN_ELSEWHERE]
    for (page, section), test in RUN_ELSEWHERE.items():
        assert any(b.page == page and b.section == section for b in elsewhere), (page, section)
        assert Path(page).stem in (ROOT / test).read_text(), f"{test} no longer runs the blocks of {page} {section}"


def test_toml_blocks_parse():
    for page in doc_pages():
        for b in parse_blocks(page.read_text(), page.name):
            if b.lang == "toml":
                try:
                    tomllib.loads(b.body)
                except tomllib.TOMLDecodeError as exc:
                    pytest.fail(f"{page.name}:{b.line}: {exc}")


def test_a_broken_block_fails_and_is_named(tmp_path):
    """The runner can fail: a raising Python block, a failing shell block, an unmarked or unreasoned block."""
    work = _workdir(tmp_path)
    page = tmp_path / "broken.md"
    page.write_text("# Broken\n\n```python\nx = 1\n```\n\nText.\n\n```python\nassert x == 2, 'x is 1'\n```\n")
    out = _run(page, work, timeout=60)
    assert out.returncode != 0 and "broken.md:9" in out.stderr and "x is 1" in out.stderr, out.stderr
    page.write_text("# Broken\n\n<!-- file: s.sh -->\n```bash\nexit 3\n```\n\n```bash\nbash s.sh\n```\n")
    out = _run(page, work, timeout=60)
    assert out.returncode != 0 and "broken.md:8: the shell block exited 3" in out.stderr, out.stderr
    text = "```\nplain\n```\n\n<!-- not-run: GPU -->\n```bash\nnvidia-smi\n```\n"
    assert [p.split(": ", 1)[0] for p in problems(parse_blocks(text, "x.md"))] == ["x.md:1", "x.md:6"]


def _slug(heading: str) -> str:
    # Python-Markdown's toc slug (what mkdocs and GitHub agree on for these headings).
    text = re.sub(r"[^\w\s-]", "", re.sub(r"`", "", heading)).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_readme_links_resolve():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert targets
    for target in targets:
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else ROOT / "README.md"
        assert file.exists(), f"README.md links to {target}, which does not exist"
        if anchor:
            slugs = {_slug(h) for _, h in re.findall(r"^(#{1,6}) (.+)$", file.read_text(), re.M)}
            assert anchor in slugs, f"README.md links to {target}: no heading has the anchor #{anchor}"


def test_install_extras_exist():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = []
    for page in [*doc_pages(), ROOT / "examples" / "hf_causal_lm.py"]:
        text = page.read_text()
        assert "unison[" not in text, f"{page.name}: unison is installed from a clone (pip install -e '.[...]')"
        named += [e.strip() for group in re.findall(r"\.\[([\w,-]+)\]", text) for e in group.split(",")]
    assert named and set(named) <= extras, set(named) - extras


@pytest.mark.timeout(300)
def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the dev extra installs mkdocs: pip install -e '.[dev]'")
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert (tmp_path / "index.html").exists()


if __name__ == "__main__":
    run_page(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve())
