"""`pipeline` over a module with declared split points trains like `single`, under the module's own names."""

from __future__ import annotations

import pytest
import torch

import unison
from unison.launch.torchrun import spawn

from helpers import max_abs_diff, regression_data, train
from split_points_worlds import Regressor, split_points_run


@pytest.mark.distributed
def test_declared_split_points_match_single():
    reference = train("single", model=Regressor())
    world = spawn(split_points_run, 2, timeout=180)
    for rank in world:
        assert sorted(rank["state"]) == sorted(Regressor().state_dict())
        assert max_abs_diff(rank["state"], reference["state"]) <= 1e-5
        assert [h["loss"] for h in rank["history"]] == pytest.approx(
            [h["loss"] for h in reference["history"]], rel=1e-6
        )
        assert rank["hooks"] == reference["hooks"]


class StateOutsideLayers(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))


class UnknownLayer(Regressor):
    pipeline_layers = ("embed", "trunk", "head")


@pytest.mark.parametrize(
    "model,match",
    [
        (StateOutsideLayers, r"outside its declared layers: \['scale'\]"),
        (UnknownLayer, r"not children: \['trunk'\]"),
    ],
)
def test_bad_split_points_are_refused_before_training(monkeypatch, model, match):
    monkeypatch.setenv("WORLD_SIZE", "2")
    trainer = unison.Trainer(max_steps=1, strategy="pipeline", global_batch_size=8, accumulate_grad_batches=2)
    with pytest.raises(unison.ConfigurationError, match=match):
        trainer.fit(
            model(),
            regression_data(),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        )
    assert not torch.distributed.is_initialized()


def test_deepspeed_pipeline_refuses_declared_split_points(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    trainer = unison.Trainer(max_steps=1, strategy="deepspeed_pipeline", global_batch_size=8, accumulate_grad_batches=2)
    with pytest.raises(unison.ConfigurationError, match="use strategy 'pipeline'"):
        trainer.fit(
            Regressor(),
            regression_data(),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        )
