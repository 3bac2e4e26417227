"""Global-batch-invariant sampling: the same samples per step for any world size."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from unison.data.plan import BatchPlan, validation_batches


@settings(max_examples=60, deadline=None)
@given(
    micro_per_rank=st.integers(1, 4),
    accumulate=st.integers(1, 4),
    dp=st.sampled_from([1, 2, 4]),
    extra=st.integers(0, 50),
    seed=st.integers(0, 5),
    step=st.integers(0, 30),
)
def test_ranks_partition_each_global_batch_in_order(micro_per_rank, accumulate, dp, extra, seed, step):
    g = micro_per_rank * accumulate * dp * 2
    n = g * 2 + extra
    plans = [BatchPlan(n, g, accumulate, dp, r, seed) for r in range(dp)]
    reference = BatchPlan(n, g, accumulate, 1, 0, seed)
    for m in range(accumulate):
        joined = [i for plan in plans for i in plan.local_micro_indices(step)[m]]
        assert joined == reference.local_micro_indices(step)[m]
    assert sorted(reference.global_indices(step)) == sorted(set(reference.global_indices(step)))


def test_epochs_reshuffle_and_cover_every_sample_once():
    plan = BatchPlan(40, 8, 2, 2, 0, seed=3)
    epoch0 = [i for s in range(5) for i in plan.global_indices(s)]
    epoch1 = [i for s in range(5, 10) for i in plan.global_indices(s)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(40))
    assert epoch0 != epoch1


@given(n=st.integers(1, 100), bs=st.integers(1, 9), dp=st.integers(1, 4))
def test_validation_counts_every_sample_once_with_equal_forward_counts(n, bs, dp):
    per_rank = [validation_batches(n, bs, dp, r) for r in range(dp)]
    assert len({len(b) for b in per_rank}) == 1
    counted = sorted(i for batches in per_rank for idx, w in batches if w for i in idx)
    assert counted == list(range(n))
    assert all(w == len(idx) or w == 0 for batches in per_rank for idx, w in batches)
