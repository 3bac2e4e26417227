"""Deliberately wrong strategies, a plugin module the conformance tests register by name.

Each one is plain data parallel (whole model per rank, one flattened gradient
all-reduce at the boundary) with exactly one defect a strategy written from the
README could plausibly have. The conformance suite must refuse to certify each
one and name what it broke; ``refuses_declared`` is the control (the same
refusals as ``refuses_quietly``, declared) and must be certified.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import unison
from unison import (
    AccumulationOwner,
    ConfigurationError,
    Feature,
    GradAccumulation,
    Ownership,
    PrecisionOwner,
    PrecisionSupport,
    ReplicaInit,
    StateDictDeclaration,
    StateDictKind,
    StrategySpec,
)
from unison.contract import ReplicatedStrategy
from unison.contract.strategy import model_features

_PRECISION = {
    "32-true": PrecisionSupport(PrecisionOwner.TRAINER, "fp32"),
    "bf16-mixed": PrecisionSupport(PrecisionOwner.TRAINER, "torch.autocast(bfloat16)"),
    "16-mixed": PrecisionSupport(PrecisionOwner.TRAINER, "torch.autocast(float16) + GradScaler"),
    "bf16-true": PrecisionSupport.unsupported("not implemented"),
}


class _DataParallel(ReplicatedStrategy):
    """Correct hand-written data parallel on the public base (its setup, clipping, state and checkpoints);
    the subclasses below each break one thing."""

    replica_init = ReplicaInit.TRAINER
    refuses: ClassVar[dict[Feature, str]] = {}

    def __init__(self) -> None:
        super().__init__()
        self._sync = True

    @property
    def ownership(self) -> Ownership:
        return Ownership(
            grad_accumulation=GradAccumulation(AccumulationOwner.TRAINER, "no_sync() defers one flattened all-reduce"),
            precision=_PRECISION,
            state_dict=StateDictDeclaration(StateDictKind.FULL, "DCP", True, "module.state_dict()"),
            replica_init=self.replica_init,
            refuses=self.refuses,
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self._sync and self.env is not None and self.env.distributed:
            self.average_gradients()

    def average_gradients(self) -> None:
        assert self.module is not None
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat.div_(dist.get_world_size())
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)


class RefusesQuietly(_DataParallel):
    """Refuses more than 2 micro-batches per step and models with buffers, but declares neither."""

    def validate(self, settings: Any, world_size: int) -> None:
        if settings.accumulate_grad_batches > 2:
            raise ConfigurationError(
                "accumulate_grad_batches", "accumulation is not implemented beyond 2", "set it to 1 or 2"
            )

    def validate_model(self, model: torch.nn.Module, settings: Any) -> None:
        if Feature.BUFFERS in model_features(model):
            raise ConfigurationError("model", "models with buffers are not implemented", "remove the buffers")


class RefusesDeclared(RefusesQuietly):
    """The same refusals as :class:`RefusesQuietly`, declared (the control: certified). A declared
    refusal is per feature, so it covers all accumulation; the trainer then refuses it up front."""

    refuses: ClassVar[dict[Feature, str]] = {
        Feature.GRADIENT_ACCUMULATION: "accumulation is not implemented",
        Feature.BUFFERS: "models with buffers are not implemented",
    }


class SkipsBroadcast(_DataParallel):
    """Declares that its setup makes replicas equal (like DDP) but never broadcasts rank 0's weights."""

    replica_init = ReplicaInit.STRATEGY


class StaleBuffers(_DataParallel):
    """Runs the forward on copies of the buffers: every buffer update is lost."""

    def wrap_module(self, module: torch.nn.Module) -> Any:
        def forward(inputs: Any) -> Any:
            state = {**dict(module.named_parameters()), **{n: b.clone() for n, b in module.named_buffers()}}
            return torch.func.functional_call(module, state, (inputs,))

        return forward


