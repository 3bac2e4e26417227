"""What a strategy builds and sends, checked against what it declares: optimizer groups, reduction dtypes.

Parameter groups. The optimizer the strategy steps (``strategy.optimizer``,
read at a run's first step, after a resume loaded its state) must keep the
parameter groups of the optimizer the user's factory built: the same distinct
hyperparameters (weight decay, betas, momentum... ``lr`` apart, which is compared
at every step), every rank's groups among the reference's and, over all ranks,
all of them. A strategy that rebuilds the optimizer from ``module.parameters()``
and the class defaults loses them.

Optimizer state read back. Every resume of the strategy's own checkpoint at the
same world size (in the same processes or in new ones) must give the optimizer
back the state it had when the checkpoint was written: every entry
(``exp_avg``, ``momentum_buffer``, ``step``...), in its dtype, with the same
step counters and to the bit (the float64 sum of each entry's absolute values,
relative agreement :data:`ROUNDTRIP_MATCH`). A checkpoint that keeps moments in
bf16 to halve its size moves the resumed weights by less than the fp32
tolerance in a few steps; only this check sees it.

Reduction dtypes. Under a precision the trainer (or its precision plugin)
applies, parameters and gradients stay fp32 (autocast computes in bf16/fp16,
the masters and their gradients do not), so every reduction of more than one
element inside the forward/backward window (a gradient all-reduce or
reduce-scatter) carries fp32 data on a flat data-parallel world. Recorded from
the process group backend's own record of each collective (its payload's dtype
and shape), as the sync checks count collectives, in the scenarios where
:func:`~unison.conformance.profiling.records_payloads` turns it on. A strategy that casts the
gradients to bf16 to halve the traffic while declaring a trainer-applied
``bf16-mixed`` rounds every reduction: its weights drift by about 1e-3 after a
few steps, inside the bf16 tolerance, so only this check sees it. Engine- or
strategy-owned precision (FSDP's ``reduce_dtype``, DeepSpeed's
``communication_data_type``) and composed meshes (tensor-parallel activations
are reduced in the compute dtype) are shown, not judged: the dtypes every
strategy reduced in, per precision, are on its certificate.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from unison.conformance.checks.numeric import Checker
from unison.contract.ownership import PrecisionOwner

#: Reduction dtypes lower than fp32, which a trainer-applied precision never reduces gradients in.
LOW_PRECISION = frozenset({"bfloat16", "float16"})


def _key(group: dict[str, Any], keys: set[str]) -> str:
    return repr(sorted((k, group.get(k)) for k in keys))


def check_param_groups(c: Checker, label: str, trace: dict[str, Any], reference: dict[str, Any] | None) -> None:
    """The optimizer the strategy steps has the groups the factory built (distinct hyperparameters)."""
    want = (reference or {}).get("param_groups")
    if not want:
        return
    ranks = trace.get("ranks") or [trace]
    c.checks.append(f"{label}: the optimizer it steps keeps the factory's {len(want)} parameter group(s)")
    for r, rt in enumerate(ranks):
        if rt.get("param_groups") is None:
            c.fail(label, f"parameter groups on rank {r}", note="not recorded (no strategy.optimizer)", kind="groups")
            return
    # Compared on the hyperparameters both optimizers have: a strategy may step another optimizer class
    # (a fused or sharded Adam without ``amsgrad``/``maximize``) built from the factory's groups.
    keys = set().union(*(g.keys() for g in want)) & set().union(*(g.keys() for rt in ranks for g in rt["param_groups"]))
    expected = {_key(g, keys) for g in want}
    seen: set[str] = set()
    for r, rt in enumerate(ranks):
        groups = rt["param_groups"]
        mine = {_key(g, keys) for g in groups}
        seen |= mine
        if not mine <= expected:
            c.fail(
                label,
                f"parameter groups on rank {r}",
                expected=[{k: g.get(k) for k in sorted(keys)} for g in want],
                got=[{k: g.get(k) for k in sorted(keys)} for g in groups],
                kind="groups",
                note="the optimizer the strategy steps lost or changed the hyperparameters of the factory's groups",
            )
            return
    if seen != expected:
        c.fail(
            label,
            "parameter groups over all ranks",
            expected=len(expected),
            got=len(seen),
            kind="groups",
            note="some of the factory's parameter groups are on no rank's optimizer",
        )


#: Relative agreement of an optimizer state entry's sum before the save and after the load: far below bf16
#: (4e-3) and fp16 (5e-4) rounding, above float64 summation-order noise.
ROUNDTRIP_MATCH = 1e-9


def _relative(saved: dict[str, Any], loaded: dict[str, Any]) -> float:
    """The relative difference of one entry's sum of absolute values, saved against loaded."""
    return abs(saved["total"] - loaded["total"]) / max(abs(saved["total"]), 1e-30)


