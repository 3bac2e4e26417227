"""What the suite reads off a strategy's objects and its collectives, as plain values a trace can hold.

A collective's payload (dtype, elements) from the process group backend's own profiler record; the
hyperparameters of an optimizer's parameter groups; a summary of an optimizer's state, entry by entry.
:mod:`unison.conformance.trace` records them during a run; :mod:`unison.conformance.checks.reported`
judges them.
"""

from __future__ import annotations

from typing import Any

import torch

#: Prefixes of the backend's own record of one collective's work, which carries the payload's dtype and shape
#: (``gloo:all_reduce``); the ``c10d::`` op above it often does not (its input is a tensor list).
PAYLOAD_PREFIXES = ("gloo:", "nccl:")


#: The profiler's dtype names -> torch's.
_DTYPE_NAMES = {
    "float": "float32",
    "double": "float64",
    "c10::BFloat16": "bfloat16",
    "c10::Half": "float16",
    "long int": "int64",
    "int": "int32",
}


#: Parameter-group keys that are implementation choices (how the update is computed), not hyperparameters.
_IMPLEMENTATION_KEYS = frozenset(
    {"params", "lr", "initial_lr", "foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay"}
)


def group_hyperparameters(optimizer: Any) -> list[dict[str, Any]] | None:
    """Each parameter group's hyperparameters (numbers, flags and tuples of numbers), ``lr`` and
    implementation flags apart; ``None`` without an optimizer."""
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        return None
    out = []
    for group in groups:
        kept: dict[str, Any] = {}
        for key, value in group.items():
            if key in _IMPLEMENTATION_KEYS:
                continue
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, (bool, int, float)) or (
                isinstance(value, tuple) and all(isinstance(x, (int, float)) for x in value)
            ):
                kept[key] = list(value) if isinstance(value, tuple) else value
        out.append(kept)
    return out


def optimizer_state_summary(optimizer: Any) -> dict[str, Any] | None:
    """Per state entry (``exp_avg``, ``step``...) of this rank's optimizer: its dtypes, how many tensors, the
    float64 sum of their absolute values, and the distinct values of one-element entries (step counters).

    Taken when a checkpoint is written and at a resumed run's first step, it shows whether the checkpoint
    gave back every entry, in its dtype and to the bit (a sum of 1e5 values changes with any rounding).
    Each entry also lists its tensors' parts (global shape, local shape, sum of |values|), from which the
    whole state over several ranks is put together (:func:`unison.conformance.checks.reported.whole_state`).
    """
    state = getattr(optimizer, "state", None)
    if state is None:
        return None
    entries: dict[str, dict[str, Any]] = {}
    for per_param in state.values():
        for key, value in per_param.items():
            entry = entries.setdefault(
                str(key), {"dtypes": set(), "count": 0, "total": 0.0, "scalars": set(), "parts": []}
            )
            entry["count"] += 1
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                entry["dtypes"].add(str(local.dtype).removeprefix("torch."))
                absolute = float(local.detach().double().abs().sum())
                entry["total"] += absolute
                entry["parts"].append([list(value.shape), list(local.shape), absolute])
                if local.numel() == 1:
                    entry["scalars"].add(float(local))
            elif isinstance(value, (bool, int, float)):
                entry["dtypes"].add(type(value).__name__)
                entry["total"] += abs(float(value))
                entry["scalars"].add(float(value))
    return {
        k: {
            "dtypes": sorted(e["dtypes"]),
            "count": e["count"],
            "total": e["total"],
            "scalars": sorted(e["scalars"]),
            # Each tensor's [global shape, local shape, sum of |values|]: what a rank holds of the whole.
            "parts": sorted(e["parts"]),
        }
        for k, e in sorted(entries.items())
    }


def payload(event: Any) -> tuple[str, int] | None:
    """``(dtype, elements)`` of a backend's collective record (``gloo:all_reduce``), or ``None``; ``event``
    has the profiler's ``shapes`` and ``dtypes`` (:class:`unison.conformance.profiling.Record`)."""
    dtypes = list(getattr(event, "dtypes", None) or [])
    shapes = list(getattr(event, "shapes", None) or [])
    if not dtypes or not shapes or not isinstance(shapes[0], list):
        return None
    numel = 1
    for n in shapes[0]:
        numel *= int(n)
    return _DTYPE_NAMES.get(dtypes[0], dtypes[0]), numel


__all__ = ["PAYLOAD_PREFIXES", "group_hyperparameters", "optimizer_state_summary", "payload"]
