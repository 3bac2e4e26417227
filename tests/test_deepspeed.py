"""DeepSpeed ZeRO-1/2/3 against the single-process reference, on real 2-rank gloo worlds.

One spawned world per ZeRO stage runs every scenario (tests/deepspeed_worlds.py);
the bad-input tests need no process group at all.
"""

from __future__ import annotations

import pytest
import torch

import unison
from unison.launch.torchrun import spawn
from unison.strategies.deepspeed import BF16_TOLERANCE

from deepspeed_worlds import MEMORY_WIDTH, deepspeed_scenarios  # sets DS_ACCELERATOR=cpu first
from helpers import max_abs_diff, train

STAGES = ["zero1", "zero2", "zero3"]
FP32_TOL = 1e-5
NORM_REL = 1e-5


#: Bytes per parameter per rank at world N, as the ZeRO paper counts them
#: (params + grads + optimizer state, Adam: master copy + two moments), for
#: DeepSpeed with a client AdamW. In 32-true DeepSpeed still keeps a separate
#: fp32 master partition next to the fp32 parameters, so ZeRO-3 ends at
#: (4 + 4 + 12) / N bytes, not 16 / N.
def predicted_bytes(stage: str, precision: str, n: int = 2) -> float:
    p = 4 if precision == "32-true" else 2  # parameter and gradient dtype
    params = p / n if stage == "zero3" else p
    grads = p if stage in ("zero1", "ddp") else p / n
    optim = 8 if stage == "ddp" else 12 / n  # ddp: two fp32 moments; ZeRO: + fp32 master, partitioned
    if stage == "ddp":
        params = grads = 4  # torch autocast keeps fp32 parameters and gradients
    return params + grads + optim


@pytest.fixture(scope="module")
def single_checkpoint(tmp_path_factory) -> str:
    """A step-10 checkpoint of the single strategy (world 1, DCP) for the worlds to resume from."""
    root = tmp_path_factory.mktemp("single-ckpt")
    train("single", max_steps=10, checkpoint_dir=str(root))
    return str(root / "step-00000010")


@pytest.fixture(scope="module", params=STAGES)
def world(request, single_checkpoint, tmp_path_factory) -> tuple[str, list[dict], str]:
    """One 2-rank world per stage; also returns where it left its step-10 checkpoint."""
    root = tmp_path_factory.mktemp(f"{request.param}-ckpt")
    ranks = spawn(deepspeed_scenarios, 2, request.param, single_checkpoint, str(root), timeout=300)
    return request.param, ranks, str(root / "step-00000010")


@pytest.fixture(scope="module")
def reference(single_runs) -> dict:
    return {name: single_runs(name) for name in ("fp32", "bf16-mixed")}


# --------------------------------------------------------------------------- #
# parity
# --------------------------------------------------------------------------- #
@pytest.mark.distributed
def test_fp32_matches_reference_with_accumulation_clipping_and_scheduler(world, reference):
    strategy, ranks, _ = world
    ref = reference["fp32"]
    assert max(h["grad_norm"] for h in ref["history"]) > 0.5, "clipping must actually clip"
    for rank in ranks:
        run = rank["fp32"]
        assert max_abs_diff(run["state"], ref["state"]) <= FP32_TOL
        assert run["optimizer_steps"] == ref["optimizer_steps"] == 20
        assert run["scheduler_steps"] == ref["scheduler_steps"] == 20
        assert run["hooks"] == ref["hooks"]
        assert run["monitored"] == ref["monitored"]
        # ZeRO-1/2 in fp32: the trainer clips with its norm and DeepSpeed measures none; ZeRO-3: the engine
        # measures its own again inside step() and clips with it.
        trainer_clips = strategy in ("zero1", "zero2")
        for a, b, engine_norm, engine_lr in zip(run["history"], ref["history"], run["engine_norms"], run["engine_lrs"]):
            # The norm unison reports before the step, the reference's, and (ZeRO-3) the one the engine
            # clipped with inside step() all agree.
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=NORM_REL)
            if trainer_clips:
                assert engine_norm is None
            else:
                assert engine_norm == pytest.approx(b["grad_norm"], rel=NORM_REL)
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
            # The lr reported is the lr the reference used and the engine applied.
            assert a["lr"] == b["lr"] == engine_lr
        assert all(run["shared_param_groups"])


