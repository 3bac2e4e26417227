"""The two loss forms a ``loss_fn`` or ``training_step`` may return, and the Hugging Face path.

* **A mean**: a 0-dim tensor, the micro-batch's mean loss. The step trains on
  the mean of the micro-batches' means (every slice weighs the same), which is
  the full batch's mean when every sample weighs the same.
* **A pair** ``(loss_sum, num_items)``: a summed loss and the number of items
  (tokens, labels, samples) it sums over. The step trains on
  ``sum over the global batch / num_items over the global batch``: every
  micro-batch and every data-parallel replica together, whatever the split. This
  is what a token-level loss on padded, variable-length batches needs: a mean
  per slice would re-weight tokens by how the global batch happens to be split
  (the Hugging Face Trainer's ``num_items_in_batch`` and torchtitan's global
  token count normalise the same way).

Only the value of ``N`` is unknown until every micro-batch has run, so the
trainer backpropagates the sums as it would means and scales the gradients
once afterwards (:class:`~unison.contract.ownership.LossNormalisation`).

:func:`huggingface_training_step` is the ``training_step`` ``fit`` uses when it is
given neither form and the batches are dicts with ``labels`` (a Hugging Face
model computing its own loss): it returns the pair, counting the labels the
model's loss really averages over.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from unison.errors import ConfigurationError

__all__ = [
    "IGNORE_INDEX",
    "LossValue",
    "check_huggingface_path",
    "huggingface_training_step",
    "loss_value",
]

#: The label that marks a position without a target (padding, prompts): PyTorch's and Hugging Face's default.
IGNORE_INDEX = -100


@dataclass(frozen=True)
class LossValue:
    """One micro-batch's loss as returned: ``loss`` to backpropagate and, for a pair, its item count."""

    #: The mean (``items is None``) or the sum: a 0-dim tensor that requires grad in training.
    loss: torch.Tensor
    #: The number of items ``loss`` sums over (a 0-dim float tensor on ``loss``'s device), or ``None``.
    items: torch.Tensor | None = None


