"""pipeline and deepspeed_pipeline against the single-process reference.

On real gloo worlds of 2 (2 stages) and 4 (2 stages x 2 replicas).
"""

from __future__ import annotations

import functools
import math
import shutil
from pathlib import Path

import pytest
import torch

import unison
from unison.errors import ConfigurationError
from unison.launch.torchrun import spawn
from unison.strategies.pipeline import balance_by_parameters

import helpers
from helpers import adamw, max_abs_diff, mlp, regression_data, train
from pipeline_worlds import (
    MULTI_CHUNK_SCHEDULES,
    batchnorm_run,
    pipeline_world_scenarios,
    with_validation,
)

# Ceilings; measured here (2 stages, 20 steps): parameters <= 7.5e-8, losses <= 2.4e-7 (fp32); bf16-mixed 4.5e-8.
FP32_TOL = 1e-5
LOSS_TOL = 1e-6
#: bf16-mixed: the documented bf16 ceiling (README "Numerics"). For scale: bf16-mixed moves this
#: setup 1.9e-2 away from fp32, so a pipeline that ignored bf16 would be caught by the second check.
BF16_TOL = 2e-3
#: bf16-true keeps the parameters themselves in bf16, whose spacing at this model's weight
#: magnitudes (0.25-0.5) is 2**-9 = 1.95e-3: a rounding that goes the other way moves a weight by
#: a whole bf16 step. The pipeline accumulates micro-batch gradients and sums the global norm
#: (per stage, then across stages) in another order than one process, so a few weights end one
#: or two bf16 steps away (measured 2.9e-3, 1.5 steps); the ceiling is two steps, 4e-3. bf16-true
#: itself moves this setup 2.0e-2 from fp32.
BF16_TRUE_TOL = 4e-3
FP16_TOL = 2e-3


@pytest.fixture(scope="module")
def reference(single_runs) -> dict:
    return {
        "fp32": single_runs("fp32"),
        "val": with_validation("single"),
        # the same runs as pipeline_worlds.mixed_precision_runs("single")
        **{name: single_runs(name) for name in ("bf16-mixed", "bf16-true", "overflow")},
        "batchnorm": batchnorm_run("single"),
    }


@pytest.fixture(scope="module", params=[2, 4], ids=["world2-2stages", "world4-2stagesx2replicas"])
def world(request) -> list[dict]:
    ranks = spawn(pipeline_world_scenarios, request.param, timeout=240)
    yield ranks
    for directory in {d for r in ranks for d in r["tmp_dirs"]}:
        shutil.rmtree(directory, ignore_errors=True)


def _assert_same_run(run: dict, ref: dict, tol: float = FP32_TOL) -> None:
    assert max_abs_diff(run["state"], ref["state"]) <= tol
    assert len(run["history"]) == len(ref["history"])
    for a, b in zip(run["history"], ref["history"]):
        assert abs(a["loss"] - b["loss"]) <= LOSS_TOL, (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5, abs=1e-6)
        assert a["lr"] == b["lr"]
    assert run["optimizer_steps"] == ref["optimizer_steps"]
    assert run["scheduler_steps"] == ref["scheduler_steps"]


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", *MULTI_CHUNK_SCHEDULES])
def test_schedule_matches_single_on_every_rank(world, reference, schedule):
    ref = reference["val"] if schedule == "1f1b" else reference["fp32"]
    assert max(h["grad_norm"] for h in ref["history"]) > 0.5, "clipping must actually clip"
    assert ref["optimizer_steps"] == ref["scheduler_steps"] == 20
    for rank in world:
        run = rank[schedule]
        _assert_same_run(run, ref)
        assert run["hooks"] == ref["hooks"]
        assert run["monitored"] == ref["monitored"]


