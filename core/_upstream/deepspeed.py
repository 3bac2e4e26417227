"""DeepSpeed internals used by unison's strategies (verified against deepspeed 0.19.8).

Import and accelerator
    :func:`import_deepspeed`: DeepSpeed picks its accelerator once, at first import.
Pipeline engine (``deepspeed.runtime.pipe.engine.PipelineEngine``)
    :func:`run_train_schedule_without_step`: ``train_batch()`` minus its optimizer step
    (:func:`train_schedule_without_step`).
ZeRO-1/2 (``deepspeed.runtime.zero.stage_1_and_2``)
    :func:`fp32_partitions`, :func:`is_linked`, :func:`fragment`, :func:`fragment_group`:
    the fp32 master partitions and each parameter's ``_hp_mapping`` fragment link;
    :func:`local_grad_piece`: this rank's piece of a reduced gradient (one scalar all-reduce per norm).
ZeRO optimizers, any stage
    :func:`keep_client_optimizer`: undo ZeRO's swap of a client ``torch.optim.Adagrad`` for a copy
    of its own.
ZeRO-3 (``deepspeed.runtime.zero.stage3`` / ``partition_parameters``)
    :func:`fp32_partitions`, :func:`is_partitioned`, :func:`local_partition`,
    :func:`partition_group`, :func:`kept_whole`: the attributes ZeRO-3 puts on parameters.

Process-group caches (``deepspeed.utils.groups``)
    :func:`forget_process_groups`: DeepSpeed caches the groups it clones from
    the world; a later run in the same process, on a new world, must not reuse them.

Public DeepSpeed APIs (``deepspeed.initialize``, ``deepspeed.utils.safe_get_full_*``,
``engine.backward/step/save_checkpoint``...) are used directly by the strategies.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from unison._upstream import warn_if_unverified

VERIFIED_VERSION = "0.19.8"


def import_deepspeed(device: torch.device | None = None) -> Any:
    """Import DeepSpeed, choosing its CPU accelerator on a CPU device.

    DeepSpeed picks its accelerator once, at first import, from
    ``DS_ACCELERATOR`` or by probing; a CPU run must therefore say ``cpu``
    before that import. An accelerator that disagrees with the device unison
    chose is an error, not a silent fallback.
    """
    if device is not None and device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    warn_if_unverified("deepspeed", VERIFIED_VERSION, __name__)
    if device is not None and get_accelerator().device_name() != device.type:
        raise RuntimeError(
            f"DeepSpeed's accelerator is {get_accelerator().device_name()!r} but unison trains on {device.type!r}; "
            f"set DS_ACCELERATOR={device.type} before deepspeed is first imported"
        )
    if device is not None and device.type == "cpu":
        _skip_shm_comm_op(deepspeed)
    return deepspeed


def _skip_shm_comm_op(deepspeed: Any) -> None:
    """Keep DeepSpeed's CPU backend from compiling its shared-memory comm op on a training run.

    ``deepspeed.comm`` builds ``deepspeed_shm_comm`` (a C++ extension: minutes of
    compiling the first time, silently) whenever it starts on the CPU accelerator,
    if the op's builder reports itself compatible. The op serves only
    ``inference_all_reduce`` (tensor-parallel inference); every collective of
    training (ZeRO's reduce-scatters, all-gathers and all-reduces, the pipeline's
    sends) goes through ``torch.distributed`` either way, so marking it
    incompatible changes no result. ``deepspeed.ops.__compatible_ops__`` is the
    table ``build_shm_op`` consults (one dict per process, probed once).
    """
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


# --------------------------------------------------------------------------- #
# Pipeline engine
# --------------------------------------------------------------------------- #


def train_schedule_without_step(micro_batches: int, stages: int, stage_id: int) -> Any:
    """DeepSpeed's ``TrainSchedule`` (1F1B) for one stage, with its ``OptimizerStep`` instructions removed."""
    from deepspeed.runtime.pipe import schedule

    class TrainWithoutStep(schedule.TrainSchedule):
        def steps(self) -> Any:
            for commands in super().steps():
                yield [c for c in commands if not isinstance(c, schedule.OptimizerStep)]

    return TrainWithoutStep(micro_batches=micro_batches, stages=stages, stage_id=stage_id)