def roundtrip_differences(saved: dict[str, Any], loaded: dict[str, Any]) -> list[str]:
    """What the loaded optimizer state lacks or changed against the saved one (empty when equal)."""
    out = []
    for key in sorted(set(saved) | set(loaded)):
        a, b = saved.get(key), loaded.get(key)
        if a is None or b is None:
            out.append(f"{key}: {'not restored' if b is None else 'not saved'}")
            continue
        if a["dtypes"] != b["dtypes"]:
            out.append(f"{key}: dtype {'/'.join(a['dtypes'])} saved, {'/'.join(b['dtypes'])} loaded")
        elif a["count"] != b["count"]:
            out.append(f"{key}: {a['count']} entries saved, {b['count']} loaded")
        elif a["scalars"] != b["scalars"]:
            out.append(f"{key}: values {a['scalars'][:4]} saved, {b['scalars'][:4]} loaded")
        elif _relative(a, b) > ROUNDTRIP_MATCH:
            out.append(f"{key}: sum of |values| {a['total']:.12g} saved, {b['total']:.12g} loaded")
    return out


def whole_state(summaries: list[dict[str, Any] | None]) -> dict[str, Any]:
    """The whole optimizer state from per-rank summaries, entry by entry: dtypes, sum of |values|, step counters.

    Each rank's tensors are parts (global shape, local shape, sum of |values|) of the whole; a part held by
    several ranks (DDP's replicas, HSDP's replicate dim, a layer tensor parallel leaves whole on every
    rank) counts once: each distinct part as often as one rank holds it. Entry counts, one-element values
    other than ``step`` and the sum of the ``step`` counters (one per tensor) depend on how the state is cut
    (a flat shard against per-parameter tensors), so they are not part of the whole; the counters' values
    are. (Two different tensors on two ranks with the same shapes and sums to the bit would count once:
    float sums of different state make that improbable.)
    """
    out: dict[str, dict[str, Any]] = {}
    held: dict[str, Counter[tuple[str, str, float]]] = {}
    for summary in summaries:
        for key, e in (summary or {}).items():
            o = out.setdefault(key, {"dtypes": set(), "count": None, "total": 0.0, "scalars": set()})
            o["dtypes"] |= set(e["dtypes"])
            if key == "step":  # one counter per tensor: its values, not their sum, are the state
                o["scalars"] |= set(e["scalars"])
                continue
            parts = e.get("parts")
            if parts is None:  # a summary without parts: its sum is one part
                parts = [["", "", e["total"]]]
            here = Counter((str(g), str(local), float(v)) for g, local, v in parts)
            held[key] = held.get(key, Counter()) | here  # as often as one rank holds it
    for key, parts in held.items():
        out[key]["total"] = sum(v * n for (_, _, v), n in parts.items())
    return {k: {**e, "dtypes": sorted(e["dtypes"]), "scalars": sorted(e["scalars"])} for k, e in out.items()}


def _saved_last(trace: dict[str, Any]) -> dict[str, Any] | None:
    saved_at = trace.get("saved_optimizer_state") or {}
    return saved_at[max(saved_at, key=int)] if saved_at else None