@pytest.mark.distributed
def test_deepspeed_pipeline_matches_single_on_every_rank(world, reference):
    ref = reference["val"]
    for rank in world:
        run = rank["deepspeed_pipeline"]
        _assert_same_run(run, ref)
        assert run["hooks"] == ref["hooks"]
        assert run["monitored"] == ref["monitored"]


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["1f1b", "deepspeed_pipeline"])
def test_validation_loss_matches_single(world, reference, strategy):
    ref = reference["val"]["val_losses"]
    assert [s for s, _ in ref] == [10, 20]
    for rank in world:
        got = rank[strategy]["val_losses"]
        assert [s for s, _ in got] == [s for s, _ in ref]
        for (_, a), (_, b) in zip(got, ref):
            assert abs(a - b) <= LOSS_TOL


@pytest.mark.distributed
@pytest.mark.parametrize(
    "direction",
    [
        "pipeline_to_ddp",
        "ddp_to_pipeline",
        "ddp_to_pipeline_zbv",
        "ddp_to_deepspeed_pipeline",
        "deepspeed_pipeline_to_pipeline",
    ],
)
def test_cross_backend_resume_equals_uninterrupted(world, reference, direction):
    for rank in world:
        run = rank[direction]
        # an uninterrupted pipeline run of the same world, and the single reference
        assert max_abs_diff(run["state"], rank["gpipe"]["state"]) <= FP32_TOL
        assert max_abs_diff(run["state"], reference["fp32"]["state"]) <= FP32_TOL
        assert run["optimizer_steps"] == run["scheduler_steps"] == 20
        # the resumed fit reports steps 10-19, equal to the reference's
        assert [h["step"] for h in run["history"]] == list(range(10, 20))
        for a, b in zip(run["history"], reference["fp32"]["history"][10:]):
            assert abs(a["loss"] - b["loss"]) <= LOSS_TOL
        assert ("load_checkpoint", reference_recorder_count(reference)) in run["hooks"]


@pytest.mark.distributed
def test_validation_after_resume_into_v_placement(world, reference):
    # ZBV: rank 0 holds the first and the last chunk; validation walks the chunks point to point.
    ref = dict(reference["val"]["val_losses"])
    for rank in world:
        ((step, loss),) = rank["ddp_to_pipeline_zbv"]["val_losses"]  # resumed at 10: only the final one
        assert step == 20 and abs(loss - ref[20]) <= LOSS_TOL


def reference_recorder_count(reference: dict) -> int:
    # The recorder stored its call count at save time (step 10): the same on every backend.
    hooks = reference["fp32"]["hooks"]
    return next(i for i, (name, step) in enumerate(hooks) if name == "step_end" and step == 9) + 1


@pytest.mark.distributed
def test_pipeline_checkpoint_resumes_under_single(world, reference):
    """A checkpoint written by the pipeline (any world size) loads into one process."""
    directory = Path(world[0]["pipeline_ckpt_dir"])
    run = train("single", max_steps=20, ckpt_path=directory / "step-00000010")
    assert max_abs_diff(run["state"], reference["fp32"]["state"]) <= FP32_TOL


@pytest.mark.distributed
def test_batchnorm_buffers_match_single(world, reference):
    """torch's one-time shape inference runs each stage's forward; it must not update the buffers
    (it did: num_batches_tracked one too many, running statistics fed from uninitialised memory)."""
    if world[0]["world_size"] != 2:
        pytest.skip("runs in the 2-rank world only")
    ref = reference["batchnorm"]["state"]
    assert int(ref["1.num_batches_tracked"]) == 3 * 4  # 3 steps of 4 micro-batches
    for rank in world:
        state = rank["batchnorm"]["state"]
        assert int(state["1.num_batches_tracked"]) == 3 * 4
        assert max_abs_diff(state, ref) <= FP32_TOL


