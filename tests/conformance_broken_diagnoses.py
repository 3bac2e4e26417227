"""Deliberately wrong strategies whose diagnosis needs direct evidence (a plugin module by name).

Each is the hand-written data parallel of :mod:`conformance_broken_strategies` with one defect, taken
from a class of bug reported on a public tracker (each docstring names the report). The suite used to
name the wrong rule for each; ``tests/test_conformance_diagnoses.py`` asserts the right one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from conformance_broken_strategies import _DataParallel
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import unison
from unison import StrategySpec


class Control(_DataParallel):
    """Correct: one flattened all-reduce at the boundary, clipping by the global norm."""


class ClipsLocalNorm(_DataParallel):
    """Leaves backward unsynchronised and, in ``clip_grad_norm``, clips each replica's gradients by its own
    (local) norm, then all-reduces them: the norm and the clip coefficient are per rank, not global.
    Follows pytorch/pytorch#170862 ("clip_grad_norm_ doesn't work with FSDP2": the local shard's norm
    used) and pytorch/torchtitan#766 (a grad norm never reduced over ranks)."""

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        norm = super().clip_grad_norm(max_norm)
        if self.env is not None and self.env.distributed:
            self.average_gradients()
        return norm


class PrefixedStateDict(_DataParallel):
    """Exports the canonical state with the wrapper's ``module.`` prefix on every key, as a
    DistributedDataParallel's own ``state_dict()`` has. Follows Lightning-AI/pytorch-lightning#17996
    (a DDP model's state dict keys not matching on load)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {f"module.{k}": v for k, v in super().full_state_dict().items()}


class LossDividedTwice(_DataParallel):
    """Divides the loss by ``accumulate_grad_batches`` in backward, on top of the trainer's division.
    Follows huggingface/transformers#34191 (the gradient accumulation loss scaling fix) and #35207."""

    def backward(self, loss: torch.Tensor) -> None:
        assert self.settings is not None
        super().backward(loss / self.settings.accumulate_grad_batches)


class RecomputesForward(_DataParallel):
    """Runs every forward twice (a recompute outside activation checkpointing's care, which would restore
    the buffers), so every BatchNorm update is applied twice. Follows pytorch/pytorch#96136
    ("torch.utils.checkpoint should avoid updating BatchNorm statistics twice")."""

    def forward(self, inputs: Any) -> Any:
        with torch.no_grad():
            super().forward(inputs)
        return super().forward(inputs)


class RefusesResume(_DataParallel):
    """Refuses to load a checkpoint (NotImplementedError) while its declaration supports resume. Follows
    microsoft/DeepSpeed#1394 (load_checkpoint of a ZeRO-3 model not possible while ZeRO-2's is)."""

    def load_state(self, directory: Path) -> None:
        raise NotImplementedError("resuming from a checkpoint is not implemented by this strategy")


class ReportsClippedNorm(_DataParallel):
    """Clips correctly but returns the norm after clipping (the clip value on a clipped step). Follows
    huggingface/accelerate#756 ("Return unclipped gradient from clip_grad_norm_")."""

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        norm = super().clip_grad_norm(max_norm)
        return norm if max_norm is None else torch.clamp(norm, max=max_norm)


class SyncsFirstMicroStep(_DataParallel):
    """Synchronises the gradients at the first micro-step of each optimizer step instead of the last (the
    later micro-steps' gradients stay local). Follows modelscope/FunASR#3472 ("align DDP no_sync with
    gradient accumulation": ``batch_idx % accum_grad`` synchronised the first micro-batch)."""

    def __init__(self) -> None:
        super().__init__()
        self._micro = 0

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self._micro == 0 and self.env is not None and self.env.distributed:
            self.average_gradients()
        self._micro += 1

    def optimizer_step(self) -> bool:
        self._micro = 0
        return super().optimizer_step()


class RebuildsOptimizer(_DataParallel):
    """Builds the user's optimizer, then rebuilds one of its class over ``module.parameters()`` with only its
    learning rate: the factory's parameter groups (per-group weight decay) are lost. Follows
    microsoft/DeepSpeed#6878 (parameter groups merged by the engine) and Lightning-AI/pytorch-lightning#8933."""

    def build_optimizer(self, make_optimizer: Any) -> torch.optim.Optimizer:
        assert self.module is not None
        built = make_optimizer(self.module.parameters())
        return type(built)(self.module.parameters(), lr=built.defaults["lr"])


