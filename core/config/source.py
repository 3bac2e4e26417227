"""Where each key of a config came from, and every problem in it reported at once.

A config is read into a plain dict plus a map from each key's path
(``("trainer", "max_steps")``, ``("callbacks", 0, "kwargs")``) to its place: ``FILE:LINE`` for a key in the
file, ``--set KEY=VALUE`` for a command-line override. Problems are collected
as :class:`Problem` entries and raised together as one :class:`ConfigErrors`,
each entry naming its place, its key and the fix, so a user fixes a file in one
pass instead of one error per run.

Line numbers come from a small scanner of the TOML text (tomllib keeps no
positions) and from YAML's own node marks.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI (a dependency there)
    import tomli as tomllib

from unison.errors import ConfigurationError

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class Problem:
    """One mistake in a config: its key path, what is wrong, and how to fix it."""

    loc: Loc
    problem: str
    fix: str


class ConfigErrors(ConfigurationError):
    """Every problem found in one config, each with its place (``FILE:LINE`` or the ``--set`` override).

    ``problems`` holds ``(place, key, problem, fix)`` tuples in file order.
    """

    def __init__(self, path: str, problems: list[tuple[str, str, str, str]]) -> None:
        self.problems = problems
        first = problems[0]
        super().__init__(f"config key {first[1]} in {path}", first[2], first[3])
        count = f"{len(problems)} problems" if len(problems) > 1 else "1 problem"
        lines = [f"{path}: {count} in the config"]
        lines += [f"  {place}: config key {key}: {problem}. Fix: {fix}" for place, key, problem, fix in problems]
        self.args = ("\n".join(lines),)

    def __str__(self) -> str:
        return self.args[0]


def dotted(loc: Loc) -> str:
    """``("callbacks", 0, "kwargs")`` -> ``"callbacks.0.kwargs"``."""
    return ".".join(str(p) for p in loc) or "(top level)"


@dataclass
class Source:
    """A config's raw values and where each key was given."""

    path: Path
    raw: dict[str, Any]
    places: dict[Loc, str] = field(default_factory=dict)

    def place(self, loc: Loc) -> str:
        """The place of the longest prefix of ``loc`` that was given (``FILE:LINE`` or ``--set ...``)."""
        for n in range(len(loc), 0, -1):
            if loc[:n] in self.places:
                return self.places[loc[:n]]
        return str(self.path)

    def raise_if(self, problems: Iterable[Problem]) -> None:
        """Raise one :class:`ConfigErrors` for ``problems``, sorted by place, when there are any."""
        found = [(self.place(p.loc), dotted(p.loc), p.problem, p.fix) for p in problems]
        if found:
            found.sort(key=lambda f: _order(f[0]))
            raise ConfigErrors(str(self.path), found)


def _order(place: str) -> tuple[int, int]:
    """File lines first, in line order, then overrides."""
    line = place.rpartition(":")[2]
    return (0, int(line)) if line.isdigit() else (1, 0)


