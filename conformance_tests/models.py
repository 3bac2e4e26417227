"""The scenarios' models, optimizers and losses (all tiny, all built from one seed).

Models (all tiny, all built from one seed; the ``replica_init`` scenarios then
perturb every rank but 0 on purpose):

* ``mlp``: three ``Linear`` layers with ``Tanh``; an ``nn.Sequential`` so that
  pipeline strategies can split it, with a tensor-parallel plan (``tp_plan``,
  :data:`MLP_TP_PLAN`) so that tensor-parallel strategies can split it too
  (``frozen``, ``groups`` and ``offset`` are built on it and keep the plan;
  the BatchNorm and tied models have none).
* ``batchnorm``: an MLP with a :class:`DriftingBatchNorm1d`, whose buffers
  (running statistics and a step counter) change at every training forward,
  identically on every rank and in the reference.
  Why not plain ``BatchNorm1d`` in training mode: each data-parallel rank would
  normalise with the statistics of its own slice of the micro-batch, which is
  not what one process on the full batch computes, so no strategy could match
  the reference (the divergence is a modelling choice, not a backend defect).
  ``SyncBatchNorm`` would fix that but refuses CPU tensors in torch 2.13 ("expected
  input tensor to be on GPU"), so it cannot run on gloo. The layer therefore
  normalises with its running statistics and updates them from a quantity every
  replica shares: its own parameters (see the class). A strategy that loses
  buffer updates, exports stale buffers or lets replicas' buffers drift apart
  changes both the outputs and the final state.
* ``frozen``: the MLP with its first layer frozen (``requires_grad=False``).
* ``tied``: an encoder/decoder pair sharing one weight matrix, plus a head.
* ``offset``: the MLP with its output bias at :data:`OUTPUT_OFFSET`, trained on
  targets moved there (``data="offset"``): bf16 rounds its predictions to whole
  numbers, so mixed precision visibly changes training (the precision scenario).
* ``blocks``: an ``nn.Sequential`` of a ``Linear``, two blocks of ``Linear``/``Tanh`` pairs, and a
  ``Linear`` (the activation checkpointing scenario: blocks whose forward is recomputed).
* ``dropout_blocks``: ``blocks`` with a ``Dropout(0.1)`` in each block (the activation checkpointing RNG
  scenario: a recompute that does not restore the RNG state draws other masks).
* ``block``: a transformer block (causal self-attention + MLP, pre-norm, residuals)
  over the features cut into tokens, an ``nn.Sequential`` (embed, block, head:
  pipelines cut it), so every family runs it. It declares no tensor-parallel
  plan of its own: this module is a plugin (entry point ``conformance_models`` of
  the ``unison`` group) whose ``unison_tensor_parallel_plan`` registers
  :data:`TRANSFORMER_BLOCK_TP_PLAN` for every :class:`TransformerBlock`, so
  tensor-parallel strategies split it through the plugin path a third party uses.
* ``dropout``: the MLP with a ``Dropout(0.3)`` before its head (where every tensor-parallel rank holds
  the whole activation): its masks come from the global generator, so anything that draws from it,
  or fails to restore it, changes the weights (the ``default_plugins`` and ``fresh_resume`` scenarios).
* ``token_lm`` and ``llama``: a language model for the token-loss scenarios, an ``nn.Sequential``
  and a Hugging Face ``LlamaForCausalLM`` (:mod:`unison.conformance.workloads`).
* ``groups``: the MLP trained with two parameter groups (matrices: one lr and
  weight decay; vectors: half the lr, no weight decay). Groups are formed by
  ``param.ndim`` because the optimizer factory receives the parameters a
  strategy trains, without names (DTensor parameters keep their global shape,
  so the split is the same for sharded strategies).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from unison.conformance import workloads
from unison.plugin import hookimpl

IN_FEATURES = 8


HIDDEN = 16


#: The value planted in the overflow sample's inputs: above fp16's largest
#: finite value (65504), so the cast to float16 inside autocast makes it ``inf``
#: in a real forward, on every backend, whatever the loss scale.
OVERFLOW_INPUT = 1.0e6


#: The offset of the ``offset`` data's targets and of the ``offset`` model's output bias. bf16 holds
#: 8 significant bits, so an output near 128 is rounded to a whole number (its spacing there is 1):
#: under bf16 every prediction moves by up to 0.5, against residuals of order 1, while fp32 keeps them
#: to 1e-5. The bf16 effect is therefore far larger than the rounding noise two backends of the same
#: precision differ by (that noise comes from sums over the batch, the effect from every prediction).
OUTPUT_OFFSET = 128.0


class DriftingBatchNorm1d(torch.nn.BatchNorm1d):
    """BatchNorm whose buffers change at every training forward, the same way on every rank.

    In training mode each forward first counts itself in ``num_batches_tracked``
    and moves the running statistics by ``momentum`` towards values computed
    from the layer's own parameters (``running_mean`` towards ``bias``,
    ``running_var`` towards ``1 + weight**2``). Parameters are equal on every
    replica and in the reference, and every rank runs the forward of every
    micro-batch (a slice of it), so the buffers evolve identically everywhere
    although each rank sees different samples. Then it normalises with the
    running statistics, as BatchNorm does in eval mode (see the module docstring
    for why batch statistics cannot be compared on CPU). Eval-mode forwards
    (validation) change nothing.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                m = self.momentum if self.momentum is not None else 0.1
                self.num_batches_tracked.add_(1)
                self.running_mean.mul_(1 - m).add_(self.bias.detach().to(self.running_mean.dtype), alpha=m)
                target_var = 1.0 + self.weight.detach().to(self.running_var.dtype).square()
                self.running_var.mul_(1 - m).add_(target_var, alpha=m)
        # Copies: the buffers change in place at the next micro-batch's forward,
        # while a pipeline schedule may still hold this graph for its backward.
        return torch.nn.functional.batch_norm(
            input, self.running_mean.clone(), self.running_var.clone(), self.weight, self.bias, False, 0.0, self.eps
        )