def run_train_schedule_without_step(engine: Any, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Run the engine's ``TrainSchedule`` (forwards, backwards, ``ReduceGrads``) without ``OptimizerStep``.

    ``PipelineEngine.train_batch()`` would also clip, step and zero the
    gradients inside the same call; the trainer must see the global norm,
    fire its hooks and step the optimizer itself. This is ``train_batch()``'s
    own body (deepspeed 0.19.8, runtime/pipe/engine.py) with the schedule's
    ``OptimizerStep`` instructions filtered out and without its loss
    aggregation and logging.
    """
    engine.set_dataiterator(iter(micro_batches))
    engine.module.train()
    engine.total_loss = None
    # PRIVATE PipelineEngine._compute_loss: train_batch() sets it so that the last
    # stage calls the loss function in its forward instruction.
    engine._compute_loss = True
    # PRIVATE PipelineEngine._exec_schedule: the instruction interpreter train_batch()
    # calls; there is no public way to run a schedule.
    engine._exec_schedule(train_schedule_without_step(engine.micro_batches, engine.num_stages, engine.stage_id))


# --------------------------------------------------------------------------- #
# ZeRO optimizers: fp32 master partitions
# --------------------------------------------------------------------------- #


def fp32_partitions(zero_optimizer: Any, stage: int) -> list[torch.Tensor]:
    """This rank's flat fp32 master partitions: the tensors the client optimizer's state is keyed by.

    Undocumented attributes: ``fp32_partitioned_groups_flat`` (ZeRO-3) and
    ``single_partition_of_fp32_groups`` (ZeRO-1/2), one flat tensor per
    parameter group (ZeRO-3: per sub-group). The client optimizer steps them.
    """
    warn_if_unverified("deepspeed", VERIFIED_VERSION, __name__)
    if stage == 3:
        return list(zero_optimizer.fp32_partitioned_groups_flat)
    return list(zero_optimizer.single_partition_of_fp32_groups)


@dataclass(frozen=True)
class Fragment:
    """Where this rank's piece of one parameter lives in the ZeRO-1/2 fp32 master partition."""

    #: Index of the parameter group (and of its flat partition in :func:`fp32_partitions`).
    group_index: int
    #: Offset and length of the piece in the flattened parameter.
    param_start: int
    param_numel: int
    #: Offset and length of the piece in the flat partition.
    partition_start: int
    partition_numel: int


def is_linked(param: torch.nn.Parameter) -> bool:
    """Whether ZeRO-1/2 linked ``param`` to its fp32 master (false for parameters it does not train)."""
    # PRIVATE param._hp_mapping: set by deepspeed.utils.mixed_precision_linkage.link_hp_params
    # on every parameter the ZeRO-1/2 optimizer trains (None on ranks holding no piece of it).
    return hasattr(param, "_hp_mapping")


def fragment(param: torch.nn.Parameter) -> Fragment | None:
    """This rank's piece of a linked parameter, or ``None`` (not linked, or no piece on this rank).

    DeepSpeed's own accessors (``safe_get_full_optimizer_state``) read a view
    linked once, after the first step, and raise for a state key that view
    missed (measured: a tied-weight model on ZeRO-2); the addresses below are
    what they read.
    """
    # PRIVATE param._hp_mapping (a deepspeed.utils.tensor_fragment.tensor_fragment).
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return None
    lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
    return Fragment(mapping.param_group_index, lp.start, lp.numel, hp.start, hp.numel)


def fragment_group(param: torch.nn.Parameter) -> Any:
    """The process group over which a linked parameter's pieces are spread."""
    # PRIVATE param._dp_group: set beside _hp_mapping by link_hp_params.
    return param._dp_group


# --------------------------------------------------------------------------- #
# ZeRO-3 parameter attributes
# --------------------------------------------------------------------------- #


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` is a ZeRO-3 partitioned parameter (a placeholder outside the engine)."""
    # ds_id: the id ZeRO-3's partition_parameters gives every parameter it converts.
    return hasattr(param, "ds_id")


def local_partition(param: torch.Tensor) -> torch.Tensor:
    """This rank's padded flat slice of a ZeRO-3 parameter (``ds_tensor``), in the parameter's dtype."""
    return param.ds_tensor  # ZeRO-3 attribute: the partition this rank stores


def partition_group(param: torch.Tensor) -> Any:
    """The process group a ZeRO-3 parameter is partitioned over (``ds_process_group``)."""
    return param.ds_process_group


def kept_whole(param: torch.Tensor) -> bool:
    """Whether ZeRO-3 keeps this parameter whole on every rank (``ds_persist``: small parameters)."""
    return bool(getattr(param, "ds_persist", False))


def local_grad_piece(param: torch.nn.Parameter) -> tuple[torch.Tensor | None, Any]:
    """This rank's piece of ``param``'s reduced gradient and the group the pieces are spread over.

    Follows ``deepspeed.utils.safe_get_full_grad`` case by case, minus its
    gather: the pieces of all ranks are disjoint and cover the parameter, so
    the sum of their squares over the group is the squared norm of the full
    gradient, with one scalar all-reduce instead of one collective of the
    parameter's size per parameter. Valid after the boundary backward and
    before ``engine.step()``. The group is ``None`` when the piece is the
    whole gradient, equal on every rank (``param.grad`` is set, ZeRO-1); the
    piece is ``None`` when this rank holds none.

    * a bf16 accumulation buffer (``_hp_grad``) or a linked ZeRO-1/2
      parameter: the fragment ``get_full_hp_grad`` itself reads (PRIVATE
      ``_hp_mapping.get_lp_grad_fragment``; of a whole bf16 buffer only the owned
      fragment counts);
    * ZeRO-3: the public ``safe_get_local_grad`` (the padded local fp32
      partition; the padding is cut off here).
    """
    # PRIVATE ``_hp_mapping``/``_hp_grad``: the attributes safe_get_full_grad itself reads to find the
    # piece; no public API returns the local piece without its gather.
    mapping = getattr(param, "_hp_mapping", None)
    if getattr(param, "_hp_grad", None) is None and param.grad is not None:
        return param.grad, None
    if is_partitioned(param):
        from deepspeed.utils import safe_get_local_grad

        group = partition_group(param)
        piece = safe_get_local_grad(param)
        if piece is None:
            return None, group
        piece = piece.flatten()
        start = torch.distributed.get_rank(group=group) * piece.numel()
        return piece.narrow(0, 0, max(0, min(piece.numel(), param.ds_numel - start))), group
    if not is_linked(param):
        return None, None
    group = fragment_group(param)
    if mapping is None:
        return None, group
    # PRIVATE ``_index_in_param_group``: the argument get_full_hp_grad passes to the same call.
    piece = mapping.get_lp_grad_fragment(param._index_in_param_group).flatten()
    address = mapping.lp_fragment_address
    if piece.numel() == param.numel():  # a whole bf16 accumulation buffer: only the owned fragment
        piece = piece.narrow(0, address.start, address.numel)
    return piece, group


def keep_client_optimizer(zero_optimizer: Any, client: torch.optim.Optimizer, stage: int) -> bool:
    """Make ZeRO step the client optimizer again where it swapped in its own; return whether it had.

    ZeRO-1/2 and ZeRO-3 (``initialize_optimizer_states`` in ``stage_1_and_2.py`` and
    ``stage3.py``, deepspeed 0.19.8) replace a client ``torch.optim.Adagrad`` (or any subclass)
    with ``torch.optim.Adagrad(flat_partitions, **client.defaults)``, because Adagrad creates its
    state in its constructor and the partitions did not exist then. The copy has one parameter
    group with the constructor's defaults, so the client's parameter groups (their lr, weight
    decay), an LR scheduler built on the client, and a subclass's own step are silently ignored,
    and the client's state stays keyed by the module's parameters, which ZeRO does not step
    (measured: the loss leaves single's after the first step, on every stage).

    The client's parameter groups already hold the flat partitions (ZeRO put them there, as for
    every client optimizer), so the client takes the copy's place, with the state the copy's
    constructor created for each partition: what the client's constructor creates for a
    parameter (``sum`` filled with ``initial_accumulator_value``, ``step`` 0). The client's state
    for the module's parameters is dropped: nothing steps those tensors. ZeRO-1/2 linked each
    parameter to its fp32 partition right after the swap, over the copy's one group only (measured:
    ``AttributeError: '_hp_mapping'`` at the first step with two groups); the links are made again
    over the client's groups.
    """
    # PRIVATE DeepSpeedZeroOptimizer.optimizer / DeepSpeedZeroOptimizer_Stage3.optimizer: the
    # optimizer ZeRO steps over its flat fp32 partitions; no public API exposes or sets it.
    swapped = getattr(zero_optimizer, "optimizer", client)
    if swapped is client:
        return False
    state = {flat: swapped.state[flat] for flat in fp32_partitions(zero_optimizer, stage) if flat in swapped.state}
    client.state.clear()
    client.state.update(state)
    zero_optimizer.optimizer = client
    if stage in (1, 2):
        # PRIVATE DeepSpeedZeroOptimizer._link_all_hp_params, _create_param_mapping,
        # _create_optimizer_mapping, _param_slice_mappings: what its constructor runs after
        # initialize_optimizer_states, once per group of ``optimizer.param_groups``.
        zero_optimizer._link_all_hp_params()
        # PRIVATE (as above): the parameter -> fp32 fragment addresses, per group.
        zero_optimizer._param_slice_mappings = zero_optimizer._create_param_mapping()
        if zero_optimizer.cpu_offload:
            # PRIVATE (as above): each offloaded parameter's link back to the ZeRO optimizer.
            zero_optimizer._create_optimizer_mapping()
    return True


def forget_process_groups() -> None:
    """Drop DeepSpeed's cached process groups (as ``deepspeed.comm.destroy_process_group`` does).

    unison's trainer destroys the world it created with ``torch.distributed``;
    DeepSpeed only clears its module-level group cache when the world is
    destroyed through ``deepspeed.comm``, so a second run in the same process
    would hand ZeRO a group of the destroyed world. DeepSpeed rebuilds the
    cache on the next ``deepspeed.initialize``.
    """
    from deepspeed.utils import groups

    # PRIVATE deepspeed.utils.groups._release_process_group_references: what
    # deepspeed.comm.destroy_process_group calls after destroying the world; the
    # public path would destroy the trainer's world a second time.
    groups._release_process_group_references(group=None)


__all__ = [
    "VERIFIED_VERSION",
    "Fragment",
    "forget_process_groups",
    "fp32_partitions",
    "fragment",
    "fragment_group",
    "import_deepspeed",
    "is_linked",
    "is_partitioned",
    "keep_client_optimizer",
    "kept_whole",
    "local_grad_piece",
    "local_partition",
    "partition_group",
    "run_train_schedule_without_step",
    "train_schedule_without_step",
]
