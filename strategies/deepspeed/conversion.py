"""ZeRO partitions <-> the canonical layout every torch strategy shares.

The canonical layout is a plain module and a plain client optimizer on CPU:
full fp32 parameters under the module's own names, optimizer state keyed by
parameter (what ``torch.distributed.checkpoint.state_dict`` names). ZeRO holds
neither: the client optimizer's state is keyed by this rank's flat fp32 master
partitions, ZeRO-3 parameters are placeholders, and bf16 weights are rounded
copies of the masters. :class:`ZeroCanonicalState` converts both ways:

* :meth:`~ZeroCanonicalState.full_state_dict`: canonical model state (collective);
* :meth:`~ZeroCanonicalState.shadow`: a plain CPU module + optimizer, filled from
  the partitions (collective) or empty, for DCP to write or read;
* :meth:`~ZeroCanonicalState.load`: a filled shadow written into this rank's partitions;
* :meth:`~ZeroCanonicalState.restore_fp32_masters`: exact fp32 masters after DeepSpeed
  built them from bf16/fp16-rounded weights.

Every access to ZeRO's internal layout goes through
:mod:`unison._upstream.deepspeed`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from unison._upstream import deepspeed as ds


def meta_skeleton(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device (no data copied).

    Tied parameters stay tied: the deepcopy memo maps each tensor once.
    """
    memo: dict[int, Any] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) not in memo:
            empty = torch.empty_like(tensor, device="meta")
            memo[id(tensor)] = (
                torch.nn.Parameter(empty, requires_grad=tensor.requires_grad)
                if isinstance(tensor, torch.nn.Parameter)
                else empty
            )
    return copy.deepcopy(module, memo)