def read_source(path: str | Path) -> Source:
    """Parse a TOML or YAML config and locate its keys; syntax errors name the line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigurationError(str(path), f"cannot read the config file ({exc.strerror})", "check the path") from None
    try:
        if path.suffix == ".toml":
            raw, lines = tomllib.loads(text), toml_lines(text)
        else:
            raw, lines = yaml.safe_load(text), yaml_lines(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib's message ends with "(at line L, column C)".
        raise ConfigurationError(str(path), f"TOML syntax error: {exc}", "fix the file at that line") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigurationError(
            str(path), f"YAML syntax error{where}: {getattr(exc, 'problem', exc)}", "fix the file at that line"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigurationError(
            str(path), "the config is not a table of sections", "see docs/config.md for the layout"
        )
    return Source(path, raw, {loc: f"{path}:{line}" for loc, line in lines.items()})


# --------------------------------------------------------------------------- #
# Line numbers
# --------------------------------------------------------------------------- #
_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\[\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"""^\s*((?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*'))*)\s*=""")
_INLINE_KEY = re.compile(r"[{,]\s*([A-Za-z0-9_-]+|\"[^\"]*\")\s*=")


def _split_key(key: str) -> tuple[str, ...]:
    parts = re.findall(r"""[A-Za-z0-9_-]+|"[^"]*"|'[^']*'""", key)
    return tuple(p.strip("\"'") for p in parts)


def toml_lines(text: str) -> dict[Loc, int]:
    """The line of each table header and key in a TOML text (arrays of tables indexed like the parsed value)."""
    lines: dict[Loc, int] = {}
    table: Loc = ()
    counts: dict[Loc, int] = {}  # array-of-tables path -> index of its last element
    in_string = False
    for number, line in enumerate(text.splitlines(), 1):
        quotes = line.count('"""') + line.count("'''")
        if in_string:
            in_string = quotes % 2 == 0
            continue
        if quotes % 2:  # a multi-line string starts here
            in_string = True
        header = _HEADER.match(line)
        if header:
            parts, is_array, table = _split_key(header.group(2)), header.group(1) == "[[", ()
            for i, part in enumerate(parts):
                table += (part,)
                if table in counts and not (is_array and i == len(parts) - 1):
                    table += (counts[table],)  # a sub-table of the array's last element
            if is_array:
                counts[table] = counts.get(table, -1) + 1
                table += (counts[table],)
            lines.setdefault(table, number)
            continue
        key = _KEY.match(line)
        if key:
            loc = table + _split_key(key.group(1))
            lines.setdefault(loc, number)
            rest = line[key.end() :]
            for inner in _INLINE_KEY.finditer(rest):
                lines.setdefault((*loc, inner.group(1).strip('"')), number)
    return lines


def yaml_lines(text: str) -> dict[Loc, int]:
    """The line of each key (and list item) in a YAML text, from the composed node tree."""
    lines: dict[Loc, int] = {}

    def walk(node: Any, loc: Loc) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                sub = (*loc, str(key.value))
                lines.setdefault(sub, key.start_mark.line + 1)
                walk(value, sub)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines.setdefault((*loc, i), item.start_mark.line + 1)
                walk(item, (*loc, i))

    walk(yaml.compose(text), ())
    return lines


# --------------------------------------------------------------------------- #
# Command-line overrides
# --------------------------------------------------------------------------- #
def parse_value(text: str) -> Any:
    """An override's value: a TOML value (``3e-4``, ``true``, ``[1, 2]``, ``{ a = 1 }``, ``"x"``), else the text."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(source: Source, overrides: Sequence[str]) -> None:
    """Apply ``KEY=VALUE`` overrides (dotted keys, list indices as numbers) to ``source`` in order.

    Each overridden key's place becomes ``--set KEY=VALUE``, so a validation
    error names the override rather than the file line it replaced.
    """
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = [p.strip() for p in key.split(".")]
        if not sep or not all(parts):
            raise ConfigurationError(
                f"--set {item}", "an override is KEY=VALUE with a dotted key", "write e.g. --set optimizer.lr=3e-4"
            )
        loc: Loc = tuple(int(p) if p.isdigit() else p for p in parts)
        node: Any = source.raw
        for i, part in enumerate(loc[:-1]):
            if isinstance(part, int):
                if not isinstance(node, list) or part >= len(node):
                    size = len(node) if isinstance(node, list) else 0
                    raise ConfigurationError(
                        f"--set {item}",
                        f"{dotted(loc[: i + 1])} does not exist ({dotted(loc[:i])} has {size} entries)",
                        "override an existing entry",
                    )
                node = node[part]
            else:
                if not isinstance(node, dict):
                    raise ConfigurationError(f"--set {item}", f"{dotted(loc[:i])} is not a table", "check the key")
                node = node.setdefault(part, {})
        if not isinstance(node, dict | list) or (isinstance(node, list) and not isinstance(loc[-1], int)):
            raise ConfigurationError(f"--set {item}", f"{dotted(loc[:-1])} is not a table", "check the key")
        last = loc[-1]
        if isinstance(node, list):
            if not isinstance(last, int) or last >= len(node):
                raise ConfigurationError(f"--set {item}", f"{dotted(loc)} does not exist", "override an existing entry")
            node[last] = parse_value(text)
        else:
            node[last] = parse_value(text)
        for old in [p for p in source.places if p[: len(loc)] == loc]:
            del source.places[old]
        source.places[loc] = f"--set {item}"
