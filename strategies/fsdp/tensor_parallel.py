"""``fsdp_tp``: tensor parallel (DTensor ``parallelize_module``) on a ``tp`` mesh dimension, FSDP2 on ``dp``.

The world is a 2-D ``DeviceMesh`` ``(dp, tp)``, ``tp`` innermost (consecutive
ranks, the fast links on a real machine). Setup follows torchtitan's order:
tensor parallel first, on the ``tp`` sub-mesh, then ``fully_shard`` per unit
and at the root on the ``dp`` sub-mesh (FSDP2 composes with the TP DTensors:
a TP-split weight is sharded again over ``dp``).

Decisions:

* **The plan comes from the model, else from plugins**
  (:func:`unison.contract.tensor_parallel.tensor_parallel_plan`, with the run's plugins): the
  model's own ``tp_plan`` (a mapping or a method returning one) or Hugging Face's
  ``base_model_tp_plan`` (on the model or its ``config``), ``{submodule name or
  pattern: style}``, wins whole; a model without one gets the plans plugins register
  for its known block types (the ``unison_tensor_parallel_plan`` hook), composed
  under the blocks' qualified names. Patterns use Hugging Face's ``*`` for one path
  segment (``"layers.*.mlp.up_proj"``). Styles: ``"colwise"`` -> ``ColwiseParallel()``,
  ``"rowwise"`` -> ``RowwiseParallel()``, ``"colwise_gather_output"`` (Hugging Face's ``lm_head``) ->
  ``ColwiseParallel(output_layouts=Replicate())``, ``"embedding_rowwise"`` (its token embedding) ->
  ``RowwiseParallel(input_layouts=Replicate())``; every other Hugging Face style
  (``"colwise_rep"``, ``"sequence_parallel"``, ``"local_*"``, ...) is refused
  before any process group, naming it. No sequence or loss parallel: a
  ``RowwiseParallel`` output is replicated over ``tp``, so the user's
  ``loss_fn`` / ``training_step`` sees whole tensors.
* **A model without a plan is refused** (neither its own nor a plugin's) before
  any process group, and the refusal is declared (``Feature.NO_TENSOR_PARALLEL_PLAN``):
  there is no general way to guess which layers pair up.
* **Data.** ``tp`` ranks of one ``dp`` index compute on the same samples:
  ``data_parallel_size`` is ``world / tp_size``; validation's losses are
  reduced over the ``dp`` group, a step's in one all-reduce over the world to
  which the first ``tp`` rank of each replica adds them (``reports_step_losses``,
  plugin API 2.4; on the CPU it carries the stop flags too).
* **Accumulation** is the trainer's: ``no_sync()`` defers FSDP2's
  reduce-scatter over ``dp``. The ``tp`` collectives (all-reduce of a
  row-wise output, of a column-wise input gradient) are part of each
  forward and backward and cannot be deferred.
* **Global grad norm over every dimension.** Parameters live on two meshes:
  TP-split ones on ``(dp, tp)``, the others on ``dp`` only (whole, and equal,
  on every ``tp`` rank). Each group's norm is a DTensor whose ``full_tensor()``
  all-reduces the squared norm over the dimensions that split it and nowhere
  else; the groups are then combined.
* **State**: the module's own names, DTensor shards through DCP (reshardable:
  resumes under ``single``, ``fsdp``, ``hsdp``, ``zero3`` ...); the canonical
  export is ``full_tensor()`` of every DTensor.
* **Precision**: as ``fsdp`` for fp32, bf16-mixed (``MixedPrecisionPolicy``)
  and bf16-true. 16-mixed is declared unsupported: the loss scaler's DTensor
  path assumes one mesh for every gradient (see the declaration's reason).
"""

from __future__ import annotations

import math
from typing import Any

import pydantic
import torch

