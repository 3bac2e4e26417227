"""Where each key of a config came from, and every problem in it reported at once.

A config is read into a plain dict plus a map from each key's path
(``("trainer", "max_steps")``, ``("callbacks", 0, "kwargs")``) to its place: ``FILE:LINE`` for a key in the
file, ``--set KEY=VALUE`` for a command-line override. Problems are collected
as :class:`Problem` entries and raised together as one :class:`ConfigErrors`,
each entry naming its place, its key and the fix, so a user fixes a file in one
pass instead of one error per run.

Line numbers come from a small scanner of the TOML text (tomllib keeps no
positions) and from YAML's own node marks.

Reading is bounded (:class:`Limits`): a config file is hand-written and small,
so a file larger than 1 MiB, nested deeper than 64 levels, whose YAML aliases
expand to more than 100,000 nodes (an "alias bomb": 1 KB expanding to 10^8
values) or refer to themselves, or whose YAML takes longer than 10 s to parse,
is refused with a :class:`~unison.errors.ConfigurationError` (exit code 2)
naming the file and the limit, before its content is built. YAML is parsed
event by event and every limit is counted as the events arrive, so a bomb is
refused after reading its first few lines' worth of expansion, never after
expanding it; the TOML text is checked for its size and its longest dotted key
before the TOML parser sees it (a dotted key of 100,000 parts costs that
parser memory quadratic in its length), and its nesting after.
"""

from __future__ import annotations

import re
import sys
import time
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


@dataclass(frozen=True)
class Limits:
    """What reading one config file may cost; every bound is far above any hand-written config."""

    max_bytes: int = 1 << 20
    """File size (1 MiB)."""
    max_depth: int = 64
    """Nesting of tables, lists and dotted keys (``a.b.c`` is 3 levels)."""
    max_nodes: int = 100_000
    """YAML: keys and values after alias expansion (a merge ``<<: *base`` counts the nodes it copies)."""
    max_parse_s: float = 10.0
    """YAML: seconds spent parsing."""


LIMITS = Limits()


def _too_much(path: Path, what: str, limit: str) -> ConfigurationError:
    return ConfigurationError(
        str(path),
        f"the config {what}, beyond unison's limit of {limit} for a config file",
        "write the config out plainly (a config is small: no alias bombs, no deep nesting)",
    )


def read_source(path: str | Path, limits: Limits = LIMITS) -> Source:
    """Parse a TOML or YAML config and locate its keys; syntax errors name the line.

    ``limits`` bounds the work (see the module docstring); a file beyond one
    is refused naming the limit.
    """
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = f.read(limits.max_bytes + 1)  # never more than the limit into memory
        text = data.decode()
    except OSError as exc:
        raise ConfigurationError(str(path), f"cannot read the config file ({exc.strerror})", "check the path") from None
    except UnicodeDecodeError as exc:
        raise ConfigurationError(str(path), f"the config is not UTF-8 text ({exc})", "save it as UTF-8") from None
    if len(data) > limits.max_bytes:
        raise _too_much(path, "file is larger than 1 MiB", f"{limits.max_bytes} bytes (max_bytes)")
    try:
        if path.suffix == ".toml":
            raw, lines = _load_toml(path, text, limits), toml_lines(text)
        else:
            raw, lines = _load_yaml(path, text, limits)
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
# Bounded parsing
# --------------------------------------------------------------------------- #
_SEGMENT = r"""(?:[A-Za-z0-9_-]+|"[^"\n]*"|'[^'\n]*')"""


def _dotted_chain(depth: int) -> re.Pattern[str]:
    """A dotted key of more than ``depth`` parts, starting at a token's start (so the search stays linear)."""
    return re.compile(rf"""(?<![A-Za-z0-9_"'-]){_SEGMENT}(?:[ \t]*\.[ \t]*{_SEGMENT}){{{depth}}}""")


def _load_toml(path: Path, text: str, limits: Limits) -> Any:
    # A key can only be dotted within one line; a chain of more parts than the depth limit anywhere in the
    # text (strings included: a false alarm needs 65 dot-joined words) is refused before tomllib sees it.
    if _dotted_chain(limits.max_depth).search(text):
        raise _too_much(path, f"has a dotted key of more than {limits.max_depth} parts", _depth(limits))
    try:
        raw = tomllib.loads(text)
    except RecursionError:  # nested inline tables or arrays: tomllib recurses per level
        raise _too_much(path, "nests its values too deeply", _depth(limits)) from None
    _check_depth(path, raw, limits)
    return raw


