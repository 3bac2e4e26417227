"""Token-weighted losses at world 4: the composed strategies (2x2 meshes) and ddp over four replicas.

The same hand-written full-batch reference as ``test_token_loss.py``; one
4-rank world trains every case (long tier: 4 processes on 2 cores).
"""

from __future__ import annotations

import pytest
from test_token_loss import check

from unison.launch.torchrun import spawn

import token_loss_worlds as w

CASES_W4 = [
    ("ddp", "hf", 2, {}),
    ("hsdp", "pair", 2, {}),
    ("hsdp", "hf", 2, {}),
    ("fsdp_tp", "pair", 2, {}),
    ("fsdp_tp", "hf", 2, {}),
    ("pipeline_fsdp", "pair_loss_fn", 2, {}),
]


@pytest.fixture(scope="module")
def world4():
    return spawn(w.token_world, 4, CASES_W4, timeout=600)


@pytest.mark.parametrize("case", [f"{s}/{f}/{a}" for s, f, a, _ in CASES_W4])
def test_world_4_matches_the_full_batch_reference(world4, case):
    ref = w.reference(pipeline="pair_loss_fn" in case)
    check(world4[0][case], ref, case)
    assert all(rank[case]["losses"] == world4[0][case]["losses"] for rank in world4)