def loss_value(value: Any, name: str) -> LossValue:
    """``value`` as a :class:`LossValue`; anything but a 0-dim tensor or a ``(0-dim tensor, count)`` pair is refused."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        loss, items = value
        if _scalar(loss) and (_scalar(items) or (isinstance(items, (int, float)) and not isinstance(items, bool))):
            if isinstance(items, torch.Tensor):
                count = items.detach().to(device=loss.device, dtype=torch.float32).reshape(())
            else:
                # torch.full: the count is a kernel argument, not a host-to-device copy (which would synchronise).
                count = torch.full((), float(items), dtype=torch.float32, device=loss.device)
            return LossValue(loss, count)
    elif _scalar(value):
        return LossValue(value)
    if isinstance(value, torch.Tensor):
        got = f"a tensor of shape {tuple(value.shape)}"
    elif isinstance(value, (tuple, list)):
        got = f"a {type(value).__name__} of {len(value)} items"
    else:
        got = type(value).__name__
    raise ConfigurationError(
        name,
        f"{name} returned {got}; the trainer needs the micro-batch's mean loss as a scalar tensor, or the pair "
        "(loss_sum, num_items): a 0-dim summed loss and the number of items (tokens, labels) it sums over",
        "return a 0-dim tensor that requires grad (e.g. reduce with .mean(); do not call .item()), or "
        "(losses.sum(), mask.sum()) for a loss normalised by the step's global item count",
    )


def _scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0


# --------------------------------------------------------------------------- #
# The Hugging Face path: no loss_fn, no training_step, dict batches with labels
# --------------------------------------------------------------------------- #


def _forward_parameters(model: torch.nn.Module) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature (a C extension): nothing can be promised
        return {}


def _accepts(params: Mapping[str, inspect.Parameter], name: str) -> bool:
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _shifts_labels(model: torch.nn.Module) -> bool:
    """Whether the model's own loss predicts token t+1 from token t (a causal LM: the first label is never a target).

    The Hugging Face Trainer's own rule: the model's loss function is
    ``ForCausalLMLoss`` (its ``loss_function``, resolved from ``loss_type`` or
    the class name), and the model is not an encoder-decoder (whose decoder is
    fed right-shifted inputs, so every label is a target).
    """
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # not a Hugging Face model's environment: the class name says it
        return type(model).__name__.endswith("ForCausalLM")
    try:
        return getattr(model, "loss_function", None) is ForCausalLMLoss
    except Exception:  # a model whose loss_function property cannot resolve: it names no causal LM loss
        return False


def check_huggingface_path(model: torch.nn.Module, first_batch: Any) -> None:
    """Refuse, before any process group, a model or batch the zero-code path cannot train."""
    fix = (
        "pass training_step=lambda model, batch: ... (returning the mean loss, or (loss_sum, num_items)) or "
        "loss_fn=... for (inputs, targets) batches"
    )
    if not isinstance(first_batch, Mapping) or not isinstance(first_batch.get("labels"), torch.Tensor):
        keys = f"a dict with keys {sorted(first_batch)[:8]}" if isinstance(first_batch, Mapping) else type(first_batch)
        raise ConfigurationError(
            "loss_fn/training_step",
            f"neither loss_fn nor training_step was given, so the model's own loss is trained, which needs dict "
            f"batches holding a 'labels' tensor (labels {IGNORE_INDEX} where there is no target); the batch is {keys}",
            fix,
        )
    if not _accepts(_forward_parameters(model), "labels"):
        raise ConfigurationError(
            "loss_fn/training_step",
            f"neither loss_fn nor training_step was given, so the model's own loss is trained, but "
            f"{type(model).__name__}.forward takes no labels argument (it computes no loss of its own)",
            fix,
        )


def count_labels(labels: torch.Tensor, shift: bool) -> torch.Tensor:
    """The labels a loss averages over: those ``!= -100``, the first of each row left out when ``shift``."""
    if shift:
        labels = labels[..., 1:]
    return (labels != IGNORE_INDEX).sum()


def huggingface_training_step(model: Any, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own loss as ``(loss_sum, num_items)``: the Hugging Face convention, split-independent.

    ``num_items`` counts the labels ``!= -100`` the model's loss averages over
    (a causal LM predicts each token from the ones before, so the first label of
    each row is not a target; a ``shift_labels`` tensor in the batch is counted as
    it is). A forward that accepts ``num_items_in_batch`` (every Hugging Face
    model with loss kwargs) is given this micro-batch's count and returns
    ``loss_sum / num_items``; one that does not returns the mean over the same
    labels. Either way ``loss * num_items`` is the micro-batch's summed loss, and
    the trainer divides the step's sum by its global count.
    """
    module = model.module if hasattr(model, "module") and isinstance(model.module, torch.nn.Module) else model
    labels = batch["shift_labels"] if isinstance(batch.get("shift_labels"), torch.Tensor) else batch["labels"]
    shift = "shift_labels" not in batch and _shifts_labels(module)
    items = count_labels(labels, shift).float()
    # At least 1: a micro-batch whose labels are all ignored then sums to 0 (0/0 would make its gradient nan).
    denominator = items.clamp(min=1)
    if _accepts(_forward_parameters(module), "num_items_in_batch"):
        out = model(**batch, num_items_in_batch=denominator)
    else:
        out = model(**batch)
    loss = out["loss"] if isinstance(out, Mapping) else getattr(out, "loss", None)
    if loss is None and isinstance(out, (tuple, list)):
        loss = out[0]
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ConfigurationError(
            "loss_fn/training_step",
            f"{type(module).__name__} returned no scalar loss for a batch with labels",
            "pass training_step=lambda model, batch: ... computing the loss",
        )
    return loss * denominator, items
