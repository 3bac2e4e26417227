"""What the worlds of tests/test_fsdp_tp.py run: fsdp_tp at world 4 (2 dp x 2 tp)."""

from __future__ import annotations

from typing import Any

import torch

from fsdp_worlds import _fit
from helpers import mlp, regression_data, train
from hsdp_worlds import CollectiveCounter


def planned_mlp() -> torch.nn.Module:
    """helpers.mlp with a tensor-parallel plan: the first Linear split by output, the second by input
    features (Megatron's MLP pairing), the head replicated over tp."""
    model = mlp()
    model.tp_plan = {"0": "colwise", "2": "rowwise"}
    return model


def fsdp_tp_world(ckpt_root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["fp32"] = train("fsdp_tp", model=planned_mlp())
    own = f"{ckpt_root}/fsdp_tp"
    train("fsdp_tp", model=planned_mlp(), max_steps=10, checkpoint_dir=own, record=False)
    out["resumed"] = train("fsdp_tp", model=planned_mlp(), max_steps=20, checkpoint_dir=own, ckpt_path="last")
    train("fsdp", max_steps=10, checkpoint_dir=f"{ckpt_root}/fsdp", record=False)
    out["from_fsdp"] = train(
        "fsdp_tp", model=planned_mlp(), max_steps=20, ckpt_path=f"{ckpt_root}/fsdp/step-00000010", record=False
    )
    # Collectives inside the micro-steps with accumulation 1 and 4: the dp reduce-scatter is deferred.
    counts = {}
    for accumulate in (1, 4):
        counter = CollectiveCounter()
        _fit("fsdp_tp", counter, model=planned_mlp(), data=regression_data(), accumulate_grad_batches=accumulate,
             global_batch_size=32, max_steps=3)  # fmt: skip
        counts[accumulate] = counter.per_step
    out["collectives"] = counts
    return out


def plugin_planned_world() -> dict[str, Any]:
    """fsdp_tp on a model that has no plan of its own: tests/tp_plan_plugin.py (in ``UNISON_PLUGINS``) plans
    its blocks. Returns the run and, per parameter, the mesh dimensions it ended up split over."""
    from torch.distributed.tensor import DTensor

    from tp_plan_plugin import Stack

    model = Stack()
    out = train("fsdp_tp", model=model, max_steps=8)
    out["meshes"] = {
        name: p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else None for name, p in model.named_parameters()
    }
    return out