def _padded_slice(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's slice of ``full`` as ZeRO-3 partitions it: flattened, zero-padded, fp32, on CPU."""
    group = ds.partition_group(param)
    rank, world = torch.distributed.get_rank(group=group), torch.distributed.get_world_size(group=group)
    part = ds.local_partition(param).numel()
    padded = torch.zeros(part * world, dtype=torch.float32, device=full.device)
    padded[: full.numel()] = full.flatten().float()
    return padded[rank * part : (rank + 1) * part]


class ZeroCanonicalState:
    """Converts one engine's ZeRO state to and from the canonical layout (see the module doc).

    Built in ``setup`` from what was taken *before* DeepSpeed touched the
    module: ``skeleton`` (:func:`meta_skeleton`: names, tied parameters) and
    ``group_names`` (each client-optimizer group's parameter names).
    """

    def __init__(
        self,
        stage: int,
        engine: Any,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        skeleton: torch.nn.Module,
        group_names: list[list[str]],
    ) -> None:
        self.stage, self.engine, self.module, self.optimizer = stage, engine, module, optimizer
        self.skeleton, self.group_names = skeleton, group_names

    def _masters(self) -> list[torch.Tensor]:
        return ds.fp32_partitions(self.engine.optimizer, self.stage)

    # -- ZeRO -> canonical ------------------------------------------------- #
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 parameters (the masters, not the bf16 copies) and buffers, on CPU (collective)."""
        deepspeed = ds.import_deepspeed()
        from deepspeed.utils import safe_get_full_fp32_param

        out: dict[str, torch.Tensor] = {}
        gathered: dict[int, torch.Tensor] = {}
        for name, value in self.module.state_dict(keep_vars=True).items():
            if isinstance(value, torch.nn.Parameter):
                key = id(value)
                if key not in gathered:  # tied weights: gather once
                    full = safe_get_full_fp32_param(value)
                    if full is None:
                        # Not trained by the optimizer (frozen): gather the
                        # ZeRO-3 partition or read the replicated tensor.
                        with deepspeed.zero.GatheredParameters([value], enabled=ds.is_partitioned(value)):
                            full = value.data.detach().clone()
                    gathered[key] = full
                value = gathered[key]
            detached = value.detach().float() if value.is_floating_point() else value.detach()
            out[name] = detached.cpu().clone()
        return out

    def shadow(self, *, with_state: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """A plain CPU copy of the module and of the client optimizer, in torch's own layout.

        The copy is built from the skeleton (same names, same tied
        parameters), so that torch.distributed.checkpoint writes and reads
        exactly the keys a plain module and optimizer have. Collective when
        ``with_state``: ZeRO partitions are gathered parameter by parameter on
        every rank.
        """
        skeleton = copy.deepcopy(self.skeleton).to_empty(device="cpu")
        names = dict(skeleton.named_parameters())
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [names[n] for n in group_names]}
            for group, group_names in zip(self.optimizer.param_groups, self.group_names)
        ]
        try:
            shadow = type(self.optimizer)(groups, **self.optimizer.defaults)
        except TypeError:  # defaults holding keys the constructor does not take
            shadow = type(self.optimizer)(groups)
        if not with_state:
            return skeleton, shadow
        targets = skeleton.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in self.full_state_dict().items():
                targets[name].copy_(tensor)
        module_params = dict(self.module.named_parameters())
        # Every flat partition holds the same state keys; one shows which
        # are elementwise (partition-shaped) and carries the scalars (step).
        flat, flat_state = next(
            ((f, self.optimizer.state[f]) for f in self._masters() if self.optimizer.state.get(f)), (None, {})
        )
        for group_names in self.group_names:
            for name in group_names:
                entry: dict[str, Any] = {}
                for key, value in flat_state.items():
                    if torch.is_tensor(value) and value.dim() > 0:
                        assert flat is not None  # a non-empty flat_state comes with its partition
                        if value.shape != flat.shape:
                            raise NotImplementedError(
                                f"optimizer state {key!r} is not elementwise; only elementwise optimizer state "
                                "(Adam's moments, SGD's momentum) converts to the canonical layout"
                            )
                        full = self._full_optimizer_state(module_params[name], key, flat)
                        if full is None:  # a frozen parameter given to the optimizer: no state
                            continue
                        entry[key] = full.detach().float().cpu().reshape(names[name].shape).clone()
                    else:
                        entry[key] = value.detach().cpu().clone() if torch.is_tensor(value) else value
                if any(torch.is_tensor(v) and v.dim() > 0 for v in entry.values()):
                    shadow.state[names[name]] = entry
        return skeleton, shadow

    def _full_optimizer_state(self, param: torch.nn.Parameter, key: str, flat: torch.Tensor) -> torch.Tensor | None:
        """One parameter's whole optimizer state ``key`` (collective on every rank).

        ZeRO-3 asks DeepSpeed. ZeRO-1/2 read this rank's fragment straight out
        of the client optimizer's state through the parameter's fragment
        address and sum the fragments over ranks (see
        :func:`~unison._upstream.deepspeed.fragment` for why not
        DeepSpeed's own getter, which would leave the other ranks waiting in
        the all-reduce).
        """
        if self.stage == 3:
            from deepspeed.utils import safe_get_full_optimizer_state

            return safe_get_full_optimizer_state(param, key)
        if not ds.is_linked(param):  # not trained by the ZeRO optimizer (frozen)
            return None
        buffer = torch.zeros(param.numel(), dtype=torch.float32, device=flat.device)
        piece = ds.fragment(param)
        if piece is not None:
            partition = self._masters()[piece.group_index]
            state = self.optimizer.state[partition][key]
            buffer.narrow(0, piece.param_start, piece.param_numel).copy_(
                state.narrow(0, piece.partition_start, piece.partition_numel)
            )
        torch.distributed.all_reduce(buffer, group=ds.fragment_group(param))
        return buffer.view(param.shape)

    # -- canonical -> ZeRO ------------------------------------------------- #
    @torch.no_grad()
    def load(self, skeleton: torch.nn.Module, shadow: torch.optim.Optimizer) -> None:
        """Write full parameters, buffers and optimizer state into this rank's ZeRO partitions."""
        saved = dict(skeleton.named_parameters())
        for name, buffer in self.module.named_buffers():
            buffer.copy_(skeleton.get_buffer(name).to(buffer.dtype))
        # State tensors must exist to be written into: ZeRO creates them at the
        # first step. Elementwise ones start as zeros, scalars are copied.
        keys: dict[str, Any] = {}
        for state in shadow.state.values():
            keys.update(state)
        masters = self._masters()
        for flat in masters:
            state = self.optimizer.state[flat]
            for key, value in keys.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    state.setdefault(key, torch.zeros_like(flat))
                else:
                    state[key] = value.clone() if torch.is_tensor(value) else value
        for name, param in self.module.named_parameters():
            value = saved[name].detach()
            state = shadow.state.get(saved[name], {})
            elementwise = {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0}
            if ds.is_partitioned(param):  # ZeRO-3: this rank's padded slice
                partition = ds.local_partition(param)

                def local(full: torch.Tensor, param: torch.Tensor = param, partition: torch.Tensor = partition) -> Any:
                    return _padded_slice(param, full).to(partition.device)

                partition.data.copy_(local(value).to(partition.dtype))
                if param.requires_grad:
                    from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

                    safe_set_local_fp32_param(param, local(value))
                    for key, tensor in elementwise.items():
                        safe_set_local_optimizer_state(param, local(tensor), key)
            else:  # ZeRO-1/2: whole parameters, fp32 master fragment on this rank
                param.data.copy_(value.to(param.device, param.dtype))
                piece = ds.fragment(param)
                if piece is None:
                    continue
                flat = masters[piece.group_index]
                targets = {None: flat, **{k: self.optimizer.state[flat][k] for k in elementwise}}
                sources = {None: value, **elementwise}
                for key, target in targets.items():
                    fragment = sources[key].flatten().float().narrow(0, piece.param_start, piece.param_numel)
                    target.narrow(0, piece.partition_start, piece.partition_numel).copy_(fragment.to(target.device))
        for group, loaded in zip(self.optimizer.param_groups, shadow.param_groups):
            group.update({k: v for k, v in loaded.items() if k != "params"})

    def restore_fp32_masters(self, exact: dict[str, torch.Tensor]) -> None:
        """Set each parameter's fp32 master (this rank's part) to its exact fp32 value.

        DeepSpeed casts the module to bf16/fp16 before it creates the fp32
        master copy, which would start the masters from rounded values.
        ZeRO-3 goes through the local-partition API: DeepSpeed's full-parameter
        setter narrows past the end of the last rank's padded partition when a
        parameter's size does not divide by the world size.
        """
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_local_fp32_param

        for name, param in self.module.named_parameters():
            if not param.requires_grad:
                continue
            value = exact[name].to(torch.float32)
            if ds.is_partitioned(param):
                safe_set_local_fp32_param(param, _padded_slice(param, value))
            else:
                safe_set_full_fp32_param(param, value)


__all__ = ["ZeroCanonicalState", "meta_skeleton"]