def _depth(limits: Limits) -> str:
    return f"{limits.max_depth} levels of nesting (max_depth)"


def _check_depth(path: Path, raw: Any, limits: Limits) -> None:
    """Refuse a parsed value nested deeper than the limit (iterative: no recursion of its own)."""
    stack = [(raw, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limits.max_depth:
            raise _too_much(path, f"nests its values more than {limits.max_depth} levels deep", _depth(limits))
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, depth + 1) for child in children)


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, counting depth, expanded nodes and time as the parser's events arrive.

    The composer builds nodes from these events one at a time, so a limit is
    enforced before the document grows past it. The size of each anchored
    node (in expanded nodes) is recorded when it ends; an alias then counts
    as that many nodes, without expanding anything. An alias to an anchor
    still open is a recursive document, refused too.
    """

    def __init__(self, text: str, path: Path, limits: Limits) -> None:
        super().__init__(text)
        self.config_path, self.limits = path, limits
        self.deadline = time.monotonic() + limits.max_parse_s
        self.nodes = 0
        self.open: list[tuple[str | None, int]] = []  # (anchor, nodes counted when it opened)
        self.sizes: dict[str, int] = {}

    def get_event(self) -> Any:
        event = super().get_event()
        path, limits = self.config_path, self.limits
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            self.nodes += 1
            self.open.append((event.anchor, self.nodes - 1))
            if len(self.open) > limits.max_depth:
                raise _too_much(path, f"nests its values more than {limits.max_depth} levels deep", _depth(limits))
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            anchor, start = self.open.pop()
            if anchor is not None:
                self.sizes[anchor] = self.nodes - start
        elif isinstance(event, yaml.ScalarEvent):
            self.nodes += 1
            if event.anchor is not None:
                self.sizes[event.anchor] = 1
        elif isinstance(event, yaml.AliasEvent):
            if event.anchor not in self.sizes and any(a == event.anchor for a, _ in self.open):
                raise ConfigurationError(
                    str(path),
                    f"the config refers to itself (YAML alias *{event.anchor} at line {event.start_mark.line + 1} "
                    "inside its own anchor)",
                    "write the value out; a config cannot contain itself",
                )
            self.nodes += self.sizes.get(event.anchor, 1)  # (an undefined alias: the composer names it)
        if self.nodes > limits.max_nodes:
            line = event.start_mark.line + 1 if event.start_mark is not None else 0
            raise _too_much(
                path,
                f"expands to more than {limits.max_nodes} values (YAML aliases, by line {line})",
                f"{limits.max_nodes} nodes after alias expansion (max_nodes)",
            )
        if time.monotonic() > self.deadline:
            raise _too_much(path, f"took longer than {limits.max_parse_s:.0f} s to parse", "max_parse_s")
        return event


def _load_yaml(path: Path, text: str, limits: Limits) -> tuple[Any, dict[Loc, int]]:
    """The value of a YAML text and the line of each key, parsed once under :class:`Limits`."""
    loader = _BoundedLoader(text, path, limits)
    try:
        node = loader.get_single_node()
        raw = loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()
    return raw, yaml_lines(node)


# --------------------------------------------------------------------------- #
# Line numbers
# --------------------------------------------------------------------------- #
# (each part matched once, no nested quantifier over the same characters: linear on any line)
_HEADER = re.compile(r"^\s*(\[\[?)([^\[\]]*)\]\]?\s*(#.*)?$")
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
        if header and header.group(2).strip():
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


def yaml_lines(node: Any) -> dict[Loc, int]:
    """The line of each key (and list item) in a composed YAML node tree (or a YAML text).

    Each node is walked once: an alias is the same node object as its anchor,
    so the keys under it keep the anchor's lines and are not expanded again
    (a key under an alias is placed at the alias's own key).
    """
    if isinstance(node, str):  # a text: parsed under the limits first
        return _load_yaml(Path("<text>"), node, LIMITS)[1]
    lines: dict[Loc, int] = {}
    seen: set[int] = set()
    stack: list[tuple[Any, Loc]] = [(node, ())]
    while stack:
        node, loc = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        children: list[tuple[Any, Loc]] = []
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                children.append((value, (*loc, str(key.value))))
                lines.setdefault(children[-1][1], key.start_mark.line + 1)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                children.append((item, (*loc, i)))
                lines.setdefault(children[-1][1], item.start_mark.line + 1)
        stack.extend(reversed(children))  # (in file order, as a recursive walk would)
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