@pytest.mark.distributed
def test_offload_trains_like_the_reference(world):
    _, ranks, _ = world
    ref = train("single", max_steps=8)
    for rank in ranks:
        assert max_abs_diff(rank["offload"]["state"], ref["state"]) <= FP32_TOL
        assert [h["grad_norm"] for h in rank["offload"]["history"]] == pytest.approx(
            [h["grad_norm"] for h in ref["history"]], rel=NORM_REL
        )


@pytest.mark.distributed
def test_full_state_dict_is_canonical(world, reference):
    _, ranks, _ = world
    ref = reference["fp32"]["state"]
    for rank in ranks:  # on every rank, not only rank 0
        state = rank["fp32"]["state"]
        assert list(state) == list(ref)  # the module's own names, no "module." prefix
        for key, tensor in state.items():
            # No ZeRO-3 placeholders (empty tensors): whole, fp32, on CPU.
            assert tensor.shape == ref[key].shape, key
            assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"


@pytest.mark.distributed
def test_bf16_mixed_within_declared_tolerance(world, reference):
    _, ranks, _ = world
    for rank in ranks:
        deviation = max_abs_diff(rank["bf16-mixed"]["state"], reference["bf16-mixed"]["state"])
        assert deviation <= BF16_TOLERANCE
        # bf16 is really applied: it moves away from the fp32 trajectory.
        assert max_abs_diff(rank["bf16-mixed"]["state"], reference["fp32"]["state"]) > 10 * FP32_TOL
        assert rank["bf16-mixed"]["optimizer_steps"] == 20


@pytest.mark.distributed
def test_save_at_10_resume_to_20_equals_uninterrupted(world):
    _, ranks, _ = world
    for rank in ranks:
        resumed, uninterrupted = rank["resumed"], rank["fp32"]
        assert max_abs_diff(resumed["state"], uninterrupted["state"]) == 0.0
        assert resumed["history"] == uninterrupted["history"][10:]
        assert resumed["optimizer_steps"] == resumed["scheduler_steps"] == 20
        assert ("load_checkpoint", None) not in resumed["hooks"]
        assert any(name == "load_checkpoint" for name, _ in resumed["hooks"])


@pytest.mark.distributed
def test_checkpoint_holds_deepspeed_shards_and_the_canonical_copy_as_declared(world):
    name, ranks, _ = world
    files = ranks[0]["checkpoint_files"]
    # engine.save_checkpoint(tag="state"): one optimizer shard per rank ...
    assert "state/zero_pp_rank_0_mp_rank_00_optim_states.pt" in files
    assert "state/zero_pp_rank_1_mp_rank_00_optim_states.pt" in files
    # ... and the canonical DCP copy beside it.
    assert ".metadata" in files and "deepspeed.json" in files
    declared = unison.PluginManager().strategies.create(name).ownership.state_dict
    assert declared.kind is unison.StateDictKind.SHARDED and declared.reshardable is True


