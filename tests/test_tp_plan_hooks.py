"""Tensor-parallel plans registered by plugins for known block types (``unison_tensor_parallel_plan``).

A third-party plugin (tests/tp_plan_plugin.py, registered through ``UNISON_PLUGINS`` like an installed
one) plans a model that declares no plan, and ``fsdp_tp`` trains it at world 4 (2 dp x 2 tp) to within
1e-6 of ``single``; a model whose blocks no plugin knows is still refused before any process group; the
model's own plan wins over a plugin's; block plans compose under the blocks' qualified names.
"""

from __future__ import annotations

import pytest
import torch

import unison
from unison.contract.tensor_parallel import compose_block_plans, tensor_parallel_plan
from unison.launch.torchrun import spawn

from helpers import max_abs_diff, regression_data, train
from tp_plan_plugin import MY_BLOCK_PLAN, MyBlock, OtherBlock, Stack
from tp_worlds import plugin_planned_world

PLUGIN = "tp_plan_plugin"


@pytest.fixture
def plan_plugin(monkeypatch):
    """The third-party plugin, registered by every plugin manager of this process and of its workers."""
    monkeypatch.setenv("UNISON_PLUGINS", PLUGIN)


@pytest.mark.distributed
def test_fsdp_tp_trains_a_model_planned_by_a_plugin_like_single(plan_plugin):
    assert tensor_parallel_plan(Stack()) is None, "the model itself declares no plan"
    reference = train("single", model=Stack(), max_steps=8)
    assert max(h["grad_norm"] for h in reference["history"]) > 0.5, "clipping must actually clip"
    for rank in spawn(plugin_planned_world, 4, timeout=300):
        # The plugin's plan was applied: the blocks' Linear layers are split over tp (and sharded over dp),
        # the layers outside the blocks only sharded over dp.
        assert rank["meshes"]["layers.1.mlp.up.weight"] == ("dp", "tp")
        assert rank["meshes"]["layers.0.mlp.down.weight"] == ("dp", "tp")
        assert rank["meshes"]["head.weight"] == rank["meshes"]["embed.weight"] == ("dp",)
        assert max_abs_diff(rank["state"], reference["state"]) <= 1e-6
        for a, b in zip(rank["history"], reference["history"], strict=True):
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)


# --------------------------------------------------------------------------- #
# Before any process group
# --------------------------------------------------------------------------- #


@pytest.fixture
def world_of_4(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")


def _fit(model: torch.nn.Module) -> None:
    trainer = unison.Trainer(max_steps=1, strategy="fsdp_tp", global_batch_size=8, progress="off", loggers=False)
    trainer.fit(model, regression_data(), loss_fn=torch.nn.functional.mse_loss, optimizer=torch.optim.SGD)


def test_a_model_whose_blocks_no_plugin_knows_is_refused_naming_the_hook(plan_plugin, world_of_4):
    with pytest.raises(
        unison.DeclaredRefusal, match="no plugin's unison_tensor_parallel_plan knows its blocks"
    ) as info:
        _fit(Stack(OtherBlock))
    assert info.value.feature == "no_tensor_parallel_plan" and "unison_tensor_parallel_plan" in info.value.fix
    assert not torch.distributed.is_initialized()


def test_the_models_own_plan_wins_over_a_plugins(plan_plugin, world_of_4):
    pm = unison.PluginManager()
    model = Stack()
    assert tensor_parallel_plan(model, pm) == {"layers.0.mlp.up": "colwise", "layers.0.mlp.down": "rowwise"} | {
        "layers.1.mlp.up": "colwise",
        "layers.1.mlp.down": "rowwise",
    }
    model.tp_plan = {"layers.*.mlp.up": "colwise", "layers.*.mlp.down": "rowwise"}
    assert tensor_parallel_plan(model, pm) == model.tp_plan
    # Through the trainer: the model's plan is the one checked (its bad style is refused), the plugin's
    # valid plan for the same blocks is not used instead.
    model.tp_plan = {"layers.0.mlp.up": "sequence_parallel"}
    with pytest.raises(unison.ConfigurationError, match="style 'sequence_parallel'"):
        _fit(model)
    assert not torch.distributed.is_initialized()


def test_block_plans_compose_under_qualified_names():
    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = MyBlock()

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(MyBlock() for _ in range(11))
    model.outer = Outer()
    model.head = torch.nn.Linear(16, 1)
    asked: list[str] = []

    def plans(module: torch.nn.Module) -> dict[str, str] | None:
        asked.append(type(module).__name__)
        if isinstance(module, Outer):
            return {"inner.mlp.up": "colwise"}  # planned whole by the outer block: its inner block is not asked
        return dict(MY_BLOCK_PLAN) if isinstance(module, MyBlock) else None

    plan = compose_block_plans(model, plans)
    assert plan is not None
    # layers.1 and layers.10 stay apart (a name prefix is a whole segment)
    assert [k for k in plan if k.startswith("layers.1.")] == ["layers.1.mlp.up", "layers.1.mlp.down"]
    assert plan["layers.10.mlp.down"] == "rowwise" and len(plan) == 2 * 11 + 1
    assert plan["outer.inner.mlp.up"] == "colwise" and "outer.inner.mlp.down" not in plan
    assert asked.count("MyBlock") == 11 and asked.count("MLP") == 0  # nothing inside an answered block
    # The model itself may be the known block (no prefix); nothing known is no plan; an empty answer adds nothing.
    assert compose_block_plans(MyBlock(), plans) == MY_BLOCK_PLAN
    assert compose_block_plans(torch.nn.Linear(2, 2), plans) is None
    assert compose_block_plans(MyBlock(), lambda m: {}) is None
    with pytest.raises(unison.PluginError, match="returned a list for the MyBlock at '\\(the model\\)'"):
        compose_block_plans(MyBlock(), lambda m: ["mlp.up"])


def test_the_plugin_registered_last_plans_a_block_both_know():
    class Builtin:
        @unison.hookimpl
        def unison_tensor_parallel_plan(self, module):
            return {"mlp.up": "colwise", "mlp.down": "rowwise"} if isinstance(module, MyBlock) else None

    class Users:
        @unison.hookimpl
        def unison_tensor_parallel_plan(self, module):
            return {"mlp.up": "colwise"} if isinstance(module, MyBlock) else None

    pm = unison.PluginManager(plugins=[Builtin(), Users()], autoload=False)
    assert tensor_parallel_plan(MyBlock(), pm) == {"mlp.up": "colwise"}  # one answer, whole, not merged


def test_the_suites_transformer_block_is_planned_by_a_built_in_plugin():
    from unison.conformance.models import TRANSFORMER_BLOCK_TP_PLAN, build_model

    model = build_model("block")
    assert tensor_parallel_plan(model) is None  # no plan of its own
    plan = tensor_parallel_plan(model, unison.PluginManager())
    assert plan == {f"1.{name}": style for name, style in TRANSFORMER_BLOCK_TP_PLAN.items()}
    assert tensor_parallel_plan(model, unison.PluginManager(blocked=["conformance_models"])) is None