class TiedAutoencoder(torch.nn.Module):
    """``head(tanh(decoder(tanh(encoder(x)))))`` with ``decoder.weight is encoder.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(IN_FEATURES, IN_FEATURES)
        self.decoder = torch.nn.Linear(IN_FEATURES, IN_FEATURES)
        self.decoder.weight = self.encoder.weight  # the tie
        self.head = torch.nn.Linear(IN_FEATURES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.decoder(torch.tanh(self.encoder(x)))))


#: The tensor-parallel plan of the MLP-based models (Megatron's MLP pairing: the first Linear split by
#: output features, the second by input features, the head whole); strategies without tensor parallel
#: ignore it.
MLP_TP_PLAN = {"0": "colwise", "2": "rowwise"}


def _mlp() -> torch.nn.Sequential:
    model = torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, 1),
    )
    model.tp_plan = dict(MLP_TP_PLAN)
    return model


def _batchnorm() -> torch.nn.Sequential:
    model = torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN),
        DriftingBatchNorm1d(HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, 1),
    )
    bn = model[1]
    with torch.no_grad():
        # Non-trivial statistics and affine parameters: the drift targets
        # differ per feature, and a strategy that drops or re-initialises
        # buffers changes every output.
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
        bn.num_batches_tracked.fill_(7)
    return model


def _dropout() -> torch.nn.Sequential:
    """The MLP with ``Dropout(0.3)`` before the head; the tensor-parallel plan's indices are unchanged."""
    model = torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Dropout(0.3),
        torch.nn.Linear(HIDDEN, 1),
    )
    model.tp_plan = dict(MLP_TP_PLAN)
    return model


def _frozen() -> torch.nn.Sequential:
    model = _mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    return model


def _frozen_batchnorm() -> torch.nn.Sequential:
    """The ``batchnorm`` model with its first layer frozen: resume checks buffers and frozen weights."""
    model = _batchnorm()
    for p in model[0].parameters():
        p.requires_grad_(False)
    return model


def _offset() -> torch.nn.Sequential:
    """The MLP whose output bias starts at :data:`OUTPUT_OFFSET` (the ``offset`` data's targets sit there)."""
    model = _mlp()
    with torch.no_grad():
        model[4].bias.add_(OUTPUT_OFFSET)
    return model