def check_optimizer_roundtrip(c: Checker, run: Any, label: str, trace: dict[str, Any], part: Any) -> None:
    """Every resume restores the optimizer state that was written (``part``: the run that wrote it).

    In the same processes' layout (the strategy's own checkpoint at the same world size) rank by rank,
    entry counts included; across a world-size or strategy change (reshard, cross resume) the whole state
    (:func:`whole_state`): what each rank holds changes, the state does not.
    """
    if run.resume_from is None or not part:
        return
    ranks = trace.get("ranks") or [trace]
    written = part.get("ranks") or [part]
    same_layout = ":" not in run.resume_from and run.world != "alt" and len(ranks) == len(written)
    if same_layout:
        pairs = [
            (f"rank {r}", _saved_last(pt), rt.get("loaded_optimizer_state"))
            for r, (rt, pt) in enumerate(zip(ranks, written))
        ]
        c.checks.append(f"{label}: the optimizer state it resumed with is the state saved, entry by entry, to the bit")
    else:
        saved = [_saved_last(pt) for pt in written]
        loaded = [rt.get("loaded_optimizer_state") for rt in ranks]
        if not any(saved) or not any(loaded):
            return
        pairs = [(f"{len(written)} -> {len(ranks)} ranks", whole_state(saved), whole_state(loaded))]
        c.checks.append(
            f"{label}: the whole optimizer state it resumed with ({len(ranks)} ranks) is the state the "
            f"{len(written)} ranks saved: every entry's dtypes, sum of |values| (1e-9) and step counters"
        )
    for where, saved_state, loaded_state in pairs:
        if not saved_state or loaded_state is None:
            continue
        differences = roundtrip_differences(saved_state, loaded_state)
        if not differences:
            continue
        # Numeric when only sums differ (the deciding check's margin): their largest relative difference.
        shared = [k for k in saved_state if k in loaded_state and saved_state[k]["dtypes"] == loaded_state[k]["dtypes"]]
        relative = max((_relative(saved_state[k], loaded_state[k]) for k in shared), default=0.0)
        numeric = relative > ROUNDTRIP_MATCH
        c.fail(
            label,
            f"optimizer state on resume, {where}",
            # A changed value is seen at the resumed run's first step, before any of its numbers; a lost
            # entry has no step (the numbers that follow show where it matters).
            step=(trace.get("steps") or [{}])[0].get("step") if numeric else None,
            expected="the state saved",
            got="; ".join(differences),
            deviation=relative if numeric else None,
            tolerance=ROUNDTRIP_MATCH if numeric else None,
            kind="optimizer_state",
            note="the checkpoint did not give the optimizer back the state it had when it was written",
        )


def reduction_dtypes(trace: dict[str, Any]) -> dict[str, int]:
    """Every rank's reductions of more than one element in the forward/backward windows, by dtype."""
    out: dict[str, int] = {}
    for rt in trace.get("ranks") or [trace]:
        for dtype, n in ((rt.get("collectives") or {}).get("reduction_dtypes") or {}).items():
            out[dtype] = out.get(dtype, 0) + n
    return out


def check_reduction_dtypes(c: Checker, precision: str, label: str, trace: dict[str, Any]) -> None:
    """Under a trainer-applied precision on a flat data-parallel world: gradients reduced in fp32."""
    owner = trace.get("precision_owner")
    if owner not in (PrecisionOwner.TRAINER.value, PrecisionOwner.PLUGIN.value) or trace.get("mesh"):
        return
    if trace.get("data_parallel_size", 1) < 2 or trace.get("data_parallel_size") != trace.get("world_size"):
        return
    seen = reduction_dtypes(trace)
    if not seen:
        return
    c.checks.append(
        f"{label}: {precision} applied by the {owner}: fp32 parameters and gradients, every gradient reduction in "
        f"fp32 (seen: {', '.join(f'{k} x{v}' for k, v in sorted(seen.items()))})"
    )
    low = {k: v for k, v in seen.items() if k in LOW_PRECISION}
    if low:
        c.fail(
            label,
            "gradient reduction dtype",
            expected="float32",
            got=", ".join(f"{k} x{v}" for k, v in sorted(low.items())),
            kind="reduction",
            note=f"under {precision} applied by the {owner} the gradients are fp32; reducing them in "
            f"{'/'.join(sorted(low))} rounds every synchronised gradient, which the declaration does not say",
        )


__all__ = [
    "LOW_PRECISION",
    "ROUNDTRIP_MATCH",
    "check_optimizer_roundtrip",
    "check_param_groups",
    "check_reduction_dtypes",
    "reduction_dtypes",
    "roundtrip_differences",
]
