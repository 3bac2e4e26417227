"""fsdp_tp (tensor parallel on tp, FSDP2 on dp) against the single-process reference, on a real 4-rank gloo
world (2 dp x 2 tp; tests/tp_worlds.py); its step-10 checkpoint resumed here under single and under zero3
at world 2."""

from __future__ import annotations

import pytest
import torch

import unison
from unison.launch.torchrun import spawn

from helpers import assert_matches_single, fit, max_abs_diff, mlp, regression_data, train
from hsdp_worlds import zero3_from
from tp_worlds import fsdp_tp_world, planned_mlp

TOL = 1e-6
NORM_REL = 1e-6


@pytest.fixture(scope="module")
def reference() -> dict:
    return train("single", model=planned_mlp())


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("ckpt-fsdp-tp"))
    return root, spawn(fsdp_tp_world, 4, root, timeout=600)


@pytest.mark.distributed
def test_fp32_matches_single_with_accumulation_clipping_and_scheduler(world, reference):
    _, ranks = world
    for rank in ranks:
        # The grad norm over dp and tp: over the TP-split weights' local shards only it would be smaller,
        # summed over tp for the replicated head larger.
        assert_matches_single(rank["fp32"], reference, tol=TOL, rel=NORM_REL)


@pytest.mark.distributed
def test_resume_equals_uninterrupted(world):
    _, ranks = world
    for rank in ranks:
        assert max_abs_diff(rank["resumed"]["state"], rank["fp32"]["state"]) <= TOL
        assert rank["resumed"]["history"] == rank["fp32"]["history"][10:]


@pytest.mark.distributed
def test_fsdp_checkpoint_resumes_under_fsdp_tp(world, reference):
    _, ranks = world
    for rank in ranks:
        assert max_abs_diff(rank["from_fsdp"]["state"], reference["state"]) <= TOL


@pytest.mark.distributed
def test_world_4_checkpoint_resumes_under_single_and_zero3(world, reference):
    root, _ = world
    step10 = f"{root}/fsdp_tp/step-00000010"
    single = train("single", model=planned_mlp(), max_steps=20, ckpt_path=step10, record=False)
    assert max_abs_diff(single["state"], reference["state"]) <= TOL
    for rank in spawn(zero3_from, 2, step10, timeout=300):
        assert max_abs_diff(rank["state"], reference["state"]) <= TOL


@pytest.mark.distributed
def test_dp_reduce_scatter_deferred_to_the_boundary(world):
    _, ranks = world
    for rank in ranks:
        counts = rank["collectives"]
        # Per optimizer step, one dp reduce-scatter per sharded unit (three Linear layers) whatever the
        # accumulation; the tp all-reduces belong to each micro-step's forward and backward.
        assert [s["reduce_scatter"] for s in counts[4]] == [s["reduce_scatter"] for s in counts[1]] == [3, 3, 3]
        assert all(s4["all_reduce"] > s1["all_reduce"] for s1, s4 in zip(counts[1], counts[4])), counts


# --------------------------------------------------------------------------- #
# Declarations and bad input (no process group)
# --------------------------------------------------------------------------- #


@pytest.fixture
def world_of_4(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")


def _fit(model: torch.nn.Module, **options) -> None:
    trainer = unison.Trainer(max_steps=1, strategy="fsdp_tp", strategy_options=options, global_batch_size=8)
    fit(trainer, model=model, data=regression_data(), optimizer=torch.optim.SGD)


def test_a_model_without_a_plan_is_refused_before_any_process_group(world_of_4):
    with pytest.raises(unison.DeclaredRefusal, match="declare no tensor-parallel plan") as info:
        _fit(mlp())
    assert info.value.feature == "no_tensor_parallel_plan" and "tp_plan" in info.value.fix
    assert not torch.distributed.is_initialized()
    ownership = unison.PluginManager().strategies.create("fsdp_tp").ownership
    assert ownership.refusal("no_tensor_parallel_plan") and ownership.mesh.names == ("dp", "tp")


@pytest.mark.parametrize(
    ("plan", "match"),
    [
        ({"0": "sequence_parallel"}, "style 'sequence_parallel'"),
        ({"9": "colwise"}, "matches no submodule"),
        ({"1": "colwise"}, "a Tanh; fsdp_tp splits it as 'colwise', which takes an nn.Linear"),
        ({"0": "embedding_rowwise"}, "a Linear; fsdp_tp splits it as 'embedding_rowwise', which takes an nn.Embedding"),
        ({"4": "colwise"}, "splits 1 features, not divisible by tp_size=2"),
    ],
)
def test_a_plan_that_cannot_run_is_refused_naming_the_entry(world_of_4, plan, match):
    model = mlp()
    model.tp_plan = plan
    with pytest.raises(unison.ConfigurationError, match=match):
        _fit(model)
    assert not torch.distributed.is_initialized()


def test_hugging_face_plans_and_patterns_resolve():
    from unison.contract.tensor_parallel import resolve_plan, tensor_parallel_plan

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(4, 8)
            self.down = torch.nn.Linear(8, 4)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Block(), Block()])
    model.config = type("Config", (), {"base_model_tp_plan": {"layers.*.up": "colwise", "layers.*.down": "rowwise"}})
    plan = tensor_parallel_plan(model)
    assert resolve_plan(model, plan, 2, who="fsdp_tp") == {
        "layers.0.up": "colwise",
        "layers.1.up": "colwise",
        "layers.0.down": "rowwise",
        "layers.1.down": "rowwise",
    }
