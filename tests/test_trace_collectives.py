"""How the suite's trace classifies the collectives the profiler saw: records built by hand, and one real
profile of a one-rank gloo world (no process is spawned).

The end-to-end counterpart is the conformance of fsdp_tp (tensor parallel's activation all-reduces in
every micro-step) and of the broken compositions (tests/test_conformance_broken_composed.py).
"""

from __future__ import annotations

from unison.conformance.profiling import MICRO_MARK, NO_SYNC_MARK, STEP_MARK, Record, analyse_collectives


def event(name: str, start: float, end: float) -> Record:
    return Record(name, start, end)


def test_collectives_inside_a_functional_collective_are_not_gradient_syncs():
    events = [
        event(STEP_MARK, 0, 100),
        # micro-step 1, under no_sync: tensor parallel's all-reduce of an activation (DTensor funcol)
        event(NO_SYNC_MARK, 0, 40),
        event("_c10d_functional::all_reduce", 10, 12),
        event("c10d::allreduce_", 10.5, 11.5),
        event("_c10d_functional::wait_tensor", 20, 30),  # a wait is no span of a collective
        event(MICRO_MARK, 30, 40),
        # micro-step 2: the same activation all-reduce, then FSDP2's gradient reduce-scatter (c10d directly)
        event("_c10d_functional::all_reduce", 50, 52),
        event("c10d::allreduce_", 50.5, 51.5),
        event("c10d::reduce_scatter_tensor_coalesced_", 80, 81),
        event("c10d::allreduce_", 85, 86),  # a gradient all-reduce outside any functional collective
        event(MICRO_MARK, 70, 90),
    ]
    out = analyse_collectives(events)
    assert out["total"] == {"functional:all_reduce": 2, "reduce_scatter": 1, "all_reduce": 1}
    assert out["gradient_sync_in_no_sync"] == 0
    assert out["gradient_sync_per_micro_step"] == [[0, 2]]
    assert out["gradient_sync_per_step"] == [2]


def test_records_read_a_real_profile_once_per_collective_with_its_payload(monkeypatch):
    """A real (one-rank gloo) profile: an all-reduce under a Python dispatch mode (the ``Throughput``
    callback's FLOP counter) is recorded twice by the profiler, and counted once; the backend's record gives
    the payload's dtype and size."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    from unison.conformance.profiling import records
    from unison.conformance.snapshots import payload
    from unison.launch.torchrun import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        x = torch.ones(4)
        with (
            profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof,
            torch.autograd.profiler.record_function(STEP_MARK),
        ):
            with FlopCounterMode(display=False):
                dist.all_reduce(x)
            dist.all_reduce(x)
    finally:
        dist.destroy_process_group()
    found = records(prof)
    calls = [r for r in found if r.name == "c10d::allreduce_"]
    assert [r.redispatched for r in calls] == [False, True, False]
    assert analyse_collectives(found)["total"] == {"all_reduce": 2}
    backend = [payload(r) for r in found if r.name == "gloo:all_reduce"]
    assert backend and set(backend) == {("float32", 4)}


FLIGHT_SCRIPT = """
import json, os, torch, torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from unison.conformance.profiling import (
    STEP_MARK, analyse_collectives, enable_flight_recorder, flight_entries, process_groups, records,
)
from unison.launch.torchrun import free_port

enable_flight_recorder()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
dist.init_process_group("gloo", rank=0, world_size=1)
subgroup = dist.new_group([0])
with profile(activities=[ProfilerActivity.CPU]) as prof:
    with torch.autograd.profiler.record_function(STEP_MARK):
        dist.all_reduce(torch.ones(4))
        dist.all_reduce(torch.ones(4), group=subgroup)
        dist.all_reduce(torch.ones(1))  # a loss, not a gradient: one element
    dist.all_reduce(torch.ones(4))  # outside forward/backward
found = records(prof, flight_entries())
print(json.dumps({
    "groups": analyse_collectives(found)["gradient_groups"],
    "named": process_groups(),
    "calls": [[r.group, r.numel] for r in found if r.name == "c10d::allreduce_"],
}))
dist.destroy_process_group()
"""


def test_the_flight_recorder_names_the_group_of_each_reduction():
    """A real (one-rank gloo) world in a process of its own (the recorder is read when the first process group
    starts): each ``c10d`` call carries the group and size of the flight recorder entry made inside it, and
    the gradient reductions in forward/backward are counted by group, named to their ranks."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TORCH_FR_BUFFER_SIZE"}
    done = subprocess.run(
        [sys.executable, "-c", FLIGHT_SCRIPT], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    default, sub = out["calls"][0][0], out["calls"][1][0]
    assert out["calls"] == [[default, 4], [sub, 4], [default, 1], [default, 4]] and default != sub
    assert out["groups"] == {default: 1, sub: 1}
    assert out["named"][default] == [0] and out["named"][sub] == [0]


def test_the_loop_marks_the_strategy_sync_points_in_a_profile(monkeypatch):
    """A real fit (ddp in a private one-rank gloo world, accumulation 3) under ``torch.profiler``: the
    loop's marks give the suite each micro-step's backward, the micro-steps inside ``no_sync()`` and the
    clip; DDP's reducer all-reduces its gradients only after the last micro-step's backward."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import unison
    from unison.conformance.profiling import CLIP_MARK, engine_boundaries, records
    from unison.training import marks

    from helpers import mlp, regression_data

    assert not marks.profiler_enabled()
    trainer = unison.Trainer(
        strategy="ddp",
        global_batch_size=12,
        accumulate_grad_batches=3,
        max_steps=2,
        grad_clip_norm=1.0,
        loggers=False,
        throughput=False,
        progress="off",
        stall_timeout_s=None,
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert marks.profiler_enabled()
        trainer.fit(
            lambda: mlp(),
            regression_data(48),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        )
    found = records(prof)
    names = [r.name for r in found]
    assert names.count(MICRO_MARK) == 6 and names.count(NO_SYNC_MARK) == 4 and names.count(CLIP_MARK) == 2
    assert engine_boundaries(found) == []  # the trainer owns accumulation: no engine answered
    collectives = analyse_collectives(found)
    # One gradient all-reduce per step (DDP's reducer, from C++), none inside the four no_sync() micro-steps.
    assert collectives["no_sync_entries"] == 4 and collectives["gradient_sync_in_no_sync"] == 0, collectives
    assert collectives["total"]["all_reduce"] == 2, collectives
