"""Rules read from what a strategy built, sent and reported, rather than from where the numbers left the reference.

Each decides from direct evidence: the dtype the gradient reductions carried and the groups they ran on,
the optimizer's parameter groups, the state-dict key sets, where the
reductions ran (inside ``clip_grad_norm``), the grad norm the
strategy returned against the clip value, the initial value of a frozen
parameter, the count of an integer buffer.
"""

from __future__ import annotations

import torch

from unison.conformance.diagnosis.evidence import Evidence, Finding, run_of
from unison.conformance.models import build_model


def reduction_dtype(e: Evidence) -> Finding | None:
    """Gradients reduced in a lower precision than the fp32 gradients a trainer-applied precision keeps."""
    d = next(iter(e.by_kind.get("reduction", [])), None)
    if d is None:
        return None
    return (
        "reduction_dtype",
        d,
        f"the gradient reductions carried {d.got} data (recorded from the process group's own record of each "
        f"collective); {d.note}. Reduce the gradients in their own dtype, or declare the precision owned by the "
        "strategy with the reduction dtype in its detail",
    )


def reduction_group(e: Evidence) -> Finding | None:
    """Gradients reduced over fewer ranks than the data-parallel replicas (a subgroup, a node's ranks)."""
    d = next(iter(e.by_kind.get("reduction_group", [])), None)
    if d is None:
        return None
    return (
        "reduction_group",
        d,
        f"the gradient reductions ran on process groups that join only {d.got} (torch's flight recorder names "
        f"each collective's group); {d.note}, so the replicas' weights part. Reduce over the data-parallel "
        "group of the declared mesh (every replica), or declare the mesh the reductions follow",
    )


def param_groups(e: Evidence) -> Finding | None:
    """The optimizer the strategy steps lost or changed the factory's parameter groups."""
    d = next(iter(e.by_kind.get("groups", [])), None)
    if d is None:
        return None
    return (
        "param_groups",
        d,
        "the optimizer the strategy steps does not have the parameter groups the user's factory built "
        f"(expected {d.expected}, got {d.got}): an optimizer rebuilt from module.parameters() and the class "
        "defaults loses per-group hyperparameters; build it with the factory (build_optimizer) and keep that one",
    )


def _prefix(missing: list[str], extra: list[str]) -> str | None:
    """The prefix that maps every missing key to an extra one (``module.``), or ``None``."""
    if not missing or len(missing) != len(extra):
        return None
    for key in extra:
        if key.endswith(missing[0]) and key != missing[0]:
            prefix = key[: -len(missing[0])]
            if sorted(prefix + m for m in missing) == sorted(extra):
                return prefix
    return None


def state_dict_keys(e: Evidence) -> Finding | None:
    """The canonical state's names are not the model's own (a wrapper's prefix, renamed or lost keys)."""
    d = next((x for x in e.by_kind.get("state", []) if x.quantity == "state_dict keys"), None)
    if d is None:
        return None
    # The key sets themselves, from the two runs' final states.
    got = set((e.trace_of(d.run) or {}).get("state") or {})
    want = set((e.trace_of(d.against or "") or {}).get("state") or {})
    missing, extra = sorted(want - got), sorted(got - want)
    prefix = _prefix(missing, extra)
    what = (
        f"every key carries the prefix {prefix!r} (a wrapper's name, as DistributedDataParallel's 'module.')"
        if prefix
        else f"{len(missing)} of the model's names missing, {len(extra)} others present"
    )
    return (
        "state_dict_keys",
        d,
        f"the canonical state's names are not the model's own: {what}. full_state_dict() and the checkpoint must "
        "use the unwrapped module's names, so a checkpoint loads into the plain model and under every backend",
    )


def clip_before_sync(e: Evidence) -> Finding | None:
    """Reductions ran inside clip_grad_norm and no gradient collective in forward/backward."""
    for label, trace in sorted(e.strat.items()):
        ranks = trace.get("ranks") or [trace]
        coll = [r.get("collectives") or {} for r in ranks]
        in_clip = sum(c.get("reductions_in_clip", 0) for c in coll)
        # No gradient collective in any forward/backward window (counted from the c10d ops, timed in the
        # calling thread; a backend's own record may run a little later, on its worker thread).
        in_window = sum(sum(c.get("gradient_sync_per_step") or [0]) for c in coll)
        if in_clip and not in_window:
            d = next((x for x in e.divergences if x.run == f"strategy:{label}"), e.first)
            return (
                "clip_before_sync",
                d,
                f"strategy:{label} reduced only inside clip_grad_norm ({in_clip} reductions over its ranks, no "
                "gradient collective in forward/backward): each replica measured and clipped its own unsynchronised "
                "gradients, by its local norm, and averaged them afterwards. Synchronise in backward (at the "
                "boundary), then clip by the global norm of the synchronised gradients",
            )
    return None


#: Relative agreement of a reported grad norm with the clip value.
_CLIP_MATCH = 1e-4


def reported_grad_norm(e: Evidence) -> Finding | None:
    """Every grad norm that differs equals the clip value where the reference's is above it: the reported
    norm is the clipped one, while the update (the losses, the weights) matches."""
    clip = e.scenario.grad_clip_norm
    if clip is None or not e.norms or e.losses or "state" in e.by_kind:
        return None
    clipped = [
        d
        for d in e.norms
        if isinstance(d.got, float)
        and isinstance(d.expected, float)
        and d.expected > clip
        and abs(d.got - clip) <= _CLIP_MATCH * clip
    ]
    if len(clipped) != len(e.norms):
        return None
    d = clipped[0]
    return (
        "reported_grad_norm",
        d,
        f"the grad norm the strategy reported equals the clip value {d.got:.6g} at every step whose pre-clip norm "
        f"is above it (reference {d.expected:.6g}), and every loss and weight matches: clip_grad_norm returns the "
        "norm after clipping. It must return the global norm before clipping (what torch.nn.utils.clip_grad_norm_ "
        "returns), which the trainer logs and the hooks receive",
    )