class ReducesInBf16(_DataParallel):
    """Under ``bf16-mixed`` (declared applied by the trainer: fp32 gradients) all-reduces the gradients in
    bf16 to halve the traffic. Follows pytorch/pytorch#190627 (an FSDP2 gradient all-reduce left in bf16
    despite ``reduce_dtype=fp32``) and microsoft/DeepSpeed#2071 (fp16 used for all-reduce)."""

    def average_gradients(self) -> None:
        assert self.module is not None and self.precision is not None
        if self.precision.name != "bf16-mixed":
            super().average_gradients()
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = _flatten_dense_tensors(grads).to(torch.bfloat16)
        dist.all_reduce(flat)
        averaged = flat.float().div_(dist.get_world_size())
        for g, reduced in zip(grads, _unflatten_dense_tensors(averaged, grads)):
            g.copy_(reduced)


class RecomputesWithoutRng(_DataParallel):
    """Checkpoints every block for activation checkpointing with ``preserve_rng_state=False``: the recompute
    in backward draws new dropout masks. Follows microsoft/DeepSpeed#6811 (seeds differing between forward
    and recompute under torch.compile and activation checkpointing) and pytorch/torchtitan#1323."""

    def apply_features(self, module: torch.nn.Module) -> None:
        import functools

        from torch.utils.checkpoint import checkpoint

        from unison.contract.transforms import required_blocks

        assert self.settings is not None
        if self.settings.activation_checkpointing is None:
            super().apply_features(module)
            return
        for _, block in required_blocks(module, "activation_checkpointing"):
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, preserve_rng_state=False)


class WarmsUpCompiledForward(_DataParallel):
    """After compiling the forward, runs it once on a random batch so that the first step does not wait for
    compilation: the warm-up draws its input and its dropout masks from the training generator the trainer
    has just seeded, so every later mask shifts. Follows NVIDIA/Megatron-LM#2827 (JIT warm-up draws
    shifting the RNG stream that dropout sees) and NVIDIA/TransformerEngine#216 (a deterministic warm-up)."""

    def apply_features(self, module: torch.nn.Module) -> None:
        super().apply_features(module)
        assert self.settings is not None
        if not self.settings.compile:
            return
        first = next(m for m in module.modules() if isinstance(m, torch.nn.Linear))
        with torch.no_grad():
            module(torch.rand(2, first.in_features, device=first.weight.device))


class RoundsOptimizerState(_DataParallel):
    """Writes the optimizer's moments rounded to bf16 (to halve the checkpoint; the live state is kept): a
    resume restores every entry, slightly off. Follows microsoft/DeepSpeed#2071's class (a lower precision
    used where fp32 was expected) for the state a strategy writes."""

    def save_state(self, directory: Path) -> None:
        assert self.optimizer is not None
        kept: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        for state in self.optimizer.state.values():
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 1:
                    kept.append((state, key, value))
                    state[key] = value.to(torch.bfloat16).to(value.dtype)
        try:
            super().save_state(directory)
        finally:
            for state, key, value in kept:
                state[key] = value


BROKEN = {
    "diagnoses_control": (Control, "correct data parallel (the control)"),
    "clips_local_norm": (ClipsLocalNorm, "clips by each replica's local norm, reduces inside clip_grad_norm"),
    "prefixed_state_dict": (PrefixedStateDict, "exports its state with a 'module.' prefix"),
    "loss_divided_twice": (LossDividedTwice, "divides the loss for accumulation on top of the trainer"),
    "recomputes_forward": (RecomputesForward, "runs every forward twice: buffer updates applied twice"),
    "refuses_resume": (RefusesResume, "refuses to load a checkpoint while declaring resume supported"),
    "reports_clipped_norm": (ReportsClippedNorm, "returns the grad norm after clipping"),
    "syncs_first_micro_step": (SyncsFirstMicroStep, "synchronises at the first micro-step, not the last"),
    "rebuilds_optimizer": (RebuildsOptimizer, "rebuilds the optimizer without the factory's groups"),
    "reduces_in_bf16": (ReducesInBf16, "all-reduces fp32 gradients in bf16 under bf16-mixed"),
    "recomputes_without_rng": (RecomputesWithoutRng, "recomputes checkpointed blocks without restoring the RNG"),
    "rounds_optimizer_state": (RoundsOptimizerState, "writes the optimizer's moments rounded to bf16"),
    "warms_up_compiled_forward": (WarmsUpCompiledForward, "runs a compiled warm-up forward that draws masks"),
}


@unison.hookimpl
def unison_strategies() -> list[StrategySpec]:
    return [StrategySpec(name=name, factory=cls, description=text) for name, (cls, text) in BROKEN.items()]