@pytest.mark.distributed
def test_mixed_precision(world, reference):
    if world[0]["world_size"] != 2:
        pytest.skip("mixed precision runs in the 2-rank world only")
    for rank in world:
        bf16 = rank["bf16-mixed"]
        assert max_abs_diff(bf16["state"], reference["bf16-mixed"]["state"]) <= BF16_TOL
        # bf16 really applied: the run is far (beyond the ceiling) from the fp32 result.
        assert max_abs_diff(bf16["state"], reference["fp32"]["state"]) > 5 * BF16_TOL
        assert max_abs_diff(rank["bf16-true"]["state"], reference["bf16-true"]["state"]) <= BF16_TRUE_TOL
        assert max_abs_diff(rank["bf16-true"]["state"], reference["fp32"]["state"]) > 3 * BF16_TRUE_TOL
        assert rank["bf16-true"]["state"]["0.weight"].dtype == torch.float32  # canonical export is fp32
        run, ref = rank["overflow"], reference["overflow"]
        skipped = [h["skipped"] for h in run["history"]]
        assert any(skipped), "the huge sample must overflow fp16"
        assert skipped == [h["skipped"] for h in ref["history"]]
        assert all(math.isinf(h["grad_norm"]) or math.isnan(h["grad_norm"]) for h in run["history"] if h["skipped"])
        assert run["optimizer_steps"] == run["scheduler_steps"] == ref["optimizer_steps"] == 8 - sum(skipped)
        assert run["hooks"] == ref["hooks"]
        assert max_abs_diff(run["state"], ref["state"]) <= FP16_TOL


# --------------------------------------------------------------------------- #
# Bad input: rejected before any process group starts
# --------------------------------------------------------------------------- #
#: helpers.fit on 512 samples with AdamW
fit = functools.partial(helpers.fit, data=regression_data(), optimizer=adamw())


class NotSequential(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 4), torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.fixture
def world_of(monkeypatch):
    """Pretend a launcher started WORLD_SIZE processes (nothing connects before validation fails)."""

    def set_world(n: int) -> None:
        monkeypatch.setenv("WORLD_SIZE", str(n))
        monkeypatch.setenv("RANK", "0")

    return set_world


def test_rejects_non_sequential_model(world_of):
    world_of(2)
    trainer = unison.Trainer(max_steps=1, strategy="pipeline", global_batch_size=32, accumulate_grad_batches=4)
    with pytest.raises(ConfigurationError, match=r"nn\.Sequential"):
        fit(trainer, model=NotSequential())
    assert not torch.distributed.is_initialized()


def test_rejects_more_stages_than_layers(world_of):
    world_of(8)
    trainer = unison.Trainer(
        max_steps=1, strategy="pipeline", strategy_options={"stages": 8}, accumulate_grad_batches=8
    )
    with pytest.raises(ConfigurationError, match="stages") as err:
        fit(trainer, model=mlp())  # 5 layers
    assert "5" in str(err.value)
    assert not torch.distributed.is_initialized()


def test_rejects_balance_not_summing_to_layers(world_of):
    world_of(2)
    trainer = unison.Trainer(max_steps=1, strategy="pipeline", strategy_options={"balance": [2, 2]})
    with pytest.raises(ConfigurationError, match="balance"):
        fit(trainer, model=mlp())
    with pytest.raises(ConfigurationError, match="balance"):
        unison.Trainer(max_steps=1, strategy="pipeline", strategy_options={"balance": [5]})  # one count for two stages
    assert not torch.distributed.is_initialized()


def test_rejects_tied_weights_across_stages(world_of):
    world_of(2)
    model = mlp(hidden=8)
    model[4] = torch.nn.Linear(8, 8)
    model.append(torch.nn.Linear(8, 1))
    model[4].weight = model[2].weight  # tied, and the balance puts them on different stages
    trainer = unison.Trainer(max_steps=1, strategy="pipeline", strategy_options={"balance": [3, 3]})
    with pytest.raises(ConfigurationError, match="tied"):
        fit(trainer, model=model)


def test_rejects_world_size_not_multiple_of_stages(world_of):
    world_of(3)
    with pytest.raises(unison.DeclaredRefusal, match="world size 3 is not a multiple of 2") as info:
        unison.Trainer(max_steps=1, strategy="pipeline")
    assert info.value.feature == "world_size"
    world_of(1)
    with pytest.raises(unison.DeclaredRefusal, match="world size 1 is not a multiple of 2"):
        unison.Trainer(max_steps=1, strategy="pipeline")