@pytest.mark.distributed
def test_cross_backend_and_cross_world_resume(world, reference):
    _, ranks, checkpoint = world
    ref = reference["fp32"]
    for rank in ranks:
        uninterrupted = rank["fp32"]
        # single (world 1) -> this stage (world 2)
        assert max_abs_diff(rank["from_single"]["state"], uninterrupted["state"]) <= FP32_TOL
        # this stage -> another ZeRO stage, same world
        assert max_abs_diff(rank["from_other_stage"]["state"], uninterrupted["state"]) <= FP32_TOL
        for run in (rank["from_single"], rank["from_other_stage"]):
            assert run["optimizer_steps"] == run["scheduler_steps"] == 20
            assert [h["lr"] for h in run["history"]] == [h["lr"] for h in ref["history"]][10:]
            assert [h["grad_norm"] for h in run["history"]] == pytest.approx(
                [h["grad_norm"] for h in ref["history"]][10:], rel=NORM_REL
            )
    # this stage (world 2) -> single (world 1)
    resumed = train("single", max_steps=20, ckpt_path=checkpoint)
    assert max_abs_diff(resumed["state"], ref["state"]) <= FP32_TOL
    assert resumed["optimizer_steps"] == resumed["scheduler_steps"] == 20


@pytest.mark.distributed
def test_memory_footprint_follows_the_zero_paper(world):
    name, ranks, _ = world
    n_params = ranks[0]["parameters"]
    assert n_params >= 1_000_000 and n_params == 2 * MEMORY_WIDTH**2 + 2 * MEMORY_WIDTH + MEMORY_WIDTH + 1
    for rank in ranks:
        for precision, sizes in rank["memory"].items():
            total = {k: sum(v.values()) for k, v in sizes.items()}
            ddp = total["ddp"]
            assert ddp == pytest.approx(predicted_bytes("ddp", precision) * n_params, rel=1e-3)
            ratio = total[name] / ddp
            expected = predicted_bytes(name, precision) / predicted_bytes("ddp", precision)
            # Within 1%: flat-buffer padding and ZeRO-3's whole (persistent) biases.
            assert ratio == pytest.approx(expected, rel=1e-2), (precision, sizes)
            assert ratio < 1.0
            if name == "zero3" and precision == "bf16-mixed":
                assert ratio <= 0.6  # the ZeRO paper's mixed-precision setting: 16/N of 16 bytes


# --------------------------------------------------------------------------- #
# bad input: refused before any process group
# --------------------------------------------------------------------------- #
def _refused(**settings) -> unison.ConfigurationError:
    with pytest.raises(unison.ConfigurationError) as info:
        unison.Trainer(accumulate_grad_batches=4, global_batch_size=32, max_steps=1, **settings)
    assert not torch.distributed.is_initialized()
    return info.value


@pytest.mark.parametrize("strategy", STAGES)
def test_conflicting_config_key_names_both(strategy):
    err = _refused(strategy=strategy, strategy_options={"config": {"gradient_accumulation_steps": 8}})
    assert "strategy_options.config['gradient_accumulation_steps']=8 conflicts with accumulate_grad_batches=4" in str(
        err
    )
    err = _refused(strategy=strategy, grad_clip_norm=0.5, strategy_options={"config": {"gradient_clipping": 1.0}})
    assert "conflicts with grad_clip_norm=0.5" in str(err)
    err = _refused(strategy=strategy, strategy_options={"config": {"zero_optimization": {"stage": 0}}})
    assert f"conflicts with strategy={strategy!r}" in str(err)
    err = _refused(strategy=strategy, strategy_options={"config": {"bf16": {"enabled": True}}})
    assert "conflicts with precision='32-true'" in str(err)
    # A key unison does not own merges; an equal value is no conflict.
    unison.Trainer(
        max_steps=1,
        strategy=strategy,
        accumulate_grad_batches=4,
        global_batch_size=32,
        strategy_options={
            "config": {"gradient_accumulation_steps": 4, "zero_optimization": {"reduce_bucket_size": 1000}}
        },
    )


@pytest.mark.parametrize("section", ["optimizer", "scheduler"])
def test_optimizer_or_scheduler_section_refused(section):
    err = _refused(strategy="zero2", strategy_options={"config": {section: {"type": "AdamW", "params": {}}}})
    assert err.option == f"strategy_options.config[{section!r}]"


