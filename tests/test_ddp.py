"""ddp against the single-process reference, on a real 2-rank gloo world."""

from __future__ import annotations

import math

import pytest

from unison.launch.torchrun import spawn

from ddp_worlds import ddp_scenarios
from helpers import max_abs_diff, regression_data, train

pytestmark = pytest.mark.distributed

# Documented in README ("Numerics"): measured deviations are far below these.
FP32_TOL = 1e-5
BF16_TOL = 2e-3
FP16_TOL = 1e-3


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return spawn(ddp_scenarios, 2, timeout=240)


@pytest.fixture(scope="module")
def reference(single_runs) -> dict:
    return {
        "fp32": train("single", val=regression_data(n=51, seed=7), val_every_n_steps=10),
        **{name: single_runs(name) for name in ("bf16-mixed", "16-mixed", "overflow")},
    }


def test_fp32_matches_reference_with_accumulation_and_clipping(world, reference):
    ref = reference["fp32"]
    assert max(h["grad_norm"] for h in ref["history"]) > 0.5, "clipping must actually clip"
    for rank in world:
        assert max_abs_diff(rank["fp32"]["state"], ref["state"]) <= FP32_TOL
        assert rank["fp32"]["optimizer_steps"] == ref["optimizer_steps"] == 20
        assert rank["fp32"]["scheduler_steps"] == ref["scheduler_steps"] == 20
        for a, b in zip(rank["fp32"]["history"], ref["history"]):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
            assert a["lr"] == b["lr"]


def test_validation_loss_equals_reference(world, reference):
    ref = reference["fp32"]["validation"]
    assert len(ref) == 2  # at step 10 and at the end
    for rank in world:
        assert rank["fp32"]["validation"] == pytest.approx(ref, rel=1e-5)


def test_hook_sequence_identical_to_single(world, reference):
    ref = reference["fp32"]
    for rank in world:
        assert rank["fp32"]["hooks"] == ref["hooks"]
        assert rank["fp32"]["monitored"] == ref["monitored"]
    # exactly one before-optimizer-step hook per optimizer step
    assert [c for c, _ in ref["hooks"]].count("before_optimizer_step") == 20


@pytest.mark.parametrize("precision,tol", [("bf16-mixed", BF16_TOL), ("16-mixed", FP16_TOL)])
def test_mixed_precision_within_documented_tolerance(world, reference, precision, tol):
    deviation = max_abs_diff(world[0][precision]["state"], reference[precision]["state"])
    assert deviation <= tol
    # and mixed precision is really applied: it differs from fp32
    assert max_abs_diff(reference[precision]["state"], reference["fp32"]["state"]) > 0


def test_fp16_overflow_skips_step_and_scheduler_on_both_backends(world, reference):
    for run in (reference["overflow"], world[0]["overflow"], world[1]["overflow"]):
        skipped = [h["skipped"] for h in run["history"]]
        assert any(skipped), "the huge sample must overflow fp16"
        assert all(math.isinf(h["grad_norm"]) or math.isnan(h["grad_norm"]) for h in run["history"] if h["skipped"])
        assert run["optimizer_steps"] == run["scheduler_steps"] == 8 - sum(skipped)
        assert ("after_optimizer_step", (skipped.index(True), True)) in run["hooks"]
    assert [h["skipped"] for h in reference["overflow"]["history"]] == [
        h["skipped"] for h in world[0]["overflow"]["history"]
    ]
    assert max_abs_diff(world[0]["overflow"]["state"], reference["overflow"]["state"]) <= FP16_TOL


def test_resume_is_bitwise_equal_to_uninterrupted(world):
    for rank in world:
        assert max_abs_diff(rank["resumed"]["state"], rank["fp32"]["state"]) == 0.0
        assert rank["resumed"]["history"] == rank["fp32"]["history"][10:]
        assert rank["resumed"]["optimizer_steps"] == 20 and rank["resumed"]["scheduler_steps"] == 20


def test_ddp_checkpoint_resumes_under_single(world, reference):
    resumed = train(
        "single",
        max_steps=20,
        checkpoint_dir=world[0]["ckpt_dir"] + "-single",
        ckpt_path=world[0]["ckpt_dir"] + "/step-00000010",
    )
    assert max_abs_diff(resumed["state"], world[0]["resumed"]["state"]) <= FP32_TOL


def test_gradient_sync_skipped_on_non_boundary_micro_steps(world):
    counts = world[0]["allreduce_counts"]
    steps = 3
    # accumulation 4 runs 4x the backward passes but the same number of
    # all-reduces as accumulation 1 (the reducer's bucket, the trainer's loss
    # reduction): no_sync() really skipped 3 of 4.
    assert counts[4] == counts[1]
    # The tiny model is one DDP bucket: per step 1 gradient all-reduce and 1 loss
    # reduction, which carries the stop flags on the CPU; the last boundary's
    # flags are agreed once after the loop. A no_sync that defers nothing adds
    # the bucket all-reduce of the 3 non-boundary micro-steps.
    assert counts[1] == 2 * steps + 1
    assert counts["broken"] == counts[4] + 3 * steps