class EveryStepClaimsBoundary(_DataParallel):
    """All-reduces after every micro-batch (numerically right) but declares boundary-only sync:
    its ``no_sync()`` defers nothing."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def backward(self, loss: torch.Tensor) -> None:
        assert self.module is not None
        params = [p for p in self.module.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        pairs = [(p, g) for p, g in zip(params, grads) if g is not None]
        flat = _flatten_dense_tensors([g for _, g in pairs])
        dist.all_reduce(flat)
        flat.div_(dist.get_world_size())
        for (p, _), reduced in zip(pairs, _unflatten_dense_tensors(flat, [g for _, g in pairs])):
            p.grad = reduced.clone() if p.grad is None else p.grad.add_(reduced)


class ForgetsOptimizerState(_DataParallel):
    """Saves everything but, on resume, loads the model only (optimizer moments start from zero)."""

    def load_state(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        assert self.module is not None
        state = {"model": get_model_state_dict(self.module)}
        dcp.load(state, checkpoint_id=str(directory))  # the model's keys only
        set_model_state_dict(self.module, state["model"])


class PerRankValidationMean(_DataParallel):
    """Trains correctly; its ``reduce_sum`` treats the validation pair (a float64 ``(loss * weight, weight)``)
    as one replica's mean to average: val/loss is the mean of replica means, not the per-sample mean. Follows
    Lightning-AI/pytorch-lightning#12354 (a validation loss synced across ranks that is right only with
    drop_last=True)."""

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        validation_pair = tensor.numel() == 2 and tensor.dtype == torch.float64
        if not validation_pair or self.env is None or not self.env.distributed:
            return super().reduce_sum(tensor)
        # (sum of loss * weight, sum of weight) -> each replica's mean, averaged over replicas.
        mean = (tensor[0] / tensor[1].clamp_min(1)).reshape(1).clone()
        dist.all_reduce(mean)
        return torch.stack([mean[0], torch.ones((), dtype=tensor.dtype) * dist.get_world_size()])


class BatchMeanOverReplicas(_DataParallel):
    """Trains correctly; its ``eval_loss`` returns each validation batch's loss averaged over the replicas (as
    DeepSpeed's ``PipelineEngine.eval_batch`` aggregates the loss over its data-parallel group): a batch split
    3 + 2 counts its 2-sample half as much as its 3-sample one. Certified while the validation scenario's short
    last chunk held one sample (the other replica's stand-in is that sample: 19.4992651 vs 19.4992650).
    Follows Lightning-AI/pytorch-lightning#2924 (a smaller last batch skewing epoch metrics)."""

    def eval_loss(self, inputs: Any, targets: Any, loss_fn: Any) -> torch.Tensor:
        loss = super().eval_loss(inputs, targets, loss_fn).detach().clone()
        if self.env is not None and self.env.distributed:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        return loss


class ForgetsMomentum(_DataParallel):
    """Restores only Adam's state keys on resume (``step``, ``exp_avg``, ``exp_avg_sq``): SGD momentum and
    RMSprop's averages start again from zero."""

    ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")

    def load_state(self, directory: Path) -> None:
        super().load_state(directory)
        assert self.optimizer is not None
        for state in self.optimizer.state.values():
            for key in [k for k in state if k not in self.ADAM_KEYS]:
                del state[key]


class RenamedCheckpoint(_DataParallel):
    """Declares a reshardable DCP checkpoint but saves the model under its own top-level key.

    It resumes its own checkpoints exactly; ``single`` loading one fails inside
    ``torch.distributed.checkpoint`` with a ``CheckpointException`` (a
    ``BaseException``, not an ``Exception``): the suite must report the cell,
    not crash.
    """

    def save_state(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        assert self.module is not None and self.optimizer is not None
        model, optim = get_state_dict(self.module, self.optimizer)
        dcp.save({"weights": model, "optim": optim}, checkpoint_id=str(directory))

    def load_state(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        assert self.module is not None and self.optimizer is not None
        model, optim = get_state_dict(self.module, self.optimizer)
        state = {"weights": model, "optim": optim}
        dcp.load(state, checkpoint_id=str(directory))
        set_state_dict(self.module, self.optimizer, model_state_dict=state["weights"], optim_state_dict=state["optim"])


class NotReshardable(_DataParallel):
    """Correct, with a checkpoint declared not reshardable (the control: certified, cross-world scenarios
    declared out). Each rank writes its own file, as a per-rank format would, and refuses a checkpoint
    written at another world size."""

    @property
    def ownership(self) -> Ownership:
        own = super().ownership
        return Ownership(
            grad_accumulation=own.grad_accumulation,
            precision=_PRECISION,
            state_dict=StateDictDeclaration(
                StateDictKind.FULL, "torch.save per rank", False, "module.state_dict() on each rank"
            ),
            replica_init=self.replica_init,
            refuses=self.refuses,
        )

    def _file(self, directory: Path) -> Path:
        assert self.env is not None
        return Path(directory) / f"rank{self.env.rank}-of-{self.env.world_size}.pt"

    def save_state(self, directory: Path) -> None:
        assert self.module is not None and self.optimizer is not None
        Path(directory).mkdir(parents=True, exist_ok=True)
        torch.save({"model": self.module.state_dict(), "optim": self.optimizer.state_dict()}, self._file(directory))

    def load_state(self, directory: Path) -> None:
        assert self.module is not None and self.optimizer is not None
        path = self._file(directory)
        if not path.exists():
            raise FileNotFoundError(f"{path}: a checkpoint of another world size (this format is not reshardable)")
        state = torch.load(path, weights_only=True)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])


BROKEN = {
    "refuses_quietly": (RefusesQuietly, "refuses accumulation and buffers without declaring it"),
    "refuses_declared": (RefusesDeclared, "refuses accumulation and buffers, declared"),
    "skips_broadcast": (SkipsBroadcast, "declares replica_init=strategy but never broadcasts"),
    "stale_buffers": (StaleBuffers, "runs the forward on copies of the buffers"),
    "every_step_claims_boundary": (EveryStepClaimsBoundary, "syncs every micro-step, declares boundary sync"),
    "forgets_optimizer_state": (ForgetsOptimizerState, "does not restore the optimizer state on resume"),
    "per_rank_val_mean": (PerRankValidationMean, "validation loss: the mean of each replica's mean"),
    "batch_mean_over_replicas": (BatchMeanOverReplicas, "validation loss: each batch's mean averaged over replicas"),
    "forgets_momentum": (ForgetsMomentum, "restores only Adam's optimizer state keys on resume"),
    "renamed_checkpoint": (RenamedCheckpoint, "declares a DCP checkpoint single can load, saves other keys"),
    "not_reshardable": (NotReshardable, "correct; per-rank checkpoint files declared not reshardable"),
}


@unison.hookimpl
def unison_strategies() -> list[StrategySpec]:
    return [StrategySpec(name=name, factory=cls, description=text) for name, (cls, text) in BROKEN.items()]