from unison.contract.env import DistEnv
from unison.contract.mesh import MeshDim, MeshLayout
from unison.contract.ownership import (
    AccumulationOwner,
    Feature,
    GradAccumulation,
    LossNormalisation,
    Ownership,
    PrecisionSupport,
    StateDictDeclaration,
    StateDictKind,
    WorldSizes,
)
from unison.contract.tensor_parallel import resolve_plan, tensor_parallel_plan
from unison.errors import DeclaredRefusal
from unison.strategies.fsdp.common import SHARDED_DCP, FSDPOptions, precision_table
from unison.strategies.fsdp.fsdp2 import FSDP2Strategy

#: Measured on CPU/gloo, world 4 (2 dp x 2 tp), torch 2.13; see tests/test_fsdp_tp.py.
_NOTES = (
    "world 4 (2x2), 32-true vs single (MLP with tp_plan, AdamW, accumulation 4, clipping at 0.5 that clips, StepLR, "
    "20 steps): max abs parameter difference 7.5e-8, grad norms rel 1e-7; its step-10 checkpoint resumed under "
    "single and under zero3 at world 2, and an fsdp checkpoint under fsdp_tp: within 1e-6 of the uninterrupted run",
    "No sequence or loss parallel: outside a colwise -> rowwise pair, activations are whole on every tp rank",
    "Tensor parallel and sharding mutate the user's module in place (parameters become DTensors)",
)


class FSDPTPOptions(FSDPOptions):
    """Options of ``fsdp_tp``: ``fsdp``'s, plus the tensor-parallel degree."""

    tp_size: int = pydantic.Field(default=2, ge=1)
    """Ranks that split each planned layer (the ``tp`` mesh dimension, innermost); the world is
    ``world_size / tp_size`` data-parallel groups. Every split dimension must be divisible by it."""


def fsdp_tp_mesh(tp_size: int) -> MeshLayout:
    return MeshLayout(
        (
            MeshDim(
                "dp",
                None,
                shards="parameters, gradients, optimizer state (FSDP2, dim 0); the samples of each micro-batch",
                collectives="all-gather of parameters per unit in forward and backward; reduce-scatter of "
                "gradients once per optimizer step (deferred by no_sync); validation's loss all-reduce; the "
                "step's losses in one all-reduce over the whole mesh (tp rank 0's, zeros on the others)",
            ),
            MeshDim(
                "tp",
                tp_size,
                shards="the planned Linear layers: colwise by output features, rowwise by input features",
                collectives="all-reduce of each rowwise output (forward) and colwise input gradient (backward), "
                "every micro-step; the grad-norm all-reduce of TP-split parameters",
            ),
        )
    )