def feature_rng(e: Evidence) -> Finding | None:
    """A run with activation checkpointing (or compile) differs from the strategy's own run without it, on a
    model with Dropout: the recomputed (or compiled) forward drew other masks than the forward that ran."""
    if not any(isinstance(m, torch.nn.Dropout) for m in build_model(e.scenario.model).modules()):
        return None
    for d in e.divergences:
        run = run_of(e.scenario, d.run)
        features = dict(run.overrides) if run is not None else {}
        asked = [k for k in ("activation_checkpointing", "compile") if features.get(k) not in (None, False)]
        if run is None or run.backend != "strategy" or not asked or not (d.against or "").startswith("strategy:"):
            continue
        cause = (
            "the recomputed forward drew other dropout masks than the forward that ran (the RNG state not "
            "restored before recomputing: torch.utils.checkpoint's preserve_rng_state=False, or a hand-written "
            "recompute), so the gradients are of another forward"
            if "activation_checkpointing" in asked
            else "the compiled run drew other dropout masks than the uncompiled one, although the suite compiles "
            "random ops onto eager's generator (inductor's fallback_random): its compile path draws from the "
            "training generator (a warm-up forward) or reseeds it"
        )
        return (
            "feature_rng",
            d,
            f"{d.run} ({', '.join(f'{k}={features[k]!r}' for k in asked)}) differs from {d.against}, the same "
            f"strategy without it, on a model with Dropout: {cause}",
        )
    return None


def optimizer_state_roundtrip(e: Evidence) -> Finding | None:
    """A resume gave the optimizer back its entries, but not as written (another dtype, rounded values,
    other step counters): the checkpoint changed the state on the way."""
    found = e.by_kind.get("optimizer_state", [])
    if not found:
        return None
    d = found[0]
    if "not restored" in str(d.got) or "not saved" in str(d.got):
        # Entries missing: what resume_state names from the numbers.
        return None
    if "rank" in e.by_kind or "sync" in e.by_kind:
        # Replicas apart: a replicated checkpoint holds one replica's state, which the others load.
        return None
    return (
        "optimizer_state_roundtrip",
        d,
        f"the optimizer state {d.run} resumed with is not the state written at the checkpoint ({d.got}): the "
        "checkpoint changed it on the way (moments stored in a lower precision, step counters reset or "
        "rounded). Write and read the optimizer state as it is",
    )


def frozen_updated(e: Evidence) -> Finding | None:
    """A frozen parameter moved in the strategy's final state while the reference kept it at its initial value."""
    model = build_model(e.scenario.model)
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    if not frozen:
        return None
    for d in e.divergences:
        run = run_of(e.scenario, d.run)
        if run is None or run.backend != "strategy":
            continue
        state = (e.trace_of(d.run) or {}).get("state") or {}
        moved = [n for n, v in frozen.items() if n in state and not torch.equal(state[n].to(v.dtype), v)]
        if not moved:
            continue
        ref = (e.trace_of(f"reference:{run.twin or run.truth}") or {}).get("state") or {}
        if any(n in ref and not torch.equal(ref[n].to(frozen[n].dtype), frozen[n]) for n in moved):
            return None
        shift = max(float((state[n].double() - frozen[n].double()).abs().max()) for n in moved)
        return (
            "frozen_updated",
            d,
            f"frozen parameters ({', '.join(moved)}; requires_grad=False) moved by up to {shift:.3g} in "
            f"{d.run} while the reference kept them at their initial values: the optimizer updated them (a zero "
            "gradient instead of none lets weight decay and momentum move them). Give frozen parameters no "
            "gradient (None) and leave them out of the reduction",
        )
    return None


def buffers_twice(e: Evidence) -> Finding | None:
    """An integer buffer (a counter) advanced a whole multiple (k >= 2) of what the reference's advanced from
    their initial value: every buffer update applied k times."""
    initial = {n: b for n, b in build_model(e.scenario.model).named_buffers() if not b.is_floating_point()}
    if not initial or "buffer" not in e.by_kind:
        return None
    for d in e.by_kind["buffer"]:
        run = run_of(e.scenario, d.run)
        if run is None or run.backend != "strategy":
            continue
        state = (e.trace_of(d.run) or {}).get("state") or {}
        ref = (e.trace_of(f"reference:{run.twin or run.truth}") or {}).get("state") or {}
        for name, start in initial.items():
            if name not in state or name not in ref:
                continue
            base = int(start.reshape(-1)[0])
            got, want = int(state[name].reshape(-1)[0]) - base, int(ref[name].reshape(-1)[0]) - base
            if want > 0 and got > want and got % want == 0:
                k = got // want
                return (
                    "buffers_twice",
                    d,
                    f"the counter {name} advanced {got} from its initial {base}, {k}x the reference's {want}: every "
                    f"buffer update made in the forward was applied {k} times (a forward recomputed outside "
                    "activation checkpointing's care, or run again on the same batch). Run each micro-batch's "
                    "forward once, or restore the buffers before recomputing",
                )
    return None


__all__ = [
    "buffers_twice",
    "clip_before_sync",
    "feature_rng",
    "frozen_updated",
    "optimizer_state_roundtrip",
    "param_groups",
    "reduction_dtype",
    "reduction_group",
    "reported_grad_norm",
    "state_dict_keys",
]
