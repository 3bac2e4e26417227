"""``unison.launch.torchrun.spawn``: worlds forked from a fork server, each as if its ranks had just started.

The ranks are forked from a server that imported torch once; what they must still get is what a fresh
interpreter started at the call would have: the caller's environment of that moment, nothing left by an
earlier world, and a failing or hanging rank reported with the whole world killed.
"""

from __future__ import annotations

import os

import pytest

from unison.launch.torchrun import WorldError, spawn

import spawn_worlds as w

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(120)
def test_each_world_takes_the_callers_environment_of_that_call(monkeypatch):
    name = "UNISON_TEST_SPAWN_MARK"
    monkeypatch.setenv(name, "first")
    assert spawn(w.environment, 2, name) == [(0, "first"), (1, "first")]
    # The fork server is running now (started by the world above, with "first" in its environment).
    monkeypatch.setenv(name, "second")
    assert spawn(w.environment, 2, name) == [(0, "second"), (1, "second")]
    monkeypatch.delenv(name)
    assert spawn(w.environment, 2, name) == [(0, None), (1, None)]


@pytest.mark.timeout(120)
def test_a_world_sees_nothing_an_earlier_world_did():
    assert spawn(w.remember, 2, "set by the first world") == [None, None]
    assert spawn(w.recall, 2) == [None, None]


@pytest.mark.timeout(120)
def test_a_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(WorldError, match="rank 1 failed") as info:
        spawn(w.fail_on_rank_1, 2)
    assert "ValueError: rank 1 fails on cue" in str(info.value)


@pytest.mark.timeout(120)
def test_a_world_past_its_timeout_is_killed(tmp_path):
    with pytest.raises(WorldError, match="timed out"):
        spawn(w.hang_on_rank_1, 2, str(tmp_path), timeout=5)
    pids = [int((tmp_path / f"rank-{r}").read_text()) for r in range(2)]
    for pid in pids:  # killed and reaped: no such process any more
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