def test_fp16_refused_on_cpu_with_deepspeeds_reason():
    err = _refused(strategy="zero3", precision="16-mixed", accelerator="cpu")
    assert err.option == "precision" and "Type fp16 is not supported on your device" in str(err)


def test_bf16_true_declared_unsupported():
    err = _refused(strategy="zero1", precision="bf16-true")
    assert err.option == "precision" and "fp32 master weights" in str(err)


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_offload_param_only_on_zero3(strategy):
    err = _refused(strategy=strategy, strategy_options={"offload_param": "cpu"})
    assert err.option == "strategy_options.offload_param" and "zero3" in err.fix
    # the same option is accepted where it exists
    unison.Trainer(max_steps=1, strategy="zero3", strategy_options={"offload_param": "cpu", "offload_optimizer": "cpu"})


def test_unknown_option_and_bad_value_refused():
    _refused(strategy="zero2", strategy_options={"stage": 3})  # the name fixes the stage
    _refused(strategy="zero2", strategy_options={"offload_optimizer": "nvme"})


def test_declaration():
    for name, stage in zip(STAGES, (1, 2, 3)):
        strategy = unison.PluginManager().strategies.create(name)
        own = strategy.ownership
        assert own.grad_accumulation.owner is unison.AccumulationOwner.ENGINE
        assert own.precision["32-true"].owner is unison.PrecisionOwner.ENGINE
        assert own.precision["bf16-mixed"].owner is unison.PrecisionOwner.ENGINE
        # fp16 is DeepSpeed's on CUDA; its CPU accelerator has none.
        fp16 = own.precision["16-mixed"]
        if torch.cuda.is_available():
            assert fp16.owner is unison.PrecisionOwner.ENGINE
        else:
            assert not fp16.supported and "Type fp16 is not supported on your device" in fp16.detail
        assert not own.precision["bf16-true"].supported
        assert own.non_conformant is None
        settings = unison.TrainerSettings(
            strategy=name,
            accumulate_grad_batches=4,
            global_batch_size=32,
            grad_clip_norm=0.5,
            precision="bf16-mixed",
            max_steps=1,
        )
        config = strategy.build_config(settings, 2)
        assert config["zero_optimization"]["stage"] == stage
        assert config["train_micro_batch_size_per_gpu"] == 4 and config["gradient_accumulation_steps"] == 4
        assert config["bf16"] == {"enabled": True}
        assert "optimizer" not in config and "scheduler" not in config
        # ZeRO-2 under bf16-mixed: the trainer clips with the norm it measured, and DeepSpeed measures none.
        # ZeRO-1 in bf16-mixed runs DeepSpeed's BF16 optimizer and ZeRO-3 has no such switch: they clip.
        if stage == 2:
            assert config["gradient_clipping"] == 0.0 and config["zero_optimization"]["compute_grad_norm"] is False
        else:
            assert config["gradient_clipping"] == 0.5 and "compute_grad_norm" not in config["zero_optimization"]


def test_the_trainer_clips_where_deepspeed_can_skip_its_own_norm():
    from unison.strategies.deepspeed.config import DeepSpeedOptions, trainer_clips

    def clips(stage, precision="32-true", clip=1.0, **options):
        settings = unison.TrainerSettings(precision=precision, grad_clip_norm=clip, max_steps=1)
        return trainer_clips(stage, DeepSpeedOptions(**options), settings)

    assert clips(1) and clips(2) and clips(2, "bf16-mixed")
    assert not clips(3) and not clips(1, "bf16-mixed") and not clips(2, "16-mixed")
    assert not clips(2, offload_optimizer="cpu") and not clips(2, clip=None)


def test_zero3_offload_alias_presets_both_offloads():
    pm = unison.PluginManager()
    strategy = pm.strategies.create("zero3_offload")
    assert strategy.name == "zero3_offload"
    assert strategy.options.offload_optimizer == "cpu" and strategy.options.offload_param == "cpu"