def test_rejects_micro_batch_not_dividing_over_replicas(world_of):
    # world 4 = 2 stages x 2 replicas: each micro-batch of 12 / 4 = 3 samples cannot split over 2 replicas,
    # although it would over the 1 replica a 2-rank world has.
    world_of(4)
    with pytest.raises(ConfigurationError, match="2 data-parallel replicas"):
        unison.Trainer(max_steps=1, strategy="pipeline", global_batch_size=12, accumulate_grad_batches=4)
    world_of(2)
    unison.Trainer(max_steps=1, strategy="pipeline", global_batch_size=12, accumulate_grad_batches=4)


def test_rejects_1f1b_with_fewer_micro_batches_than_stages(world_of):
    world_of(2)
    with pytest.raises(ConfigurationError, match="accumulate_grad_batches"):
        unison.Trainer(
            max_steps=1, strategy="pipeline", strategy_options={"schedule": "1f1b"}, accumulate_grad_batches=1
        )


def test_rejects_unknown_schedule_and_bad_chunk_counts(world_of):
    with pytest.raises(ConfigurationError, match="schedule"):
        unison.Trainer(max_steps=1, strategy="pipeline", strategy_options={"schedule": "pipedream"})
    with pytest.raises(ConfigurationError, match="stages_per_rank"):
        unison.Trainer(max_steps=1, strategy="pipeline", strategy_options={"schedule": "gpipe", "stages_per_rank": 2})
    with pytest.raises(ConfigurationError, match="stages_per_rank"):
        unison.Trainer(
            max_steps=1, strategy="pipeline", strategy_options={"schedule": "zbv_zero_bubble", "stages_per_rank": 3}
        )
    world_of(2)
    # 2 stages x 3 chunks per rank = 6 chunks > 5 layers
    trainer = unison.Trainer(
        max_steps=1, strategy="pipeline", strategy_options={"schedule": "interleaved_1f1b", "stages_per_rank": 3}
    )
    with pytest.raises(ConfigurationError, match="6 model chunks"):
        fit(trainer, model=mlp())
    # 5 micro-batches over 2 stages run in 2 rounds, which 5 does not divide
    with pytest.raises(ConfigurationError, match="rounds"):
        unison.Trainer(
            max_steps=1,
            strategy="pipeline",
            strategy_options={"schedule": "interleaved_1f1b"},
            accumulate_grad_batches=5,
            global_batch_size=40,
        )


def test_balance_by_parameter_count():
    # mlp(): Linear(8,32)=288, Tanh, Linear(32,32)=1056, Tanh, Linear(32,1)=33
    assert balance_by_parameters([288, 0, 1056, 0, 33], 2) == [2, 3]
    assert balance_by_parameters([10, 10, 10, 10], 4) == [1, 1, 1, 1]
    assert balance_by_parameters([100, 1, 1, 1, 1], 2) == [1, 4]
    assert sum(balance_by_parameters([5] * 9, 3)) == 9


def test_deepspeed_pipeline_declares_fp32_only(world_of):
    from unison.plugin.manager import PluginManager

    own = PluginManager().strategies.create("deepspeed_pipeline").ownership
    assert own.precision_support("32-true").supported
    assert not own.precision_support("bf16-mixed").supported
    world_of(2)
    with pytest.raises(ConfigurationError, match="does not support precision"):
        unison.Trainer(max_steps=1, strategy="deepspeed_pipeline", precision="16-mixed")
    with pytest.raises(ConfigurationError, match=r"nn\.Sequential"):
        fit(unison.Trainer(max_steps=1, strategy="deepspeed_pipeline"), model=NotSequential())
    world_of(3)
    with pytest.raises(ConfigurationError, match="world size 3 is not a multiple of 2"):
        unison.Trainer(max_steps=1, strategy="deepspeed_pipeline")


def test_declaration():
    # Building a strategy to read its declaration needs no world (what `unison describe` does).
    from unison.plugin.manager import PluginManager

    own = PluginManager().strategies.create("pipeline").ownership
    assert own.grad_accumulation.owner.value == "schedule"
    assert all(own.precision_support(p).supported for p in ("32-true", "bf16-mixed", "bf16-true", "16-mixed"))
    assert own.state_dict.reshardable