def _blocks() -> torch.nn.Sequential:
    """An ``nn.Sequential`` whose two middle children are blocks of two ``Linear`` + ``Tanh`` each.

    What activation checkpointing needs to show: a checkpointed block whose forward really runs again in
    backward. A block that is one ``Linear`` keeps only its input and weight, which non-reentrant
    checkpointing recovers without running anything (it stops recomputing once every saved tensor is back).
    """

    def block() -> torch.nn.Sequential:
        return torch.nn.Sequential(
            torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh()
        )

    return torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, HIDDEN), block(), block(), torch.nn.Linear(HIDDEN, 1))


def _dropout_blocks() -> torch.nn.Sequential:
    """The ``blocks`` model with a ``Dropout(0.1)`` inside each block: a recomputed forward draws its masks
    again, so only a recompute that restores the RNG state reproduces the forward that ran."""

    def block() -> torch.nn.Sequential:
        return torch.nn.Sequential(
            torch.nn.Linear(HIDDEN, HIDDEN),
            torch.nn.Tanh(),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(HIDDEN, HIDDEN),
            torch.nn.Tanh(),
        )

    return torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, HIDDEN), block(), block(), torch.nn.Linear(HIDDEN, 1))


#: The ``block`` model's sequence: each sample's :data:`IN_FEATURES` features read as ``TOKENS`` tokens.
TOKENS = 4
#: The block's width and its attention heads (head size 4; tensor parallel at 2 keeps one head per rank).
BLOCK_DIM, BLOCK_HEADS = 8, 2


class SequenceEmbed(torch.nn.Module):
    """``(batch, IN_FEATURES)`` -> ``(batch, TOKENS, BLOCK_DIM)``: the features cut into tokens, each projected."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(IN_FEATURES // TOKENS, BLOCK_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.reshape(x.shape[0], TOKENS, -1))


class TransformerBlock(torch.nn.Module):
    """A pre-norm transformer block: causal multi-head self-attention, then a tanh MLP, each with a residual.

    The head count is read from the projection's output (``view(..., -1, head_dim)``), so the block runs
    unchanged when tensor parallel leaves each rank a slice of the heads (``q``/``k``/``v`` split by output
    features, ``o`` by input features; ``up`` and ``down`` the same way).
    """

    def __init__(self, dim: int = BLOCK_DIM, heads: int = BLOCK_HEADS, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.q = torch.nn.Linear(dim, dim)
        self.k = torch.nn.Linear(dim, dim)
        self.v = torch.nn.Linear(dim, dim)
        self.o = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        b, t, _ = h.shape
        q, k, v = (proj(h).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attended.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(torch.tanh(self.up(self.norm2(x))))


class PoolHead(torch.nn.Module):
    """Mean over the tokens, then one output."""

    def __init__(self) -> None:
        super().__init__()
        self.out = torch.nn.Linear(BLOCK_DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x.mean(dim=1))


#: The tensor-parallel plan of a :class:`TransformerBlock`, relative to the block (Megatron's: the attention
#: projections q, k, v colwise, the output projection rowwise; the MLP's up colwise, down rowwise).
TRANSFORMER_BLOCK_TP_PLAN = {
    "q": "colwise",
    "k": "colwise",
    "v": "colwise",
    "o": "rowwise",
    "up": "colwise",
    "down": "rowwise",
}


@hookimpl
def unison_tensor_parallel_plan(module: torch.nn.Module) -> dict[str, str] | None:
    """:data:`TRANSFORMER_BLOCK_TP_PLAN` for a :class:`TransformerBlock` (any model holding one gets it under
    the block's name: ``1.q``, ... in the ``block`` model); ``None`` for every other module."""
    return dict(TRANSFORMER_BLOCK_TP_PLAN) if isinstance(module, TransformerBlock) else None


def _block() -> torch.nn.Sequential:
    """``head(block(embed(x)))`` as an ``nn.Sequential`` (so every pipeline can cut it); tensor-parallel
    strategies split the block by the plan registered for :class:`TransformerBlock`
    (:func:`unison_tensor_parallel_plan`), data-parallel strategies train it whole.

    Its children keep the Sequential's index names, as the other models do: ``deepspeed_pipeline``
    exports a Sequential's state under the indices of its layer list, so named children would come back
    under other keys (the suite fails that as "state_dict keys").
    """
    return torch.nn.Sequential(SequenceEmbed(), TransformerBlock(), PoolHead())


MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "mlp": _mlp,
    "batchnorm": _batchnorm,
    "frozen": _frozen,
    "frozen_batchnorm": _frozen_batchnorm,
    "tied": TiedAutoencoder,
    "groups": _mlp,
    "offset": _offset,
    "blocks": _blocks,
    "dropout_blocks": _dropout_blocks,
    "block": _block,
    "dropout": _dropout,
    "token_lm": workloads.TokenLM,
    "llama": workloads.llama,
}


