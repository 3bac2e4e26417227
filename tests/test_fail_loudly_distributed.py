"""Decisions one rank makes stop every rank at the same step (2 gloo ranks, ddp and fsdp)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_fail_loudly import _all_finite

from unison.checkpointing.checkpointer import Checkpointer
from unison.launch.torchrun import spawn

from fail_worlds import fail_world

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return spawn(fail_world, 2, ("ddp", "fsdp"), timeout=500)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_nan_on_one_rank_stops_every_rank_at_that_step(world, strategy):
    runs = [rank[strategy]["nan"] for rank in world]
    for run in runs:
        assert run["error"] is not None and run["error"].startswith(
            "step 2: the loss was non-finite first at micro-batch 0 on rank 1"
        )
        # Read one step late (no host sync per step): step 2's update ran in memory and is counted; the
        # error came before its checkpoint.
        assert run["global_step"] == 3 and run["optimizer_steps"] == 3
    latest = Checkpointer(Path(runs[0]["root"])).latest()
    assert latest is not None and latest.name.endswith("00000002")
    assert all(_all_finite(p) for p in Path(runs[0]["root"]).glob("step-*"))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_should_stop_on_one_rank_stops_all_ranks_after_the_same_step(world, strategy):
    runs = [rank[strategy]["stop"] for rank in world]
    assert [run["global_step"] for run in runs] == [4, 4]
    # the step-4 checkpoint (every 2 steps) is the last one and is not written twice
    assert runs[0]["latest"].endswith("step-00000004")
    assert sorted(p.name for p in Path(runs[0]["root"]).glob("step-*")) == ["step-00000002", "step-00000004"]