class FSDPTPStrategy(FSDP2Strategy):
    """Tensor parallel on ``tp``, FSDP2 on ``dp`` (see the module docstring for the decisions)."""

    options_model = FSDPTPOptions
    options: FSDPTPOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._dp_group: Any = None

    @property
    def mesh_layout(self) -> MeshLayout:
        return fsdp_tp_mesh(self.options.tp_size)

    @property
    def ownership(self) -> Ownership:
        size = self.options.tp_size
        precision = dict(
            precision_table(
                "MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) on every FSDP unit, "
                "output_dtype=float32 at the root; TP collectives in bf16"
            )
        )
        precision["16-mixed"] = PrecisionSupport.unsupported(
            "not certified: the loss scaler's DTensor path (pytorch/pytorch#132816) makes found_inf a DTensor on "
            "the first parameter's mesh and unscales gradients in one foreach call per device, while fsdp_tp's "
            "gradients live on two meshes (dp for replicated layers, dp x tp for split ones)"
        )
        return Ownership(
            loss_normalisation=LossNormalisation(
                over=(
                    "dp: FSDP2's reduce-scatter averages; tp ranks hold parts of one replica's gradients, not replicas"
                )
            ),
            grad_accumulation=GradAccumulation(
                AccumulationOwner.TRAINER,
                "no_sync() calls set_requires_gradient_sync(False) on non-boundary micro-steps: the dp "
                "reduce-scatter runs once, at the boundary; tp collectives are part of every forward/backward",
            ),
            precision=precision,
            state_dict=StateDictDeclaration(
                kind=StateDictKind.SHARDED,
                format=SHARDED_DCP + "; TP-split weights as DTensors sharded over dp and tp",
                reshardable=True,
                canonical_export="full_tensor() of every DTensor in module.state_dict() (all-gather over dp and "
                "tp), cast to fp32, on CPU, on every rank",
            ),
            notes=_NOTES,
            refuses={
                Feature.NO_TENSOR_PARALLEL_PLAN: "fsdp_tp splits the layers the model's plan names; give the "
                'model tp_plan = {"submodule": "colwise" | "rowwise", ...} (or a Hugging Face '
                "base_model_tp_plan), register a plan for its block types with a plugin's "
                "unison_tensor_parallel_plan hook, or use fsdp / hsdp",
                Feature.TIED_WEIGHTS: "a weight tied between a TP-split layer and another module would be split "
                "one way and whole the other",
            },
            world_sizes=WorldSizes(
                minimum=size,
                multiple_of=size,
                reason=f"the world is data-parallel groups of tp_size={size} tensor-parallel ranks",
            ),
            mesh=self.mesh_layout,
        )

    # -- data: tp ranks of one dp index share samples ----------------------- #
    def data_parallel_size(self, world_size: int) -> int:
        return world_size // self.options.tp_size

    def data_parallel_rank(self, rank: int, world_size: int) -> int:
        return rank // self.options.tp_size

    def data_parallel_group(self) -> Any:
        return self._dp_group

    def reports_step_losses(self) -> bool | None:
        """The tensor-parallel ranks of a replica compute the same losses: the first reports them, in the
        trainer's one sum over the world (plugin API 2.4), which on the CPU also carries its stop flags."""
        assert self.env is not None
        return self.env.rank % self.options.tp_size == 0

    def validate_model(self, model: torch.nn.Module, settings: Any) -> None:
        super().validate_model(model, settings)
        plan = tensor_parallel_plan(model, self.plugins)
        if plan is None:
            # The declared refusal, raised where the model is known (before any process group).
            raise DeclaredRefusal(
                "model",
                f"strategy {self.name!r} declares it does not support "
                f"{Feature.NO_TENSOR_PARALLEL_PLAN.description}: {type(model).__name__} has none, and no "
                "plugin's unison_tensor_parallel_plan knows its blocks",
                self.ownership.refusal(Feature.NO_TENSOR_PARALLEL_PLAN) or "",
                feature=Feature.NO_TENSOR_PARALLEL_PLAN.value,
            )
        resolve_plan(model, plan, self.options.tp_size, who=self.name)

    def _shard_mesh(self, env: DistEnv, module: torch.nn.Module) -> Any:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        layout = self.mesh_layout
        mesh = init_device_mesh(env.device.type, layout.shape(env.world_size), mesh_dim_names=layout.names)
        styles = {
            "colwise": ColwiseParallel,
            "rowwise": RowwiseParallel,
            # Hugging Face's lm_head plan: whole logits on every tp rank, for the loss that follows.
            "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
            # Hugging Face's token-embedding plan: vocabulary rows split, each rank's lookups summed.
            "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        }
        plan = resolve_plan(
            module, tensor_parallel_plan(module, self.plugins) or {}, self.options.tp_size, who=self.name
        )
        parallelize_module(module, mesh["tp"], {name: styles[style]() for name, style in plan.items()})
        self._dp_group = mesh["dp"].get_group()
        return mesh["dp"]

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        assert self.module is not None
        from torch.distributed.tensor import DTensor

        params = [p for p in self.module.parameters() if p.grad is not None]
        # One norm per mesh (get_total_norm cannot stack DTensors of two meshes); full_tensor() reduces each
        # over the dimensions that split its gradients, then the squares add up.
        by_mesh: dict[Any, list[torch.Tensor]] = {}
        for p in params:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(key, []).append(p.grad)
        squares = 0.0
        for grads in by_mesh.values():
            norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            squares += float(norm) ** 2
        total = torch.tensor(math.sqrt(squares), dtype=torch.float32)
        if max_norm is not None:
            # torch.nn.utils.clip_grads_with_norm_'s coefficient, in fp32 as there; DTensor gradients of two
            # meshes take it as a plain number.
            coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for p in params:
                p.grad.mul_(float(coefficient))
        return total
