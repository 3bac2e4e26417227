"""Batches of any structure and iterable data under ddp (world 2 and 4) and fsdp, against single."""

from __future__ import annotations

import pytest

from unison.launch.torchrun import spawn

from data_worlds import EPOCHS, RESUME_AT, data_runs, rank0_init_reference, world_runs
from helpers import max_abs_diff

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

FP32_TOL = 1e-5


@pytest.fixture(scope="module")
def reference() -> dict:
    return data_runs("single")


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return spawn(world_runs, 2, ("ddp", "fsdp"), (0, 2), ("ddp", "fsdp", "zero2", "pipeline"), timeout=500)


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    return spawn(world_runs, 4, ("ddp",), (0,), ("ddp",), timeout=500)


def _check(runs: dict, reference: dict, keys: list[str]) -> None:
    for key in keys:
        run, ref = runs[key], reference[key]
        assert max_abs_diff(run["state"], ref["state"]) <= FP32_TOL, key
        assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5), key
        assert run["steps"] == ref["steps"] and run["epochs"] == ref["epochs"], key


def test_reference_premises(reference):
    # Map-style: 96 samples / 16 = 6 steps per epoch; the stream too. Resume continues mid-epoch.
    assert reference["map-0"]["global_step"] == reference["iterable-0"]["global_step"] == 12
    assert reference["map-0"]["epochs"] == [("start", 0), ("end", 0), ("start", 1), ("end", 1)]
    assert reference["iterable-2"]["epochs"] == [("start", 0), ("end", 0), ("start", 1), ("end", 1)]
    assert reference["map-0-resumed"]["steps"] == list(range(RESUME_AT, 12))
    # 0 and 2 loader workers: the same samples, bitwise.
    for kind in ("map", "iterable"):
        assert max_abs_diff(reference[f"{kind}-0"]["state"], reference[f"{kind}-2"]["state"]) == 0.0
        assert reference[f"{kind}-0"]["losses"] == reference[f"{kind}-2"]["losses"]
        # save at RESUME_AT -> resume equals the uninterrupted run, bitwise in one process
        resumed, full = reference[f"{kind}-2-resumed"], reference[f"{kind}-2"]
        assert max_abs_diff(resumed["state"], full["state"]) == 0.0
        assert resumed["losses"] == full["losses"][RESUME_AT:]
    assert EPOCHS == 2


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_nested_and_iterable_batches_match_single_at_world_2(world2, reference, strategy):
    for rank in world2:
        _check(rank[strategy], reference, ["map-0", "map-2", "iterable-0", "iterable-2"])
        # resumed mid-epoch / mid-stream: equal to the uninterrupted run
        for key in ("map-0", "map-2", "iterable-0", "iterable-2"):
            resumed, full = rank[strategy][f"{key}-resumed"], rank[strategy][key]
            assert max_abs_diff(resumed["state"], full["state"]) <= FP32_TOL, key
            assert resumed["losses"] == pytest.approx(full["losses"][RESUME_AT:], rel=1e-5), key
            assert resumed["steps"] == list(range(RESUME_AT, 12)), key


def test_nested_and_iterable_batches_match_single_at_world_4(world4, reference):
    for rank in world4:
        _check(rank["ddp"], reference, ["map-0", "iterable-0"])
        for key in ("map-0", "iterable-0"):
            assert max_abs_diff(rank["ddp"][f"{key}-resumed"]["state"], reference[key]["state"]) <= FP32_TOL


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2", "pipeline"])
def test_replicas_built_apart_train_from_rank_0s_weights(world2, strategy):
    # Every rank built different weights and buffers; ddp's constructor (declared strategy-owned) and the
    # trainer's broadcast (the default, for the others) make every replica start from rank 0's.
    expected = rank0_init_reference()
    for rank in world2:
        assert max_abs_diff(rank["desync"][strategy], expected) <= FP32_TOL
