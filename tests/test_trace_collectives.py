"""How the suite's trace classifies the collectives the profiler saw (events built by hand; no process runs).

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
