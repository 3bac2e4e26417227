"""torch_zero, fairscale_oss and fairscale_sdp against the single-process reference, on real 2-rank gloo worlds.

One spawned world per strategy runs every scenario (tests/zero_fairscale_worlds.py);
the single-process references and the cross-backend resume under ``single``
run in this process.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import unison
from unison.errors import ConfigurationError, StrategyUnavailableError
from unison.launch.torchrun import spawn
from unison.strategies._sharded_optimizer import OptimizerRecipe

from helpers import max_abs_diff, regression_data, train
from zero_fairscale_worlds import fairscale_oss_world, fairscale_sdp_world, torch_zero_world

pytestmark = pytest.mark.distributed

# The task's ceiling for fp32; the mixed-precision ceilings are tests/test_ddp.py's.
FP32_TOL = 1e-5
BF16_TOL = 2e-3
FP16_TOL = 1e-3

WORLDS = {"torch_zero": torch_zero_world, "fairscale_oss": fairscale_oss_world, "fairscale_sdp": fairscale_sdp_world}
STRATEGIES = list(WORLDS)
_worlds: dict[str, list[dict]] = {}


@pytest.fixture(scope="module", autouse=True)
def _remove_checkpoints():
    yield
    for world in _worlds.values():
        for directory in world[0].get("tmp_dirs", []):
            shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module", params=STRATEGIES)
def strategy(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def world(strategy) -> list[dict]:
    # One world per strategy for the whole module, whatever the test order.
    if strategy not in _worlds:
        _worlds[strategy] = spawn(WORLDS[strategy], 2, timeout=240)
    return _worlds[strategy]


@pytest.fixture(scope="module")
def reference(single_runs) -> dict:
    return {
        **{name: single_runs(name) for name in ("fp32", "bf16-mixed", "16-mixed", "overflow")},
        "val": train("single", max_steps=4, val=regression_data(n=72, seed=5), val_every_n_steps=2),
    }


# --------------------------------------------------------------------------- #
# parity, hooks, resume: every strategy
# --------------------------------------------------------------------------- #


def test_fp32_matches_single_with_accumulation_clipping_and_scheduler(strategy, world, reference):
    ref = reference["fp32"]
    assert max(h["grad_norm"] for h in ref["history"]) > 0.5, "clipping must actually clip"
    for rank in world:
        run = rank["fp32"]
        assert max_abs_diff(run["state"], ref["state"]) <= FP32_TOL
        assert run["optimizer_steps"] == ref["optimizer_steps"] == 20
        assert run["scheduler_steps"] == ref["scheduler_steps"] == 20
        for a, b in zip(run["history"], ref["history"], strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
            assert a["lr"] == b["lr"]


def test_the_factory_built_optimizer_is_the_one_that_steps(strategy, world):
    # The user's instance becomes this rank's local optimizer: its step hooks fire once per update.
    # The factory is called twice: once on the model's parameters before any process group (to refuse
    # a factory that ignores its argument early), once by the strategy; only the second one steps.
    for rank in world:
        assert rank["factory_steps"] == {"factory_calls": 2, "steps": 3, "trainer_steps": 3}


def test_hook_sequence_identical_to_single(strategy, world, reference):
    for rank in world:
        assert rank["fp32"]["hooks"] == reference["fp32"]["hooks"]
        assert rank["fp32"]["monitored"] == reference["fp32"]["monitored"]


def test_validation_through_the_wrapper_keeps_hooks_and_training_like_single(strategy, world, reference):
    assert sum(c == "validation_end" for c, _ in reference["val"]["hooks"]) == 2
    for rank in world:
        assert rank["val"]["hooks"] == reference["val"]["hooks"]
        assert max_abs_diff(rank["val"]["state"], reference["val"]["state"]) <= FP32_TOL


def test_save_at_10_resume_to_20_equals_uninterrupted(strategy, world):
    for rank in world:
        assert max_abs_diff(rank["resumed"]["state"], rank["fp32"]["state"]) == 0.0
        assert rank["resumed"]["optimizer_steps"] == rank["resumed"]["scheduler_steps"] == 20
        # the resumed run replays steps 10..19 only, with the checkpoint hook pair
        steps = [s for c, s in rank["resumed"]["hooks"] if c == "step_start"]
        assert steps == list(range(10, 20))
        assert sum(c == "load_checkpoint" for c, _ in rank["resumed"]["hooks"]) == 1


def test_checkpoint_resumes_under_ddp_and_single_and_ddp_checkpoints_resume_here(strategy, world, reference):
    declaration = unison.PluginManager().strategies.create(strategy).ownership.state_dict
    assert declaration.reshardable
    ref = reference["fp32"]
    for rank in world:
        assert max_abs_diff(rank["ddp_from_ckpt"]["state"], ref["state"]) <= FP32_TOL
        assert max_abs_diff(rank["from_ddp_ckpt"]["state"], ref["state"]) <= FP32_TOL
    # World size 2 -> 1: the same checkpoint under the single-process reference.
    single = train("single", ckpt_path=Path(world[0]["ckpt"]))
    assert max_abs_diff(single["state"], ref["state"]) <= FP32_TOL
    assert single["optimizer_steps"] == 20


# --------------------------------------------------------------------------- #
# precisions
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("precision,tol", [("bf16-mixed", BF16_TOL), ("16-mixed", FP16_TOL)])
def test_trainer_applied_mixed_precision(strategy, world, reference, precision, tol):
    for rank in world:
        assert max_abs_diff(rank[precision]["state"], reference[precision]["state"]) <= tol


def test_fp16_overflow_skips_the_step_and_the_scheduler(strategy, world, reference):
    expected = [h["skipped"] for h in reference["overflow"]["history"]]
    assert any(expected)
    for rank in world:
        run = rank["overflow"]
        assert [h["skipped"] for h in run["history"]] == expected
        assert all(not math.isfinite(h["grad_norm"]) for h in run["history"] if h["skipped"])
        assert run["optimizer_steps"] == run["scheduler_steps"] == 8 - sum(expected)
        assert max_abs_diff(run["state"], reference["overflow"]["state"]) <= FP16_TOL


# --------------------------------------------------------------------------- #
# memory
# --------------------------------------------------------------------------- #


def test_torch_zero_holds_half_the_optimizer_state_of_ddp_per_rank():
    world = _worlds.get("torch_zero") or spawn(torch_zero_world, 2, timeout=240)
    _worlds["torch_zero"] = world
    ddp = [rank["footprint"]["ddp"]["optimizer_state"] for rank in world]
    zero = [rank["footprint"]["torch_zero"]["optimizer_state"] for rank in world]
    assert ddp[0] == ddp[1] > 0
    # Each rank holds about half (per-tensor partition), and together exactly ddp's state.
    assert sum(zero) == ddp[0]
    for shard in zero:
        assert 0.45 <= shard / ddp[0] <= 0.55, (zero, ddp)
    # Parameters and gradients stay whole (ZeRO stage 1).
    assert world[0]["footprint"]["torch_zero"]["parameters"] == world[0]["footprint"]["ddp"]["parameters"]


@pytest.mark.parametrize("name", ["fairscale_oss", "fairscale_sdp"])
def test_fairscale_optimizer_state_is_sharded(name):
    world = _worlds.get(name) or spawn(WORLDS[name], 2, timeout=240)
    _worlds[name] = world
    shards = [rank["footprint"]["optimizer_state"] for rank in world]
    # Same MLP and partition sizes as torch_zero's: the two shards add up to ddp's 17160 bytes.
    ddp_bytes = 2 * 4 * sum(n for n in (32 * 32, 32, 32 * 32, 32, 32, 1))
    assert sum(shards) == ddp_bytes
    assert all(0.45 <= s / ddp_bytes <= 0.55 for s in shards), shards


# --------------------------------------------------------------------------- #
# fairscale_sdp: the upstream trap and the fix
# --------------------------------------------------------------------------- #


def test_upstream_sdp_loop_with_optimizer_zero_grad_really_deviates():
    """fairscale's documented loop trains on unreduced gradients under torch>=2.0.

    Zeroing through the model fixes it."""
    world = _worlds.get("fairscale_sdp") or spawn(fairscale_sdp_world, 2, timeout=240)
    _worlds["fairscale_sdp"] = world
    ref = train("single")
    ref_no_accumulation = train("single", accumulate_grad_batches=1)
    for rank in world:
        assert max_abs_diff(rank["upstream_optimizer_zero_grad"], ref["state"]) > 1e-2
        assert max_abs_diff(rank["upstream_optimizer_zero_grad_no_accumulation"], ref_no_accumulation["state"]) > 1e-2
        assert max_abs_diff(rank["upstream_model_zero_grad"], ref["state"]) <= FP32_TOL
        assert max_abs_diff(rank["upstream_model_zero_grad_no_accumulation"], ref_no_accumulation["state"]) <= FP32_TOL
    ownership = unison.PluginManager().strategies.create("fairscale_sdp").ownership
    assert ownership.non_conformant is None
    assert any("ShardedDataParallel.zero_grad" in note for note in ownership.notes)


# --------------------------------------------------------------------------- #
# registration, availability, optimizer recipe (no process group)
# --------------------------------------------------------------------------- #


def test_fairscale_fsdp_is_registered_and_unavailable_without_cuda():
    spec = {s.name: s for s in unison.PluginManager().strategies.specs()}["fairscale_fsdp"]
    if torch.cuda.is_available():
        pytest.skip("CUDA present: fairscale_fsdp is available")
    assert spec.unavailable == "fairscale FullyShardedDataParallel is CUDA-only"
    with pytest.raises(StrategyUnavailableError, match="CUDA-only"):
        unison.Trainer(max_steps=1, strategy="fairscale_fsdp")
    assert not torch.distributed.is_initialized()


def test_fairscale_strategies_unavailable_when_fairscale_is_missing(monkeypatch):
    # ``None`` in sys.modules makes the import system (and find_spec) treat it as absent.
    monkeypatch.setitem(sys.modules, "fairscale", None)
    specs = {s.name: s for s in unison.PluginManager().strategies.specs()}
    for name in ("fairscale_oss", "fairscale_sdp", "fairscale_fsdp"):
        assert specs[name].unavailable == unison.plugin.registry.missing_modules("fairscale")
        assert "'fairscale' is not installed" in specs[name].unavailable
    with pytest.raises(StrategyUnavailableError, match="fairscale"):
        unison.Trainer(max_steps=1, strategy="fairscale_oss")
    assert specs["torch_zero"].unavailable is None


def test_listing_strategies_does_not_import_fairscale():
    code = (
        "import sys, unison; pm = unison.PluginManager(); "
        "[pm.strategies.create(s.name).ownership for s in pm.strategies.specs() "
        "if s.name.startswith('fairscale') and not s.unavailable]; "
        "assert 'fairscale' not in sys.modules, 'fairscale imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_fairscale_sdp_options_are_validated():
    with pytest.raises(ConfigurationError, match="reduce_buffer"):
        unison.Trainer(max_steps=1, strategy="fairscale_sdp", strategy_options={"reduce_buffer_size": -1})
    with pytest.raises(ConfigurationError, match="bucket"):
        unison.Trainer(max_steps=1, strategy="fairscale_sdp", strategy_options={"bucket": 1})


def test_optimizer_recipe_keeps_class_defaults_and_param_groups():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    recipe = OptimizerRecipe.from_factory(
        lambda params: torch.optim.AdamW(
            [{"params": list(model[0].parameters()), "lr": 0.1}, {"params": list(model[1].parameters())}],
            lr=1e-3,
            weight_decay=0.05,
            betas=(0.8, 0.9),
        ),
        model.parameters(),
        strategy="torch_zero",
    )
    assert recipe.cls is torch.optim.AdamW
    # AdamW.defaults carries decoupled_weight_decay, which its constructor does not take.
    assert "decoupled_weight_decay" not in recipe.defaults
    rebuilt = recipe.build()
    assert [g["lr"] for g in rebuilt.param_groups] == [0.1, 1e-3]
    assert all(g["weight_decay"] == 0.05 and g["betas"] == (0.8, 0.9) for g in rebuilt.param_groups)
    assert [p for g in rebuilt.param_groups for p in g["params"]] == list(model.parameters())


def test_optimizer_recipe_refuses_an_optimizer_that_already_holds_state():
    model = torch.nn.Linear(2, 1)

    def stepped(params):
        optimizer = torch.optim.AdamW(params)
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        return optimizer

    with pytest.raises(ConfigurationError, match="already holds state"):
        OptimizerRecipe.from_factory(stepped, model.parameters(), strategy="torch_zero")
