"""A stop wished for on one rank stops every rank after the same step, on every backend family (2 gloo ranks).

In a world the ranks agree without blocking: the flags all-reduced after step
k are read after step k+1, so a ``should_stop`` or a signal during step 2
stops every rank after step 3 (``global_step`` 4); a step that saves a
checkpoint agrees at once, so a signal during step 3, which saves, stops there;
a signal during the last step is agreed at the end of the fit
(:mod:`unison.training.stopping`). ddp, fsdp and zero2 carry the flags in the
step's loss all-reduce, and the pipeline in the one sum over the world that
brings its last stage's losses to every rank; a pipeline written for plugin API
2.3 (``pipeline_broadcast``, :class:`fail_worlds.BroadcastPipeline`: losses
broadcast, not reported) keeps an all-reduce of their own: both paths run here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from unison.checkpointing.checkpointer import Checkpointer
from unison.checkpointing.manifest import verify
from unison.checkpointing.storage import LocalStorage
from unison.launch.torchrun import spawn

from fail_worlds import stop_world

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

FAMILIES = ("ddp", "fsdp", "zero2", "pipeline", "pipeline_broadcast")


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return spawn(stop_world, 2, FAMILIES, timeout=500)


@pytest.mark.parametrize("strategy", FAMILIES)
def test_should_stop_on_one_rank_stops_every_rank_one_step_later(world, strategy):
    runs = [rank[strategy]["should_stop"] for rank in world]
    for run in runs:
        assert run["preempted"] is None
        assert run["global_step"] == 4 and run["steps"] == [0, 1, 2, 3], run
    # the end of fit saved the step every rank stopped at, once
    assert runs[0]["checkpoints"] == ["step-00000004"]


@pytest.mark.parametrize("strategy", FAMILIES)
def test_a_signal_to_one_rank_preempts_every_rank_after_the_same_step_with_one_checkpoint(world, strategy):
    runs = [rank[strategy]["signal"] for rank in world]
    for run in runs:
        # every rank names the signal, the one that received it and the one that heard of it
        assert run["preempted"] is not None and run["preempted"]["signal"] == "SIGUSR1", run
        assert run["preempted"]["step"] == run["global_step"] == 4 and run["steps"] == [0, 1, 2, 3]
        assert run["preempted"]["checkpoint"] == str(Path(run["root"]) / "step-00000004")
    assert runs[0]["checkpoints"] == ["step-00000004"]
    latest = Checkpointer(Path(runs[0]["root"])).latest()
    assert latest is not None and verify(LocalStorage(), latest).step == 4  # committed: every rank's part


@pytest.mark.parametrize("strategy", FAMILIES)
def test_a_signal_during_a_saving_step_stops_there_without_a_second_checkpoint(world, strategy):
    runs = [rank[strategy]["signal_at_save"] for rank in world]
    for run in runs:
        assert run["preempted"] is not None and run["preempted"]["signal"] == "SIGUSR1", run
        assert run["preempted"]["step"] == run["global_step"] == 4
    assert runs[0]["checkpoints"] == ["step-00000002", "step-00000004"]


@pytest.mark.parametrize("strategy", FAMILIES)
def test_a_signal_in_the_last_step_preempts_every_rank_at_the_end_of_the_fit(world, strategy):
    """No step follows the last boundary to carry or wait for its flags: the end of the fit agrees on them."""
    runs = [rank[strategy]["signal_in_last_step"] for rank in world]
    for run in runs:
        assert run["preempted"] is not None and run["preempted"]["signal"] == "SIGUSR1", run
        assert run["preempted"]["step"] == run["global_step"] == 10 and run["steps"] == list(range(10))
    assert runs[0]["checkpoints"][-1] == "step-00000010"
    latest = Checkpointer(Path(runs[0]["root"])).latest()
    assert latest is not None and verify(LocalStorage(), latest).step == 10


@pytest.mark.parametrize("strategy", FAMILIES)
def test_the_flags_ride_the_loss_all_reduce_where_it_spans_the_world_on_the_cpu(world, strategy):
    """ddp, fsdp and zero2 reduce the loss over the whole world, and so does the pipeline, whose last stage
    reports its losses (API 2.4): no collective of the agreement's own per step. A pipeline that reports
    nothing has replicas that are not the world (one replica of two stages): it keeps the agreement's
    all-reduce. Both paths stop every rank alike (the tests above)."""
    for rank in world:
        for scenario in rank[strategy].values():
            assert scenario["carried"] is (strategy != "pipeline_broadcast"), (strategy, scenario)


def test_a_pipeline_that_reports_its_losses_logs_what_one_that_broadcasts_them_logs(world):
    """The last stage's losses reach the other stage in the trainer's sum over the world (zeros added) instead
    of a broadcast: every rank logs the same micro-batch losses, bit for bit, and trains the same grad norms."""
    for scenario in ("should_stop", "signal", "signal_at_save", "signal_in_last_step"):
        reported = [rank["pipeline"][scenario] for rank in world]
        broadcast = [rank["pipeline_broadcast"][scenario] for rank in world]
        assert reported[0]["losses"] and all(len(losses) == 2 for losses in reported[0]["losses"])
        for run in reported + broadcast:
            assert run["losses"] == reported[0]["losses"], scenario
            assert run["grad_norms"] == reported[0]["grad_norms"], scenario
