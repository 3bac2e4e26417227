"""apex_distributed_fused_adam's wiring, driven through real 2-rank gloo runs against a CPU stand-in of apex.

apex's DistributedFusedAdam is CUDA-only; this machine has no GPU. The same
strategy class is registered over :mod:`apex_standin` (tests/apex_standin/: apex's
signatures and semantics in plain torch, see its docstring), so what is tested
here is unison's side: which DistributedFusedAdam calls the strategy makes,
when and with which arguments, and that the trainer driving them through real
runs lands where the single-process reference lands. Nothing here runs apex.

One spawned world runs every scenario (apex_standin/worlds.py); the references
run in this process. The conformance suite certifies the stand-in-backed
strategy at the end.
"""

from __future__ import annotations

import shutil
import sys

import pytest
from apex_standin import modules as standin_modules
from apex_standin.worlds import STANDIN, TiedMLP, overflow_data, run, standin_world

from unison.launch.torchrun import spawn

from helpers import max_abs_diff

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

# The ceilings of the other strategies' tests (tests/test_ddp.py): a named tolerance is never loosened.
FP32_TOL = 1e-5
BF16_TOL = 2e-3
FP16_TOL = 1e-3
ACCUMULATE = 4


@pytest.fixture(scope="module")
def standin_installed():
    """The stand-in under apex's module names in this process (for the references' fused optimizers), removed after."""
    with pytest.MonkeyPatch.context() as mp:
        for name, module in standin_modules().items():
            mp.setitem(sys.modules, name, module)
        yield


@pytest.fixture(scope="module")
def world():
    ranks = spawn(standin_world, 2, timeout=420)
    yield ranks
    for directory in ranks[0]["tmp_dirs"]:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(standin_installed):
    return {
        "fp32": run("single"),
        "no_clip_accumulate_1": run("single", grad_clip_norm=None, accumulate_grad_batches=1, max_steps=4),
        "adam_l2": run("single", optimizer="adam_l2"),
        "tied": run("single", model=TiedMLP()),
        "fused_lamb": run("single", optimizer="fused_lamb"),
        "bf16-mixed": run("single", precision="bf16-mixed"),
        "16-mixed": run("single", precision="16-mixed"),
        "overflow": run("single", precision="16-mixed", data=overflow_data(), max_steps=8),
    }


def _same_steps(run_: dict, ref: dict, rel: float = 1e-5) -> None:
    assert len(run_["history"]) == len(ref["history"])
    for got, want in zip(run_["history"], ref["history"]):
        assert got["skipped"] == want["skipped"] and got["lrs"] == want["lrs"]
        assert got["loss"] == pytest.approx(want["loss"], rel=rel, abs=1e-7)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=rel, abs=1e-7)
    assert (run_["optimizer_steps"], run_["scheduler_steps"]) == (ref["optimizer_steps"], ref["scheduler_steps"])


def _segments(calls: list) -> list[list]:
    """The call log cut into optimizer steps (from each trainer:step_start)."""
    steps: list[list] = []
    for name, args in calls:
        if name == "trainer:step_start":
            steps.append([])
        if steps:
            steps[-1].append((name, args))
    return steps


def _between(segment: list, start: str, end: str) -> list[str]:
    names = [n for n, _ in segment]
    return names[names.index(start) + 1 : names.index(end)]


# --------------------------------------------------------------------------- #
# Results: the stand-in-backed strategy trains like single
# --------------------------------------------------------------------------- #


def test_fp32_with_accumulation_clipping_and_scheduler_equals_single(world, reference):
    ref = reference["fp32"]
    assert max(h["grad_norm"] for h in ref["history"]) > 0.5, "clipping must actually clip"
    for rank in world:
        run_ = rank["fp32"]
        assert max_abs_diff(run_["state"], ref["state"]) <= FP32_TOL
        _same_steps(run_, ref)
    assert world[0]["fp32"]["buckets"] > 1, "the test model must span several buckets"


@pytest.mark.parametrize("scenario", ["redundant", "big_bucket"])
def test_process_group_and_bucket_options_train_like_single(world, reference, scenario):
    # distributed_size=1: no sharding, gradients all-reduced over the redundant group;
    # one large bucket synchronised by grad_sync() only (overlap_grad_sync=False).
    for rank in world:
        assert max_abs_diff(rank[scenario]["state"], reference["fp32"]["state"]) <= FP32_TOL
        _same_steps(rank[scenario], reference["fp32"])


def test_tied_weights_train_like_single(world, reference):
    # The shared parameter is one optimizer parameter; its accumulator hook fires once per backward.
    for rank in world:
        assert max_abs_diff(rank["tied"]["state"], reference["tied"]["state"]) <= FP32_TOL
    assert "decoder.weight" in reference["tied"]["state"]


