"""Reading a config is bounded: alias bombs, deep nesting, huge files and dotted-key bombs are refused fast.

Before, a 744-byte YAML alias bomb (10^7 values) as ``trainer.max_steps`` kept
``unison train`` busy past 180 s, and 800 bytes (10^8) ended in a MemoryError
of the line-number walker after 50 s. Each limit of
:class:`unison.config.source.Limits` is refused with exit code 2 and a message
naming the file and the limit, in well under a second of parsing. The tests bound
the CPU time of this process (``time.process_time``), not the wall clock, at
2 s: far below the minutes of the unbounded reads, and blind to a busy machine
descheduling the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unison.cli import main
from unison.config.source import LIMITS, read_source
from unison.errors import ConfigurationError

HERE = Path(__file__).resolve().parent

TAIL = """model:
  factory: storage_job.py:model
data:
  factory: storage_job.py:datasets
loss:
  factory: storage_job.py:loss
"""


def alias_bomb(levels: int = 8) -> str:
    """``trainer.max_steps`` whose value expands to 10^levels integers."""
    lines = ["trainer:", "  global_batch_size: 8", "  max_steps:", "    l0: &a0 [1,1,1,1,1,1,1,1,1,1]"]
    lines += [f"    l{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n" + TAIL


CPU_BOUND_S = 2.0
"""CPU seconds one bounded read may take; the unbounded reads took 50-180 s."""


def _refused(path: Path, match: str) -> float:
    """CPU seconds ``read_source`` took to refuse ``path`` with a ConfigurationError matching ``match``."""
    start = time.process_time()
    with pytest.raises(ConfigurationError, match=match) as refused:
        read_source(path)
    assert str(path) in str(refused.value)
    return time.process_time() - start


def test_an_alias_bomb_is_refused_at_once_by_unison_train_with_exit_2(tmp_path):
    config = tmp_path / "bomb.yaml"
    config.write_text(alias_bomb())
    assert len(config.read_bytes()) < 1024
    assert _refused(config, r"expands to more than 100000 values .*max_nodes") < CPU_BOUND_S
    (tmp_path / "storage_job.py").write_text((HERE / "storage_job.py").read_text())
    out = subprocess.run(
        [sys.executable, "-m", "unison.cli", "train", str(config)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    text = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 2, text
    assert "bomb.yaml: the config expands to more than 100000 values" in text and "Traceback" not in text, text


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("deep.yaml", "trainer: " + "[" * 100_000, r"nests its values more than 64 levels deep"),
        ("deep-block.yaml", "".join(f"{'  ' * i}k{i}:\n" for i in range(70)), r"more than 64 levels deep"),
        ("self.yaml", "trainer: &t\n  max_steps: [*t]\n", r"refers to itself \(YAML alias \*t at line 2"),
        ("deep.toml", "a = " + "[" * 100_000, r"nests its values too deeply"),
        ("deep-tables.toml", "a = " + "{ b = " * 70 + "1" + " }" * 70, r"more than 64 levels deep"),
        ("dotted.toml", "a" + ".a" * 100_000 + " = 1\n", r"dotted key of more than 64 parts"),
        ("huge.toml", "# x\n" * 300_000, r"larger than 1 MiB.*1048576 bytes \(max_bytes\)"),
    ],
)
def test_each_limit_is_refused_fast_naming_it(tmp_path, name, text, match):
    config = tmp_path / name
    config.write_text(text)
    assert _refused(config, match) < CPU_BOUND_S


def test_configs_within_the_limits_load_with_their_lines(tmp_path):
    # Anchors and merge keys stay usable; keys keep their lines (a merged key: the line it was written on).
    config = tmp_path / "ok.yaml"
    config.write_text("base: &b\n  max_steps: 3\ntrainer:\n  <<: *b\n  global_batch_size: [1, 2]\n")
    source = read_source(config)
    assert source.raw["trainer"] == {"max_steps": 3, "global_batch_size": [1, 2]}
    assert source.place(("trainer", "global_batch_size", 1)) == f"{config}:5"
    assert source.place(("trainer", "max_steps")) == f"{config}:2"
    # The TOML line scanner is linear on any line (a 1 MiB header-like line inside a string included).
    line = "[" + " " * (LIMITS.max_bytes - 100) + "x"
    config = tmp_path / "long.toml"
    config.write_text(f'a = """\n\'\'\'\n{line}\n"""\n[trainer]\nmax_steps = 1\n')
    start = time.process_time()
    assert read_source(config).raw["trainer"] == {"max_steps": 1}
    assert time.process_time() - start < CPU_BOUND_S


def test_a_bigger_bomb_is_refused_by_the_cli_in_this_process(tmp_path, capsys):
    # The same refusal through the CLI in this process: one message, exit 2, nothing built.
    config = tmp_path / "bomb.yaml"
    config.write_text(alias_bomb(levels=9))
    with pytest.raises(SystemExit) as exited:
        main(["train", str(config)])
    out = "".join(capsys.readouterr().out.split())
    assert exited.value.code == 2 and "max_nodes" in out, out