def build_model(name: str, seed: int = 0) -> torch.nn.Module:
    """The scenario model ``name``, initialised from ``seed`` (the same on every rank)."""
    torch.manual_seed(seed)
    return MODELS[name]()


#: What ``replica_init`` scenarios perturb on every rank but 0.
Perturbation = Literal["weights", "buffers"]


def perturb(model: torch.nn.Module, what: Perturbation, rank: int) -> None:
    """Move rank ``rank``'s copy away from rank 0's before the model is handed to the trainer.

    The trained result must still equal the reference: whoever the declaration
    says makes replicas equal (``Ownership.replica_init``) must do it.
    """
    g = torch.Generator().manual_seed(1000 + rank)
    with torch.no_grad():
        if what == "weights":
            for p in model.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        else:
            for b in model.buffers():
                if b.is_floating_point():
                    b.mul_(1.5).add_(0.25)  # stays a valid (positive) variance
                else:
                    b.add_(3 + rank)


def _split_groups(params: Any) -> list[dict[str, Any]]:
    params = list(params)
    matrices = [p for p in params if p.ndim >= 2]
    vectors = [p for p in params if p.ndim < 2]
    return [
        {"params": matrices, "lr": 2e-2, "weight_decay": 0.1},
        {"params": vectors, "lr": 1e-2, "weight_decay": 0.0},
    ]


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    # SGD: an update proportional to the gradient, so a wrong gradient scale
    # (double averaging, a missed loss division) shows in the weights at once;
    # Adam would normalise most of it away.
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01),
    # Weight decay large enough that decaying a frozen parameter (one the strategy handed to the
    # optimizer with a zero gradient) shrinks it by lr * weight_decay = 4% per step: the next loss
    # moves ~100x its tolerance (0.1 moved it 3x).
    "adamw_decay": lambda params: torch.optim.AdamW(params, lr=2e-2, weight_decay=2.0),
    "adamw_groups": lambda params: torch.optim.AdamW(_split_groups(params)),
    # Per-parameter state other than Adam's (a running average of squared gradients and a momentum
    # buffer), created lazily at the first step like Adam's.
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-2, momentum=0.5),
    # Per-parameter state created eagerly, in the constructor (a sum of squared gradients started at
    # initial_accumulator_value, and a step count that lr_decay reads), where the others create theirs
    # at the first step; in two parameter groups (per-group lr and weight decay, as adamw_groups).
    "adagrad_groups": lambda params: torch.optim.Adagrad(
        _split_groups(params), lr_decay=0.05, initial_accumulator_value=0.1
    ),
}


#: The class each optimizer factory returns (named in what a run needs).
_OPTIMIZER_CLASSES = {
    "sgd": "torch.optim.SGD",
    "adamw": "torch.optim.AdamW",
    "adamw_decay": "torch.optim.AdamW",
    "adamw_groups": "torch.optim.AdamW",
    "rmsprop": "torch.optim.RMSprop",
    "adagrad_groups": "torch.optim.Adagrad",
}


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "warmup": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3)),
}


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error in fp32 (autocast outputs are cast up first)."""
    return torch.nn.functional.mse_loss(outputs.float(), targets.float())


def training_step(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The ``training_step`` form on dict batches: the same loss as :func:`loss_fn`."""
    return loss_fn(model(batch["x"]), batch["y"])