def test_adam_with_l2_decay_and_apex_fused_adam_map_onto_distributed_fused_adam(world, reference):
    for rank in world:
        assert max_abs_diff(rank["adam_l2"]["state"], reference["adam_l2"]["state"]) <= FP32_TOL
        # apex's FusedAdam (AdamW mode) recipe trains like torch's AdamW.
        assert max_abs_diff(rank["fused_adam"]["state"], reference["fp32"]["state"]) <= FP32_TOL
    assert world[0]["adam_l2"]["init_kwargs"]["adam_w_mode"] is False
    assert world[0]["fp32"]["init_kwargs"]["adam_w_mode"] is True


def test_mixed_precision_equals_single_in_the_same_precision(world, reference):
    for rank in world:
        assert max_abs_diff(rank["bf16-mixed"]["state"], reference["bf16-mixed"]["state"]) <= BF16_TOL
        assert max_abs_diff(rank["16-mixed"]["state"], reference["16-mixed"]["state"]) <= FP16_TOL


def test_fp16_overflow_skips_the_step_and_the_scheduler_on_every_rank(world, reference):
    ref = reference["overflow"]
    skipped = [h["step"] for h in ref["history"] if h["skipped"]]
    assert len(skipped) == 1, "premise: the reference skips one step"
    for rank in world:
        run_ = rank["overflow"]
        assert [h["step"] for h in run_["history"] if h["skipped"]] == skipped
        assert run_["scheduler_steps"] == run_["optimizer_steps"] == ref["optimizer_steps"] == 7
        assert max_abs_diff(run_["state"], ref["state"]) <= FP16_TOL
        assert run_["factory_steps"] == 7, "the skipped step must not step the optimizer"
        # The GradScaler unscales through the optimizer: 2**-16 first, twice that after the overflow halved it.
        scales = [a["inv_scale"] for n, a in run_["calls"] if n == "unscale_grads"]
        assert len(scales) == 8 and scales[0] == 2.0**-16
        assert scales[skipped[0] + 1] == 2 * scales[skipped[0]]


def test_resume_and_cross_backend_resume(world, reference):
    for rank in world:
        # Save at 10, resume to 20 == uninterrupted, bitwise (the bucket layout does not change at resume).
        assert max_abs_diff(rank["resumed"]["state"], rank["fp32"]["state"]) == 0.0
        assert rank["resumed"]["history"] == rank["fp32"]["history"][10:]
        # The checkpoint is ddp's format: each resumes the other's.
        assert max_abs_diff(rank["ddp_from_standin"]["state"], reference["fp32"]["state"]) <= FP32_TOL
        assert max_abs_diff(rank["standin_from_ddp"]["state"], reference["fp32"]["state"]) <= FP32_TOL


def test_a_checkpoint_written_at_world_two_resumes_under_single(world, reference):
    resumed = run("single", ckpt_path=world[0]["ckpt"])
    assert max_abs_diff(resumed["state"], reference["fp32"]["state"]) <= FP32_TOL


def test_apex_fused_optimizers_under_ddp(world, reference):
    for rank in world:
        run_ = rank["ddp_fused_adam"]
        assert run_["optimizer_class"] is None  # ddp steps the factory's FusedAdam itself
        assert run_["factory_steps"] == 20
        assert max_abs_diff(run_["state"], reference["fp32"]["state"]) <= FP32_TOL
        # FusedLAMB clips by its own max_grad_norm over the gradients it holds: under ddp they are whole.
        assert max_abs_diff(rank["ddp_fused_lamb"]["state"], reference["fused_lamb"]["state"]) <= FP32_TOL


# --------------------------------------------------------------------------- #
# Wiring: which apex calls happen when, with which arguments
# --------------------------------------------------------------------------- #


def test_constructor_arguments_come_from_the_factory_and_the_options(world):
    kwargs = world[0]["fp32"]["init_kwargs"]
    # torch.optim.AdamW(params, lr=1e-2): AdamW's own defaults for the rest.
    adamw = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "bias_correction": True}
    assert {k: kwargs[k] for k in adamw} == adamw
    # One group holding every (trainable) parameter; StepLR added initial_lr and halved lr 4 times.
    assert world[0]["fp32"]["groups"] == [{**adamw, "lr": 1e-2 / 16, "initial_lr": 1e-2, "params": 6}]
    assert (kwargs["adam_w_mode"], kwargs["average_grad_sync"], kwargs["overlap_grad_sync"]) == (True, True, True)
    assert kwargs["bucket_cap_mb"] == 0.002 and kwargs["store_params"] is True and kwargs["pipeline_size"] == 2
    assert kwargs["device"] == "device(type='cpu')"
    assert kwargs["distributed_process_group"] is None and kwargs["redundant_process_group"] is None
    assert not any(
        kwargs[k]
        for k in (
            "overlap_param_sync",
            "store_param_remainders",
            "with_scaled_states",
            "nccl_ub",
            "capturable",
            "amsgrad",
        )
    )
    redundant = world[0]["redundant"]["init_kwargs"]
    assert redundant["distributed_process_group"] != "None" and redundant["redundant_process_group"] != "None"
    assert world[0]["big_bucket"]["init_kwargs"]["overlap_grad_sync"] is False


