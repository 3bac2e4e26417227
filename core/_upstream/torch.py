"""Every non-public torch name unison uses, one function or class each (verified against torch 2.13.0).

A private API can change in any torch release. Each one lives here, beside the reason
no public API serves, so an upgrade is a review of this file instead of a hunt through
the loop, the loader, the launcher and the backends (which is why it is one module, past
400 lines). Each function warns once, at first use, when the installed torch is not
:data:`VERIFIED_VERSION` (the dependency pins it), and says what it does instead when the
private name is gone. ``tests/test_upstream.py`` fails when
code outside :mod:`unison._upstream` reaches a private upstream name, and runs each function here
against the installed torch.

* ``torch.distributed.distributed_c10d._set_pg_timeout``: :func:`set_default_group_timeout`;
* ``torch._C._distributed_c10d._dump_nccl_trace``: :func:`nccl_flight_recorder_dump`;
* ``torch._C._distributed_c10d._dump_fr_trace_json``: :func:`flight_recorder_json`;
* ``torch.distributed.distributed_c10d._world.pg_names``: :func:`process_group_names`;
* ``torch._inductor.config.fallback_random``: :func:`eager_random_ops`;
* ``torch.distributed.elastic`` ``SubprocessContext._failures``: :func:`torchrun_worker_failures`;
* ``torch.utils.data._utils.worker._worker_info``: :func:`hidden_loader_worker`;
* ``_MultiProcessingDataLoaderIter._shutdown_workers``: :func:`shutdown_loader_workers`;
* ``torch._utils._flatten_dense_tensors`` / ``_unflatten_dense_tensors``:
  :func:`flatten_dense_tensors`, :func:`unflatten_dense_tensors`;
* ``torch.utils._python_dispatch.TorchDispatchMode`` and ``OpOverload._overloadpacket``:
  :func:`flop_counter`; ``torch.utils._python_dispatch._disable_current_modes``:
  :func:`outside_dispatch_modes`;
* ``torch._dynamo.utils.counters``: :func:`compiled_frames`;
* ``torch.autograd._profiler_enabled``: :func:`profiler_enabled`;
* ``torch.amp.GradScaler`` internals: ``_unscale_grads_`` (the one place where the per-device overflow flags
  exist before ``step()`` reads them), ``_lazy_init_scale_growth_tracker``, ``_enabled``, ``_scale``,
  ``_device``: :class:`FlagReducingGradScaler` exposes them as two public methods, so strategies override
  those instead;
* ``PipelineStage._forward_metadata_inference``: the pipeline stage's one-time shape inference, wrapped by
  :func:`buffer_keeping_pipeline_stage` so that it leaves buffers as they were;
* ``Optimizer._optimizer_step_pre_hooks`` / ``_optimizer_step_post_hooks``: the step hooks a user
  registered on an optimizer, moved to the optimizer that really steps (:func:`copy_step_hooks`); torch has
  ``register_step_*_hook`` but no getter.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from unison._upstream import warn_if_unverified

#: The torch release every private name below was read in and tested against.
VERIFIED_VERSION = "2.13.0"


def _check() -> None:
    warn_if_unverified("torch", VERIFIED_VERSION, __name__)


@functools.cache
def _missing(name: str, instead: str) -> None:
    """Warn once that the private ``name`` is gone from the installed torch, and what unison does instead."""
    warnings.warn(
        f"torch {torch.__version__} has no {name} (unison verified it in torch {VERIFIED_VERSION}): {instead}",
        RuntimeWarning,
        stacklevel=3,
    )


# --------------------------------------------------------------------------- #
# Process groups and launching
# --------------------------------------------------------------------------- #
def set_default_group_timeout(timeout: datetime.timedelta) -> None:
    """Give the default process group ``timeout`` for its collectives, after the rendezvous used its own.

    ``init_process_group(timeout=...)`` sets one timeout for both the rendezvous and
    every later collective; unison wants a short one for the first (a missing rank
    fails the start within minutes) and a long one for the second (a checkpoint
    write). No public call changes a live group's timeout.
    """
    _check()
    # PRIVATE distributed_c10d._set_pg_timeout: the one setter of an existing group's timeout.
    setter = getattr(torch.distributed.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        _missing("distributed_c10d._set_pg_timeout", "collectives keep the rendezvous timeout")
        return
    setter(timeout)


def nccl_flight_recorder_dump() -> bytes | None:
    """The NCCL flight recorder's record (collectives, stack traces, finished ones too), or ``None``.

    ``None`` on builds without NCCL (CPU wheels): there the private function does
    not exist and there is nothing to record, so no warning. No public API reads
    the recorder from inside the process.
    """
    _check()
    # PRIVATE torch._C._distributed_c10d._dump_nccl_trace: the flight recorder's in-process reader.
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    if dump is None:
        return None
    data: bytes = dump(True, True, False)  # collectives, stack traces, not only the active ones
    return data


def flight_recorder_json() -> str | None:
    """Every backend's flight recorder record as JSON (collectives, no stack traces), or ``None``.

    Unlike :func:`nccl_flight_recorder_dump` this reader exists on CPU builds and records gloo's
    collectives too (each with its process group, sizes, dtypes and creation time) when
    ``TORCH_FR_BUFFER_SIZE`` is set before the first process group starts. No public API reads the
    recorder from inside the process.
    """
    _check()
    # PRIVATE torch._C._distributed_c10d._dump_fr_trace_json: the recorder's in-process reader for every backend.
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace_json", None)
    if dump is None:
        _missing("torch._C._distributed_c10d._dump_fr_trace_json", "no collective's process group is recorded")
        return None
    text: str = dump(True, False)  # collectives, no stack traces
    return text


def process_group_names() -> dict[Any, str]:
    """Every live process group of this process with its name (the name the flight recorder records).

    ``torch.distributed`` has ``get_process_group_ranks(group)`` but no public list of the groups.
    """
    _check()
    # PRIVATE distributed_c10d._world.pg_names: the registry of every group made in this process.
    world = getattr(torch.distributed.distributed_c10d, "_world", None)
    if world is None or not hasattr(world, "pg_names"):
        _missing("distributed_c10d._world.pg_names", "no process group is named")
        return {}
    return {group: str(name) for group, name in list(world.pg_names.items())}


def eager_random_ops() -> Any:
    """A context in which ``torch.compile`` (inductor) compiles random ops onto eager's generator.

    Inductor otherwise draws compiled random numbers from its own Philox stream (pytorch/pytorch#118735, by
    design), so a compiled forward with dropout cannot equal the same forward uncompiled. The switch,
    ``fallback_random``, is a config of the private ``torch._inductor`` package.
    """
    _check()
    # PRIVATE torch._inductor.config.fallback_random: compile random ops as calls of the eager ops.
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config, "fallback_random"):
        _missing("torch._inductor.config.fallback_random", "compiled random ops keep inductor's generator")
        return contextlib.nullcontext()
    return inductor_config.patch(fallback_random=True)


def profiler_enabled() -> bool:
    """Whether a profiler records on this thread (torch's autograd profiler or Kineto's ``torch.profiler``).

    The training loop marks the strategy's sync points only while one does: a ``record_function`` entered
    unconditionally costs about 10 us, its enter and exit being dispatcher calls; this check about 0.7 us.
    The flag the profilers set has no public getter.
    """
    _check()
    # PRIVATE torch.autograd._profiler_enabled: the C++ flag the profilers set on this thread.
    enabled = getattr(torch.autograd, "_profiler_enabled", None)
    if enabled is None:
        _missing("torch.autograd._profiler_enabled", "the loop's marks are entered whether or not a profiler records")
        return True
    return bool(enabled())


def torchrun_worker_failures(pcontext: Any) -> dict[int, Any]:
    """The failures a torchrun worker context recorded so far (local rank -> ``ProcessFailure``).

    Read when torchrun first closes the worker group, to tell the workers that failed
    on their own from those it is about to terminate; torchrun reports both the same
    way afterwards. ``{}`` for a context that keeps no such record (the multiprocessing
    one); a subprocess context without it warns once (every failure then looks real).
    """
    _check()
    # PRIVATE SubprocessContext._failures: the failures seen before close() terminates the rest.
    failures = getattr(pcontext, "_failures", None)
    if failures is None:
        from torch.distributed.elastic.multiprocessing import api

        if isinstance(pcontext, api.SubprocessContext):
            _missing("SubprocessContext._failures", "workers torchrun terminated are reported as failures too")
        return {}
    return dict(failures)


# --------------------------------------------------------------------------- #
# Data loading
# --------------------------------------------------------------------------- #
@contextlib.contextmanager
def hidden_loader_worker() -> Iterator[None]:
    """Make ``torch.utils.data.get_worker_info()`` return ``None`` while the block runs.

    Sources such as Hugging Face's ``IterableDataset`` shard themselves by DataLoader
    worker when they see one; the trainer's loader workers must each read the whole
    stream to keep the global order. ``get_worker_info()`` has no public setter.
    """
    _check()
    from torch.utils.data._utils import worker  # PRIVATE module: it holds the value get_worker_info() returns

    if not hasattr(worker, "_worker_info"):
        _missing("torch.utils.data._utils.worker._worker_info", "a source that shards by worker will see workers")
        yield
        return
    # PRIVATE worker._worker_info: what get_worker_info() returns, saved and restored around the block.
    saved = worker._worker_info
    worker._worker_info = None
    try:
        yield
    finally:
        worker._worker_info = saved


def shutdown_loader_workers(iterator: Any) -> None:
    """Stop a ``DataLoader`` iterator's worker processes now (a loop that ends early).

    A multi-process iterator stops its workers when it is exhausted or collected;
    ``fit`` ending early must not wait for the garbage collector. No public method
    exists. A single-process iterator has no workers and nothing to do.
    """
    _check()
    # PRIVATE _MultiProcessingDataLoaderIter._shutdown_workers: what its __del__ calls.
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is None:
        from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter  # PRIVATE class, only to tell

        if isinstance(iterator, _MultiProcessingDataLoaderIter):
            _missing("_MultiProcessingDataLoaderIter._shutdown_workers", "workers stop when the iterator is collected")
        return
    shutdown()


# --------------------------------------------------------------------------- #
# Tensors
# --------------------------------------------------------------------------- #
def flatten_dense_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-D tensor holding ``tensors`` back to back (one collective for many tensors)."""
    _check()
    # PRIVATE torch._utils: the flattening DDP uses for its buckets; torch.cat of flattened views otherwise.
    flatten = getattr(torch._utils, "_flatten_dense_tensors", None)
    if flatten is None:
        _missing("torch._utils._flatten_dense_tensors", "torch.cat of the flattened tensors instead")
        return torch.cat([t.reshape(-1) for t in tensors])
    result: torch.Tensor = flatten(tensors)
    return result


