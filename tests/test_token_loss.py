"""Token-weighted losses: any strategy, world size and accumulation split trains the same weights.

The reference is the hand-written full-batch loop of ``token_loss_worlds``
(summed token loss over the step's valid tokens). The effect a split would
have (each slice's own token mean) is measured in the same run at world 1 and
must dwarf the tolerance. World 2 runs here; world 4 (hsdp, fsdp_tp,
pipeline_fsdp, ddp) in ``test_token_loss_w4.py`` (long tier).
"""

from __future__ import annotations

import pytest
import torch

from unison.launch.torchrun import spawn

import token_loss_worlds as w

#: The ceiling the issue names; measured deviations are 1e-6..4e-6.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def ref():
    return w.reference()


@pytest.fixture(scope="module")
def ref_pipeline():
    return w.reference(pipeline=True)


def check(out, ref, what):
    assert w.max_diff(out["state"], ref["state"]) <= TOLERANCE, what
    # The logged loss is the global batch's token mean, not a mean of per-slice means.
    assert out["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=1e-6), what
    # The global grad norm: a misstated reduction would scale it by the replica count.
    assert out["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5), what


@pytest.mark.parametrize("form", ["pair", "hf"])
@pytest.mark.parametrize("accumulate", [1, 4])
def test_one_process_matches_the_full_batch_reference(ref, form, accumulate):
    out = w.fit("single", form, accumulate)
    check(out, ref, f"single/{form}/{accumulate}")
    # The step's global item count is what tokens/s counts.
    assert out["items"] == out["tokens"] and all(n > 0 for n in out["items"])


def test_per_slice_means_would_change_the_weights_far_beyond_the_tolerance(ref):
    """The effect the normalisation removes, measured on the same data: accumulation 4 with per-slice means."""
    one, four = w.fit("single", "mean", 1), w.fit("single", "mean", 4)
    effect = w.max_diff(four["state"], one["state"])
    assert effect > 100 * TOLERANCE, effect


def test_a_sequential_lm_with_loss_fn_pairs_matches_its_reference(ref_pipeline):
    check(w.fit("single", "pair_loss_fn", 4), ref_pipeline, "single/pair_loss_fn/4")


CASES_W2 = [(strategy, form, 2, {}) for strategy in ("ddp", "fsdp", "zero2", "zero3") for form in ("pair", "hf")] + [
    ("pipeline", "pair_loss_fn", 2, {})
]


@pytest.fixture(scope="module")
def world2():
    return spawn(w.token_world, 2, CASES_W2, timeout=500)


@pytest.mark.parametrize("case", [f"{s}/{f}/{a}" for s, f, a, _ in CASES_W2])
def test_world_2_matches_the_full_batch_reference(world2, ref, ref_pipeline, case):
    out = world2[0][case]
    check(out, ref_pipeline if "pair_loss_fn" in case else ref, case)
    # Every rank trained the same weights and logged the same numbers.
    other = world2[1][case]
    assert other["losses"] == out["losses"] and other["items"] == out["items"]
    assert all(torch.equal(other["state"][k], v) for k, v in out["state"].items())


def test_every_builtin_declares_its_loss_normalisation():
    """``unison describe`` shows it; every built-in on this machine takes the pair form."""
    from unison.plugin.manager import PluginManager

    pm = PluginManager()
    for name in pm.strategies.names():
        spec, options = pm.strategies.resolve(name)
        ownership = spec.factory(**options.model_dump()).ownership
        assert ownership.loss_normalisation is not None, name
        assert ownership.refusal("item_weighted_loss") is None, name
    from test_cli import run

    text = " ".join(run("describe", "zero2").stdout.split())
    assert (
        "loss normalisation: backward divides by micro-batches; gradients reduced by mean over the data-parallel"
        in text
    )
    assert "(loss_sum, num_items) losses taken" in text


def test_an_engine_or_schedule_that_declares_no_normalisation_refuses_pairs():
    from unison.contract.ownership import AccumulationOwner, Feature, GradAccumulation, Ownership
    from unison.contract.replicated import DCP_FULL_STATE, TRAINER_PRECISION

    for owner in (AccumulationOwner.ENGINE, AccumulationOwner.SCHEDULE):
        ownership = Ownership(GradAccumulation(owner, "its own"), TRAINER_PRECISION, DCP_FULL_STATE)
        assert "declares no loss_normalisation (plugin API 2.3)" in ownership.refusal(Feature.ITEM_WEIGHTED_LOSS)
    # The trainer's path keeps the contract it always had: loss / A, replicas averaged.
    ownership = Ownership(GradAccumulation(AccumulationOwner.TRAINER, "no_sync"), TRAINER_PRECISION, DCP_FULL_STATE)
    assert ownership.refusal(Feature.ITEM_WEIGHTED_LOSS) is None
    assert ownership.normalisation.gradient_factor_numerator(4, 2) == 8