def test_no_sync_on_non_boundary_micro_steps_then_clip_step_and_zero_grad(world):
    run_ = world[0]["fp32"]
    steps = _segments(run_["calls"])
    assert len(steps) == 20
    for segment in steps:
        micro = _between(segment, "trainer:step_start", "trainer:after_backward")
        # The first three micro-steps inside no_sync(), the last outside it.
        assert micro.count("no_sync") == micro.count("no_sync_exit") == ACCUMULATE - 1
        assert [a for n, a in segment if n == "no_sync"] == [{"greedy_grad_copy": False}] * (ACCUMULATE - 1)
        # Every bucket reduce-scattered once, during the last micro-step's backward (overlapped).
        last = micro[len(micro) - 1 - micro[::-1].index("no_sync_exit") :]
        assert last.count("reduce_scatter") == micro.count("reduce_scatter") == run_["buckets"]
        clip = _between(segment, "trainer:after_backward", "trainer:before_optimizer_step")
        assert clip.count("clip_grad_norm") == 1 and "step" not in clip
        assert [a for n, a in segment if n == "clip_grad_norm"] == [{"max_norm": 0.5}]
        update = _between(segment, "trainer:before_optimizer_step", "trainer:after_optimizer_step")
        assert update.index("step") < update.index("zero_grad") and update.count("step") == 1
        assert [a for n, a in segment if n == "zero_grad"] == [{"set_to_none": True}]
    # No gradient collective inside no_sync, ever.
    assert all(not a["in_no_sync"] for n, a in run_["calls"] if n == "reduce_scatter")


def test_one_gradient_sync_per_optimizer_step_whatever_the_accumulation(world):
    counts = {}
    for name, steps in (("accumulate_4", 20), ("accumulate_1", 3)):
        run_ = world[0]["fp32" if name == "accumulate_4" else name]
        counts[name] = sum(n == "reduce_scatter" for n, _ in run_["calls"]) / steps
    assert counts["accumulate_4"] == counts["accumulate_1"] == world[0]["fp32"]["buckets"]


def test_without_clipping_the_norm_comes_from_grad_norm(world, reference):
    run_ = world[0]["no_clip_accumulate_1"]
    names = [n for n, _ in run_["calls"]]
    assert "clip_grad_norm" not in names and names.count("grad_norm") == 4
    assert "no_sync" not in names  # one micro-batch per step: nothing to defer
    _same_steps(run_, reference["no_clip_accumulate_1"])


def test_checkpoints_go_through_state_dict_format_2_and_load_state_dict(world):
    resumed = [(n, a) for n, a in world[0]["resumed"]["calls"] if n in ("state_dict", "load_state_dict")]
    # Loaded once at resume, gathered once for the final checkpoint (apex's default format 2).
    assert resumed == [
        ("load_state_dict", {"format": 2}),
        ("state_dict", {"state_dict_format": None, "gather_on_root": None}),
    ]


def test_the_factorys_step_hooks_fire_on_the_optimizer_that_steps(world):
    for rank in world:
        assert rank["fp32"]["factory_steps"] == rank["fp32"]["optimizer_steps"] == 20
        assert rank["fp32"]["optimizer_class"] == "apex_standin.distributed_fused_adam.DistributedFusedAdam"


def test_teardown_releases_the_optimizers_gradient_hooks(world):
    assert all(rank["hooks"]["grads_kept"] for rank in world)


# --------------------------------------------------------------------------- #
# The conformance suite, against the stand-in-backed strategy
# --------------------------------------------------------------------------- #


def test_conformance_suite_certifies_the_adam_scenarios_and_refuses_sgd_before_training(tmp_path_factory):
    from unison.conformance.certification import certify
    from unison.conformance.suite import Suite

    with Suite(
        world_size=2, plugins=["apex_standin.plugin"], workdir=tmp_path_factory.mktemp("apex-suite"), timeout=300
    ) as suite:
        report = certify([STANDIN], suite=suite, report_dir=tmp_path_factory.mktemp("apex-report"))
    verdicts = report.verdicts[STANDIN]
    assert report.certified(STANDIN)
    passed = {name for name, v in verdicts.items() if v.status == "pass"}
    # Every scenario with an Adam optimizer passes (groups, frozen layer, resume, cross-backend, reshard).
    assert {"lr_scheduler", "frozen", "resume", "cross_resume", "reshard", "unsupported_precision"} <= passed
    # The SGD scenarios are refused before training, naming the optimizer, as declared
    # (Feature.ANY_OPTIMIZER): declared out; nothing fails.
    for name, v in verdicts.items():
        if name not in passed:
            assert v.status == "declared_out" and "DistributedFusedAdam, an Adam optimizer" in v.reason, (name, v)