def scale_tensors(tensors: Sequence[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every tensor of ``tensors`` (one dtype and device) by the 0-dim ``factor`` in place, in one launch."""
    _check()
    # PRIVATE torch._foreach_mul_: the multi-tensor kernel torch's own optimizers and clip_grad_norm_ use (one
    # launch for every gradient); a loop of mul_ otherwise.
    foreach_mul = getattr(torch, "_foreach_mul_", None)
    if foreach_mul is None:
        _missing("torch._foreach_mul_", "one mul_ per tensor instead")
        for t in tensors:
            t.mul_(factor)
        return
    foreach_mul(list(tensors), factor)


def unflatten_dense_tensors(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``tensors`` (the inverse of :func:`flatten_dense_tensors`)."""
    _check()
    # PRIVATE torch._utils: the inverse of the flattening above; split and view otherwise.
    unflatten = getattr(torch._utils, "_unflatten_dense_tensors", None)
    if unflatten is None:
        _missing("torch._utils._unflatten_dense_tensors", "torch.split and view instead")
        pieces = torch.split(flat, [t.numel() for t in tensors])
        return [piece.view_as(t) for piece, t in zip(pieces, tensors)]
    return list(unflatten(flat, tensors))


# --------------------------------------------------------------------------- #
# Counting FLOPs and compiled frames
# --------------------------------------------------------------------------- #
@functools.cache
def _flop_count_class() -> type:
    # PRIVATE torch.utils._python_dispatch.TorchDispatchMode: the base FlopCounterMode itself is built on.
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    class FlopCount(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.total = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            # PRIVATE OpOverload._overloadpacket: the key flop_registry's formulas are filed under.
            formula = flop_registry.get(func._overloadpacket)
            if formula is not None:
                self.total += formula(*args, **kwargs, out_val=out)
            return out

    return FlopCount


def flop_counter() -> Any:
    """A context manager counting the FLOPs of the ops run inside it (``.total`` after it exits).

    ``torch.utils.flop_counter``'s formulas in a bare dispatch mode. The public
    ``FlopCounterMode`` counts the same, per module too: for that it enters a
    ``ModuleTracker`` (global module hooks, autograd hooks on every module's
    inputs and outputs), which a pipeline schedule's stage forwards and
    backwards do not go through cleanly. Only the total is needed.
    """
    _check()
    return _flop_count_class()()


@contextlib.contextmanager
def outside_dispatch_modes() -> Iterator[None]:
    """Run the block with no dispatch mode active (a FLOP counter around it neither counts nor slows it)."""
    _check()
    # PRIVATE torch.utils._python_dispatch._disable_current_modes: no public way to step outside a mode.
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def compiled_frames() -> int:
    """Frames ``torch.compile`` has compiled in this process (dynamo's ``frames/ok`` counter)."""
    _check()
    # PRIVATE torch._dynamo.utils.counters: the only record of how many frames were compiled.
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


# --------------------------------------------------------------------------- #
# Loss scaling, pipeline stages, optimizer step hooks (the strategies')
# --------------------------------------------------------------------------- #
class FlagReducingGradScaler(torch.amp.GradScaler):
    """A ``GradScaler`` whose overflow check a strategy can narrow and combine across ranks.

    Override :meth:`unscale_target` to unscale and check only some gradients (the shard
    this rank owns) and :meth:`combine_found_inf` to combine the per-device overflow
    flags over ranks, so that every rank skips, backs off and grows its scale together.
    """

    def unscale_target(self, optimizer: Any) -> Any:
        """The object whose ``param_groups`` are unscaled and checked (default: the optimizer)."""
        return optimizer

    def combine_found_inf(
        self, per_device: dict[torch.device, torch.Tensor], found_inf: torch.Tensor
    ) -> dict[torch.device, torch.Tensor]:
        """Combine the overflow flags (in place) before ``step()`` reads them; returns the flags to use."""
        return per_device

    def ensure_scale(self, optimizer: Any) -> None:
        """Create the scale on a rank that has not scaled a loss yet (a pipeline stage without the loss).

        ``unscale_`` needs it; it goes on the device of the optimizer's first
        gradient, else on the scaler's own device type.
        """
        _check()
        # PRIVATE GradScaler state: _enabled/_scale say whether the scale exists; the
        # tracker is otherwise created lazily by the first scale(loss), which such a rank never calls.
        if self._enabled and self._scale is None:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            self._lazy_init_scale_growth_tracker(grads[0].device if grads else torch.device(self._device))

    def _unscale_grads_(
        self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        # PRIVATE GradScaler._unscale_grads_: called by unscale_() with the optimizer; it
        # unscales and returns one found_inf flag per device, which step() then reads. No
        # public hook sits between the two.
        per_device = super()._unscale_grads_(self.unscale_target(optimizer), inv_scale, found_inf, allow_fp16)
        return self.combine_found_inf(per_device, found_inf)


def buffer_keeping_pipeline_stage() -> type:
    """``PipelineStage`` whose one-time shape inference leaves the stage's buffers as they were.

    Before its first step torch runs each stage's forward once, in training mode, to infer
    the shapes it sends (on the first micro-batch at stage 0, on uninitialised tensors of the
    right shape at the others). A forward that updates buffers (BatchNorm's running statistics
    and ``num_batches_tracked``) would keep that extra update, taken from garbage memory or from
    the first micro-batch twice, which no other backend makes; the buffers are therefore
    restored after it. Restored by putting the saved copies in place of the buffer tensors, not
    by copying into them: torch backpropagates through that inference graph next (to infer
    gradient shapes), and an in-place write to a tensor it saved would fail its version check.
    """
    _check()
    from torch.distributed import pipelining

    base = pipelining.PipelineStage
    # PRIVATE PipelineStage._forward_metadata_inference: the one-time shape inference, the only
    # place that runs a stage's forward outside the schedule; no public hook wraps it.
    if not hasattr(base, "_forward_metadata_inference"):
        raise RuntimeError(
            "torch.distributed.pipelining.PipelineStage has no _forward_metadata_inference; "
            f"unison's pipeline strategy was verified against torch {VERIFIED_VERSION}"
        )

    class BufferKeepingStage(base):  # type: ignore[misc,valid-type]  # a class from the lazy import
        def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            saved = [
                (module, name, buffer.detach().clone())
                for module in self.submod.modules()
                for name, buffer in module.named_buffers(recurse=False)
            ]
            try:
                # PRIVATE PipelineStage._forward_metadata_inference (see above).
                return super()._forward_metadata_inference(*args, **kwargs)
            finally:
                for module, name, value in saved:
                    setattr(module, name, value)  # replaces the registered buffer (nn.Module.__setattr__)

    return BufferKeepingStage


def copy_step_hooks(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
    """Register every step pre/post hook of ``source`` on ``target`` too (same order)."""
    _check()
    # PRIVATE Optimizer._optimizer_step_pre_hooks/_post_hooks: the OrderedDicts that
    # register_step_pre_hook/register_step_post_hook fill; there is no public getter.
    for hook in source._optimizer_step_pre_hooks.values():
        target.register_step_pre_hook(hook)
    for hook in source._optimizer_step_post_hooks.values():
        target.register_step_post_hook(hook)


__all__ = [
    "VERIFIED_VERSION",
    "FlagReducingGradScaler",
    "buffer_keeping_pipeline_stage",
    "compiled_frames",
    "copy_step_hooks",
    "flatten_dense_tensors",
    "flop_counter",
    "hidden_loader_worker",
    "nccl_flight_recorder_dump",
    "outside_dispatch_modes",
    "profiler_enabled",
    "scale_tensors",
    "set_default_group_timeout",
    "shutdown_loader_workers",
    "torchrun_worker_failures",
    "unflatten_dense_tensors",
]
