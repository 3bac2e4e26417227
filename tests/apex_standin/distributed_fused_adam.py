"""Stand-in for ``apex.contrib.optimizers.distributed_fused_adam`` that runs on the CPU over gloo.

Not apex. It exists because apex's ``DistributedFusedAdam`` is CUDA-only and
this machine has no GPU: it lets the tests drive unison's
``apex_distributed_fused_adam`` strategy through real training runs and check
which calls the strategy makes, when and with which arguments.

It follows apex's source at ``6424da3b4faa6c8f062da4a48c424fff3f02d42d``
(``apex/contrib/optimizers/distributed_fused_adam.py``) wherever behaviour is
observable by a caller:

* the constructor's signature and checks, ``defaults``, process groups
  (``process_group`` = distributed x redundant), the broadcast of parameters
  from the group's root at construction;
* the bucket layout: parameters split into fragments in buckets of
  ``bucket_cap_mb``, each bucket sharded over the distributed group, fragments
  aligned to 128 bytes, parameter state initialised lazily in the order
  gradients arrive;
* gradient flow: hooks on each parameter's gradient accumulator copy
  ``param.grad`` into its bucket and set it to ``None``; a full bucket is
  reduce-scattered (``ReduceOp.AVG``) over the distributed group and
  all-reduced over the redundant group when ``overlap_grad_sync``; ``no_sync()``
  turns the copy and the overlap off so gradients add up in ``param.grad``;
  ``grad_sync()`` copies what is left and syncs every bucket; reduced shards
  of several syncs in one step add up;
* ``grad_norm()`` (cached; times the pending gradient scale),
  ``clip_grad_norm(max_norm)`` (scale folded into the next step),
  ``unscale_grads(inv_scale=..., grad_scaler=...)``, ``step(closure, *, grad_scaler)``
  (Adam on the local shard with apex's kernel formula, then an all-gather of
  the parameters), ``zero_grad(set_to_none=False)``;
* ``state_dict()`` in the default format 2 (every tensor gathered on every rank,
  on the CPU, keyed like a torch optimizer, one global ``step``) and
  ``load_state_dict`` of it at any parallel configuration.

What differs: it accepts a CPU ``device`` (apex refuses anything but CUDA);
communication is synchronous (no side streams); ``pipeline_size``,
``contiguous_param_buffer`` and ``contiguous_grad_buffer`` are accepted and do
not change the layout; the experimental or CUDA-only modes
(``overlap_param_sync``, ``store_param_remainders``, ``with_scaled_states``,
``nccl_ub``, ``capturable``), non-fp32 dtypes and the deprecated format-1 state
dict raise ``NotImplementedError``.

For the tests it also records every public call in :attr:`DistributedFusedAdam.calls`
and the constructor's keyword arguments in ``init_kwargs`` (apex has neither).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import itertools
import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from apex_standin.optimizers import adam_update

STANDIN = True


def _round_to_multiple(number: int, multiple: int, round_up: bool = True) -> int:
    return (number + multiple - 1 if round_up else number) // multiple * multiple


def _quiet(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # torch 2.13 marks the *_tensor collectives deprecated; apex calls them.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return fn(*args, **kwargs)


class DistributedFusedAdam(torch.optim.Optimizer):
    """apex's ``DistributedFusedAdam`` interface and semantics over gloo (see the module docstring)."""

    @dataclass
    class ParameterFragment:
        param_group_id: int
        param_id: int
        bucket_id: int
        param_range: tuple[int, int]
        bucket_range: tuple[int, int]
        in_local_shard: bool
        shard_range: tuple[int, int] | None
        shard_bucket_range: tuple[int, int] | None
        shard_param_range: tuple[int, int] | None

    class StateBucket:
        def __init__(
            self, bucket_size: int, shard_size: int, dtype: torch.dtype, device: torch.device, store_params: bool
        ) -> None:
            self.bucket_size, self.shard_size, self.dtype = bucket_size, shard_size, dtype
            self.grad_sync_dtype = self.param_sync_dtype = dtype
            self.filled_size = 0
            self.able_to_fill = True
            self.contiguous_buffer_offset = 0
            self.fragments: list[DistributedFusedAdam.ParameterFragment] = []
            self.params_shard = torch.zeros([shard_size], dtype=dtype, device=device) if store_params else None
            self.param_remainders_shard = None
            self.exp_avg_shard = torch.zeros([shard_size], dtype=dtype, device=device)
            self.exp_avg_sq_shard = torch.zeros([shard_size], dtype=dtype, device=device)

    class GradientStatus(enum.Enum):
        READY = enum.auto()
        PARTIALLY_FILLED = enum.auto()
        FULLY_FILLED = enum.auto()
        SYNCING = enum.auto()

    class GradientBucket:
        def __init__(self) -> None:
            self.grads_shard: torch.Tensor | None = None
            self.grads_bucket: torch.Tensor | None = None
            self.sync_grads_shard: torch.Tensor | None = None
            self.status = DistributedFusedAdam.GradientStatus.READY
            self.grads_generated: set[torch.nn.Parameter] = set()

    _step_supports_amp_scaling = True
    _custom_amp_unscale_grads = True

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        amsgrad=False,
        dtype=torch.float32,
        grad_sync_dtype=None,
        param_sync_dtype=None,
        device="cuda",
        process_group=None,
        distributed_process_group=None,
        redundant_process_group=None,
        average_grad_sync=True,
        overlap_grad_sync=True,
        overlap_param_sync=False,
        bucket_cap_mb=100.0,
        pipeline_size=2,
        contiguous_param_buffer=False,
        contiguous_grad_buffer=False,
        store_params=True,
        store_param_remainders=False,
        with_scaled_states=False,
        nccl_ub=False,
        capturable=False,
    ):
        self.init_kwargs = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            adam_w_mode=adam_w_mode,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            dtype=dtype,
            grad_sync_dtype=grad_sync_dtype,
            param_sync_dtype=param_sync_dtype,
            device=device,
            process_group=process_group,
            distributed_process_group=distributed_process_group,
            redundant_process_group=redundant_process_group,
            average_grad_sync=average_grad_sync,
            overlap_grad_sync=overlap_grad_sync,
            overlap_param_sync=overlap_param_sync,
            bucket_cap_mb=bucket_cap_mb,
            pipeline_size=pipeline_size,
            contiguous_param_buffer=contiguous_param_buffer,
            contiguous_grad_buffer=contiguous_grad_buffer,
            store_params=store_params,
            store_param_remainders=store_param_remainders,
            with_scaled_states=with_scaled_states,
            nccl_ub=nccl_ub,
            capturable=capturable,
        )
        self.calls: list[tuple[str, dict[str, Any]]] = []
        for flag in ("overlap_param_sync", "store_param_remainders", "with_scaled_states", "nccl_ub", "capturable"):
            if self.init_kwargs[flag]:
                raise NotImplementedError(f"apex stand-in: {flag}=True is not modelled")
        if amsgrad:
            raise RuntimeError("DistributedFusedAdam does not support the AMSGrad variant.")
        if dtype != torch.float32 or grad_sync_dtype not in (None, dtype) or param_sync_dtype not in (None, dtype):
            raise NotImplementedError("apex stand-in: only fp32 state and communication are modelled")

        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.dtype = self.grad_sync_dtype = self.param_sync_dtype = dtype
        # apex: torch.device("cuda", current_device()) and nothing else.
        self.device = torch.device(device)

        self.process_group = dist.distributed_c10d._get_default_group() if process_group is None else process_group
        self.distributed_process_group = (
            self.process_group if distributed_process_group is None else distributed_process_group
        )
        self.redundant_process_group = redundant_process_group
        self.process_group_size = dist.get_world_size(self.process_group)
        self.distributed_rank = dist.get_rank(self.distributed_process_group)
        self.distributed_size = dist.get_world_size(self.distributed_process_group)
        self.redundant_size = 1 if redundant_process_group is None else dist.get_world_size(redundant_process_group)
        if self.process_group_size != self.distributed_size * self.redundant_size:
            raise RuntimeError(
                "Invalid process group configuration "
                f"(process group size = {self.process_group_size}, "
                f"distributed process group size = {self.distributed_size}, "
                f"redundant process group size = {self.redundant_size})"
            )
        self.process_group_root = dist.get_global_rank(self.process_group, 0)

        self.average_grad_sync = average_grad_sync
        self.greedy_grad_copy = True
        self.overlap_grad_sync = overlap_grad_sync
        self.overlap_param_sync = False
        self.pipeline_size = pipeline_size
        self.store_params = store_params
        self.contiguous_param_buffer = contiguous_param_buffer
        self.contiguous_grad_buffer = contiguous_grad_buffer

        dtype_size = torch.finfo(self.grad_sync_dtype).bits // 8
        self.alignment = 128 // dtype_size
        self.bucket_cap_mb = bucket_cap_mb
        bucket_size = 1024 * 1024 * bucket_cap_mb / dtype_size
        shard_size = int(bucket_size / self.distributed_size)
        shard_size = _round_to_multiple(shard_size, self.alignment, round_up=False)
        self.default_shard_size = max(shard_size, self.alignment)

        self.state["buckets"] = []
        self.state["step"] = 0
        self._grads_buckets: dict[int, DistributedFusedAdam.GradientBucket] = collections.defaultdict(
            self.GradientBucket
        )
        self._grad_scale = torch.full([], 1.0, dtype=torch.float32, device=self.device)
        self._grad_norm: torch.Tensor | None = None
        self._in_no_sync = False
        self._broadcast_params()
        self._lock = threading.Lock()
        self._register_post_backward_hooks()

    # -- the call log (stand-in only) ---------------------------------------- #
    def _log(self, name: str, **args: Any) -> None:
        self.calls.append((name, args))

    # -- set-up ---------------------------------------------------------------- #
    @torch.no_grad()
    def _broadcast_params(self) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                dist.broadcast(param, src=self.process_group_root, group=self.process_group)
        self._log("broadcast_params")

    def parameters(self) -> Iterable[torch.nn.Parameter]:
        return itertools.chain.from_iterable(group["params"] for group in self.param_groups)

    def parameter(self, fragment: DistributedFusedAdam.ParameterFragment) -> torch.nn.Parameter:
        return self.param_groups[fragment.param_group_id]["params"][fragment.param_id]

    def _make_post_backward_hook(self, param: torch.nn.Parameter, param_group_id: int, param_id: int) -> Callable:
        def post_backward_hook(*unused: Any) -> None:
            with self._lock:
                need_to_initialize = "fragments" not in self.state[param]
                if need_to_initialize:
                    self._init_param_state(param, param_group_id, param_id)
                if self.greedy_grad_copy:
                    self._grad_copy(param)
                    if self.overlap_grad_sync:
                        self._try_start_bucket_grad_sync(params=[param], ignore_last_bucket=need_to_initialize)

        return post_backward_hook

    def _register_post_backward_hooks(self) -> None:
        self._grad_accs = []
        for param_group_id, group in enumerate(self.param_groups):
            for param_id, param in enumerate(group["params"]):
                if param.requires_grad:
                    grad_acc = param.expand_as(param).grad_fn.next_functions[0][0]
                    grad_acc.register_hook(self._make_post_backward_hook(param, param_group_id, param_id))
                    self._grad_accs.append(grad_acc)

    def init_params(self, params: Iterable[torch.nn.Parameter] | None = None) -> None:
        params = self.parameters() if params is None else params
        params = [p for p in params if "fragments" not in self.state[p]]
        ids = {p: (gid, pid) for gid, g in enumerate(self.param_groups) for pid, p in enumerate(g["params"])}
        for param in params:
            if param in ids:
                self._init_param_state(param, *ids[param])

    def _init_param_state(self, param: torch.nn.Parameter, param_group_id: int, param_id: int) -> None:
        """apex's fragment layout: fill the last bucket, aligned; open a new bucket when it is full."""
        if "fragments" in self.state[param]:
            return
        self.state[param]["fragments"] = []
        buckets = self.state["buckets"]

        def make_bucket() -> None:
            shard = self.default_shard_size
            buckets.append(
                self.StateBucket(shard * self.distributed_size, shard, self.dtype, self.device, self.store_params)
            )

        if not buckets:
            make_bucket()
        param_start, param_size = 0, param.numel()
        while param_start < param_size:
            bucket_id = len(buckets) - 1
            bucket = buckets[bucket_id]
            bucket_start = _round_to_multiple(bucket.filled_size, self.alignment, round_up=True)
            fragment_size = min(param_size - param_start, bucket.bucket_size - bucket_start)
            if fragment_size <= 0 or not bucket.able_to_fill:
                make_bucket()
                continue
            param_end, bucket_end = param_start + fragment_size, bucket_start + fragment_size
            shard_size, shard_id = bucket.shard_size, self.distributed_rank
            shard_start = min(max(bucket_start - shard_size * shard_id, 0), shard_size)
            shard_end = min(max(bucket_end - shard_size * shard_id, 0), shard_size)
            in_local_shard = shard_start < shard_end
            shard_range = shard_bucket_range = shard_param_range = None
            if in_local_shard:
                shard_range = (shard_start, shard_end)
                sb_start = shard_start + shard_size * shard_id
                shard_bucket_range = (sb_start, sb_start + shard_end - shard_start)
                sp_start = sb_start - bucket_start + param_start
                shard_param_range = (sp_start, sp_start + shard_end - shard_start)
            fragment = self.ParameterFragment(
                param_group_id,
                param_id,
                bucket_id,
                (param_start, param_end),
                (bucket_start, bucket_end),
                in_local_shard,
                shard_range,
                shard_bucket_range,
                shard_param_range,
            )
            self.state[param]["fragments"].append(fragment)
            bucket.fragments.append(fragment)
            bucket.filled_size = bucket_end
            param_start = param_end
        if self.store_params:
            for fragment in self.state[param]["fragments"]:
                if fragment.in_local_shard:
                    bucket = buckets[fragment.bucket_id]
                    bucket.params_shard[slice(*fragment.shard_range)].copy_(
                        param.detach().view(-1)[slice(*fragment.shard_param_range)]
                    )

    # -- gradients ----------------------------------------------------------- #
    def zero_grad(self, set_to_none: bool = False) -> None:
        self._log("zero_grad", set_to_none=set_to_none)
        self._grads_buckets.clear()
        for param in self.parameters():
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()
        self._grad_scale.fill_(1.0)
        self._grad_norm = None

    @torch.no_grad()
    def _grad_copy(self, param: torch.nn.Parameter) -> None:
        if "fragments" not in self.state[param]:
            self.init_params([param])
        for fragment in self.state[param]["fragments"]:
            bucket = self._grads_buckets[fragment.bucket_id]
            state_bucket = self.state["buckets"][fragment.bucket_id]
            if bucket.status == self.GradientStatus.SYNCING:
                self._finish_bucket_grad_sync()
            bucket.status = self.GradientStatus.PARTIALLY_FILLED
            if bucket.grads_bucket is None:
                bucket.grads_bucket = torch.zeros(
                    [state_bucket.bucket_size], dtype=self.grad_sync_dtype, device=self.device
                )
            if param.grad is not None:
                grad_in = param.grad.detach().view(-1)[slice(*fragment.param_range)]
                bucket.grads_bucket[slice(*fragment.bucket_range)].add_(grad_in)
        param.grad = None

    def _try_start_bucket_grad_sync(
        self, params: Iterable[torch.nn.Parameter] | None = None, ignore_last_bucket: bool = False
    ) -> None:
        for param in params or []:
            for fragment in self.state[param]["fragments"]:
                grads_bucket = self._grads_buckets[fragment.bucket_id]
                state_bucket = self.state["buckets"][fragment.bucket_id]
                grads_bucket.grads_generated.add(param)
                if len(grads_bucket.grads_generated) == len(state_bucket.fragments):
                    grads_bucket.status = self.GradientStatus.FULLY_FILLED
                    if grads_bucket.grads_bucket is None:
                        grads_bucket.grads_bucket = torch.zeros(
                            [state_bucket.bucket_size], dtype=self.grad_sync_dtype, device=self.device
                        )
        filled = [
            (bucket_id, bucket)
            for bucket_id, bucket in sorted(self._grads_buckets.items())
            if not (ignore_last_bucket and bucket_id == len(self.state["buckets"]) - 1)
            and bucket.status == self.GradientStatus.FULLY_FILLED
        ]
        if filled:
            self._start_bucket_grad_sync(filled)

    @torch.no_grad()
    def _start_bucket_grad_sync(self, buckets: list[tuple[int, DistributedFusedAdam.GradientBucket]]) -> None:
        self._finish_bucket_grad_sync()
        op = dist.ReduceOp.AVG if self.average_grad_sync else dist.ReduceOp.SUM
        for bucket_id, bucket in buckets:
            bucket.status = self.GradientStatus.SYNCING
            bucket.grads_generated.clear()
            if self.distributed_size == 1:
                bucket.sync_grads_shard = bucket.grads_bucket
            elif bucket.sync_grads_shard is None:
                bucket.sync_grads_shard = torch.empty(
                    [bucket.grads_bucket.numel() // self.distributed_size],
                    dtype=bucket.grads_bucket.dtype,
                    device=self.device,
                )
            # Several syncs in one step (accumulation without no_sync) add up.
            if bucket.grads_shard is not None and bucket.sync_grads_shard.data_ptr() == bucket.grads_shard.data_ptr():
                bucket.grads_shard = bucket.grads_shard.clone()
            if self.distributed_size > 1:
                _quiet(
                    dist.reduce_scatter_tensor,
                    bucket.sync_grads_shard,
                    bucket.grads_bucket,
                    op=op,
                    group=self.distributed_process_group,
                )
                self._log("reduce_scatter", bucket=bucket_id, in_no_sync=self._in_no_sync)
            if self.redundant_size > 1:
                dist.all_reduce(bucket.sync_grads_shard, op=op, group=self.redundant_process_group)
                self._log("redundant_all_reduce", bucket=bucket_id, in_no_sync=self._in_no_sync)

    def _finish_bucket_grad_sync(self) -> None:
        for _, bucket in sorted(self._grads_buckets.items()):
            if bucket.status == self.GradientStatus.SYNCING:
                if bucket.grads_shard is None:
                    bucket.grads_shard = bucket.sync_grads_shard
                else:
                    bucket.grads_shard.add_(bucket.sync_grads_shard)
                bucket.grads_bucket = None
                bucket.status = self.GradientStatus.READY
                self._grad_norm = None

    def _force_bucket_grad_sync(self) -> None:
        pending = []
        for bucket_id, grads_bucket in sorted(self._grads_buckets.items()):
            if grads_bucket.status not in (self.GradientStatus.READY, self.GradientStatus.SYNCING):
                if grads_bucket.grads_bucket is None:
                    grads_bucket.grads_bucket = torch.zeros(
                        [self.state["buckets"][bucket_id].bucket_size], dtype=self.grad_sync_dtype, device=self.device
                    )
                pending.append((bucket_id, grads_bucket))
        if pending:
            self._start_bucket_grad_sync(pending)
        self._finish_bucket_grad_sync()
        for bucket_id, state_bucket in enumerate(self.state["buckets"]):
            grads_bucket = self._grads_buckets[bucket_id]
            if grads_bucket.grads_shard is None:
                grads_bucket.grads_shard = torch.zeros(
                    [state_bucket.shard_size], dtype=self.grad_sync_dtype, device=self.device
                )

    @contextlib.contextmanager
    def no_sync(self, greedy_grad_copy: bool = False):
        self._log("no_sync", greedy_grad_copy=greedy_grad_copy)
        old = (self.greedy_grad_copy, self.overlap_grad_sync, self._in_no_sync)
        self.greedy_grad_copy, self.overlap_grad_sync, self._in_no_sync = greedy_grad_copy, False, True
        try:
            yield
        finally:
            self.greedy_grad_copy, self.overlap_grad_sync, self._in_no_sync = old
            self._log("no_sync_exit")

    def grad_sync(self) -> None:
        self._log("grad_sync")
        for bucket in self.state["buckets"]:
            for fragment in bucket.fragments:
                param = self.parameter(fragment)
                if param.grad is not None:
                    self._grad_copy(param)
                    self._try_start_bucket_grad_sync(params=[param], ignore_last_bucket=False)
        self._force_bucket_grad_sync()

    def param_sync(self) -> None:
        # Parameters are all-gathered synchronously at the end of step().
        pass

    # -- norms, clipping, loss scaling --------------------------------------- #
    @torch.no_grad()
    def _local_grad_norm(self) -> torch.Tensor:
        self.grad_sync()
        shards = [b.grads_shard for _, b in sorted(self._grads_buckets.items()) if b.grads_shard is not None]
        if not shards:
            return torch.zeros([], dtype=torch.float32, device=self.device)
        return sum(s.float().pow(2).sum() for s in shards).reshape([])

    def grad_norm(
        self, parameters: Iterable[torch.nn.Parameter] | None = None, norm_type: float = 2.0, force: bool = False
    ) -> torch.Tensor:
        self._log("grad_norm", force=force)
        if parameters is not None:
            raise NotImplementedError("apex stand-in: grad_norm over a subset of parameters is not modelled")
        if force or self._grad_norm is None:
            assert float(norm_type) == 2.0
            grad_norm_sq = self._local_grad_norm()
            dist.all_reduce(grad_norm_sq, op=dist.ReduceOp.SUM, group=self.distributed_process_group)
            self._grad_norm = grad_norm_sq.sqrt()
        return (self._grad_norm * self._grad_scale).detach()

    def clip_grad_norm(
        self, max_norm: float, parameters: Iterable[torch.nn.Parameter] | None = None, norm_type: float = 2.0
    ) -> torch.Tensor:
        self._log("clip_grad_norm", max_norm=max_norm)
        assert max_norm > 0
        total_norm = self.grad_norm(parameters=parameters, norm_type=norm_type)
        clip_coef = max_norm / (total_norm + 1e-6)
        self._grad_scale *= torch.clamp(clip_coef, max=1.0)
        return total_norm

    @torch.no_grad()
    def unscale_grads(self, *args: Any, inv_scale: torch.Tensor | None = None, grad_scaler: Any = None):
        self._log(
            "unscale_grads",
            inv_scale=None if inv_scale is None else float(inv_scale),
            grad_scaler=grad_scaler is not None,
        )
        if inv_scale is None and len(args) >= 1:
            inv_scale = args[0]
        found_inf = torch.logical_not(torch.isfinite(self.grad_norm()))
        found_inf_per_device = {found_inf.device: found_inf.float()}
        if grad_scaler is not None and grad_scaler._enabled:
            state = grad_scaler._per_optimizer_states[id(self)]
            OptState = torch.cuda.amp.grad_scaler.OptState
            if state["stage"] is OptState.UNSCALED:
                raise RuntimeError("unscale_grads has already been called since the last GradScaler update")
            if state["stage"] is OptState.STEPPED:
                raise RuntimeError("unscale_grads is being called after optimizer step")
            if inv_scale is not None:
                raise ValueError("unscale_grads is being called with both scale_inv and grad_scaler")
            inv_scale = grad_scaler._scale.double().reciprocal().to(dtype=torch.float32, device=self.device)
            state["found_inf_per_device"] = found_inf_per_device
            state["stage"] = OptState.UNSCALED
        if inv_scale is None:
            raise ValueError("unscale_grads is being called with neither scale_inv and grad_scaler")
        self._grad_scale *= inv_scale.view([])
        return found_inf_per_device

    # -- the step ------------------------------------------------------------------ #
    @torch.no_grad()
    def step(self, closure: Callable | None = None, *, grad_scaler: Any = None):
        self._log("step", grad_scaler=grad_scaler is not None)
        loss = closure() if closure is not None else None
        self.init_params()
        self.param_sync()
        self.grad_sync()
        if grad_scaler is not None and grad_scaler._enabled:
            state = grad_scaler._per_optimizer_states[id(self)]
            if state["stage"] is torch.cuda.amp.grad_scaler.OptState.READY:
                self.unscale_grads(grad_scaler=grad_scaler)
            if state["found_inf_per_device"][self.device].item():
                return loss
        self.state["step"] += 1
        params_out = {}
        for bucket_id, state_bucket in enumerate(self.state["buckets"]):
            grads = self._grads_buckets[bucket_id].grads_shard
            out = torch.zeros([state_bucket.shard_size], dtype=self.param_sync_dtype, device=self.device)
            for fragment in state_bucket.fragments:
                if not fragment.in_local_shard:
                    continue
                shard = slice(*fragment.shard_range)
                if state_bucket.params_shard is not None:
                    p = state_bucket.params_shard[shard]
                else:
                    p = self.parameter(fragment).detach().view(-1)[slice(*fragment.shard_param_range)].float().clone()
                group = self.param_groups[fragment.param_group_id]
                beta1, beta2 = group["betas"]
                adam_update(
                    p,
                    state_bucket.exp_avg_shard[shard],
                    state_bucket.exp_avg_sq_shard[shard],
                    grads[shard],
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    step=self.state["step"],
                    bias_correction=bool(group["bias_correction"]),
                    adam_w_mode=self.adam_w_mode,
                    weight_decay=group["weight_decay"],
                    grad_scale=self._grad_scale,
                )
                out[shard].copy_(p)
            params_out[bucket_id] = out
        # All-gather every bucket's updated shards and copy each fragment back into its parameter.
        for bucket_id, state_bucket in enumerate(self.state["buckets"]):
            gathered = torch.empty([state_bucket.bucket_size], dtype=self.param_sync_dtype, device=self.device)
            _quiet(dist.all_gather_into_tensor, gathered, params_out[bucket_id], group=self.distributed_process_group)
            for fragment in state_bucket.fragments:
                param = self.parameter(fragment)
                param.detach().view(-1)[slice(*fragment.param_range)].copy_(gathered[slice(*fragment.bucket_range)])
        self._log("param_all_gather", buckets=len(self.state["buckets"]))
        return loss

    # -- state ---------------------------------------------------------------------- #
    def state_dict(self, *, state_dict_format: int | None = None, gather_on_root: bool | None = None):
        self._log("state_dict", state_dict_format=state_dict_format, gather_on_root=gather_on_root)
        if state_dict_format is None:
            state_dict_format = 2
        if state_dict_format != 2:
            raise NotImplementedError("apex stand-in: only the default state dict format 2 is modelled")
        state_dict = self._state_dict_v2()
        state_dict["format"] = state_dict_format
        return state_dict

    @torch.no_grad()
    def _state_dict_v2(self) -> dict:
        self.init_params()
        self.grad_sync()
        self.param_sync()
        state_dict = super().state_dict()
        state_dict["state"] = {"step": state_dict["state"]["step"]}
        for param in self.parameters():
            fragment = self.state[param]["fragments"][0]
            index = state_dict["param_groups"][fragment.param_group_id]["params"][fragment.param_id]
            state_dict["state"][index] = {
                key: torch.zeros_like(param, dtype=self.dtype, device="cpu")
                for key in ("param", "exp_avg", "exp_avg_sq")
            }
        for key in ("param", "exp_avg", "exp_avg_sq"):
            for bucket in self.state["buckets"]:
                shard = self._pack_param_shard(bucket) if key == "param" else getattr(bucket, f"{key}_shard")
                gathered = torch.empty([bucket.bucket_size], dtype=self.dtype, device=self.device)
                _quiet(dist.all_gather_into_tensor, gathered, shard, group=self.distributed_process_group)
                for fragment in bucket.fragments:
                    index = state_dict["param_groups"][fragment.param_group_id]["params"][fragment.param_id]
                    state_dict["state"][index][key].view(-1)[slice(*fragment.param_range)].copy_(
                        gathered[slice(*fragment.bucket_range)]
                    )
        return state_dict

    def _pack_param_shard(self, bucket: DistributedFusedAdam.StateBucket) -> torch.Tensor:
        if bucket.params_shard is not None:
            return bucket.params_shard
        shard = torch.zeros([bucket.shard_size], dtype=self.dtype, device=self.device)
        for fragment in bucket.fragments:
            if fragment.in_local_shard:
                shard[slice(*fragment.shard_range)].copy_(
                    self.parameter(fragment).detach().view(-1)[slice(*fragment.shard_param_range)]
                )
        return shard

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        self._log("load_state_dict", format=state_dict.get("format"))
        state_dict_format = state_dict.pop("format", None)
        if state_dict_format is None:
            state_dict_format = 1 if ("buckets" in state_dict or "gathered_states" in state_dict) else 2
        if state_dict_format != 2:
            raise NotImplementedError("apex stand-in: only the default state dict format 2 is modelled")
        self.init_params()
        self.grad_sync()
        self.param_sync()
        state = self.state
        self.state = {}
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self.state = state
        self.state["step"] = state_dict["state"]["step"]
        for param in self.parameters():
            fragment = self.state[param]["fragments"][0]
            index = state_dict["param_groups"][fragment.param_group_id]["params"][fragment.param_id]
            saved = {k: state_dict["state"][index][k].view(-1) for k in ("param", "exp_avg", "exp_avg_sq")}
            for fragment in self.state[param]["fragments"]:
                if not fragment.in_local_shard:
                    continue
                bucket = self.state["buckets"][fragment.bucket_id]
                param_range, shard_range = slice(*fragment.shard_param_range), slice(*fragment.shard_range)
                if bucket.params_shard is not None:
                    bucket.params_shard[shard_range].copy_(saved["param"][param_range])
                bucket.exp_avg_shard[shard_range].copy_(saved["exp_avg"][param_range])
                bucket.exp_avg_sq_shard[shard_range].copy_(saved["exp_avg_sq"][param_range])
