"""Rules for a gradient scale error, read from grad-norm ratios (strategy / reference) with the loss equal.

A ratio of 1 / world size means gradients averaged twice, the world size
summed and never averaged, 1 / or x accumulate_grad_batches the loss divided
twice or never for accumulation; one fixed divisor behind the ratios at two
world sizes is a hard-coded divisor; a ratio in (1, sqrt 2] on a model with
tied weights is the tied weight counted once per name.
"""

from __future__ import annotations

import math
from typing import Any

from unison.conformance.diagnosis.evidence import RATIO_MATCH, Evidence, Finding, close
from unison.conformance.verdict import Divergence


def hard_coded_divisor(e: Evidence) -> Finding | None:
    """One fixed divisor D (not 1) explains the grad-norm ratios at two or more world sizes: ratio = world / D."""
    worlds: dict[int, list[str]] = {}
    for run in e.scenario.runs:
        t = e.trace_of(f"strategy:{run.id}") if run.backend == "strategy" else None
        if t is not None and t.get("status") == "ok":
            worlds.setdefault(int(t.get("world_size", 1) or 1), []).append(f"strategy:{run.id}")
    if len(worlds) < 2:
        return None
    divisors: dict[int, tuple[float, Divergence | None]] = {}
    for world, labels in worlds.items():
        mine = [d for d in e.divergences if d.run in labels and d.kind not in ("rank",)]
        if not mine:
            divisors[world] = (float(world), None)
            continue
        first = min(mine, key=lambda d: math.inf if d.step is None else d.step)
        ratio = _ratio(first)
        if ratio is None:
            return None
        same_step_loss = [d for d in mine if d.run == first.run and d.kind == "loss" and d.step == first.step]
        if same_step_loss:
            return None
        divisors[world] = (world / ratio, first)
    values = [v for v, _ in divisors.values()]
    divisor = values[0]
    if abs(divisor - 1) <= RATIO_MATCH or any(abs(v - divisor) > RATIO_MATCH * divisor for v in values):
        return None
    shown = [(w, d) for w, (_, d) in sorted(divisors.items()) if d is not None]
    if not shown:
        return None
    _, d = shown[0]
    per_world = ", ".join(
        f"world {w}: " + ("matches" if x is None else f"{x.got / x.expected:.4g}x")
        for w, (_, x) in sorted(divisors.items())
    )
    return (
        "hard_coded_divisor",
        d,
        f"the grad norm relative to the reference's is world size / {divisor:.3g} at every world size the "
        f"strategy ran ({per_world}): the summed gradients are divided by a fixed {divisor:.3g}, not by the world "
        "size (often with the all-reduce skipped at world size 1)",
    )


def _ratio(d: Divergence) -> float | None:
    if d.kind == "grad_norm" and isinstance(d.got, float) and isinstance(d.expected, float) and d.expected:
        return d.got / d.expected
    return None


def loss_normalisation(e: Evidence) -> Finding | None:
    """In the pair form, the first grad-norm ratio is 1 / the data-parallel size while the declaration says the
    replicas' gradients are summed, or x it while it says averaged (the loss equal before): the declared
    :class:`~unison.contract.ownership.LossNormalisation` misstates the replicas' reduction. (1 / the size with
    "mean" declared is gradients averaged twice, :func:`gradient_scale`'s answer.)"""
    if e.scenario.loss != "token" and e.scenario.form != "huggingface":
        return None
    found = e.first_norm_ratio
    if found is None:
        return None
    d, ratio = found
    replicas = int((e.trace_of(d.run) or {}).get("data_parallel_size") or 1)
    declared = ((getattr(e.result, "ownership", None) or {}).get("loss_normalisation")) or {}
    said = declared.get("replicas", "?")
    if replicas < 2 or not (
        (close(ratio, 1 / replicas) and said == "sum") or (close(ratio, replicas) and said == "mean")
    ):
        return None
    does = "averages" if said == "sum" else "sums"
    return (
        "loss_normalisation",
        d,
        f"with the loss equal, the grad norm of the (loss_sum, num_items) pair is {ratio:.4g}x the reference's, "
        f"1{'/' if does == 'averages' else ' x '}{replicas} data-parallel replicas: the trainer scales the pair's "
        f"gradients by the declared Ownership.loss_normalisation (replicas: {said}, divisor: "
        f"{declared.get('divisor', '?')}), but the reduction {does} over the replicas. The declaration misstates "
        "the replicas' reduction; scalar losses never read it, so only the token scenarios see it",
    )


def gradient_scale(e: Evidence) -> Finding | None:
    """The first grad-norm ratio is 1/world, world, 1/accumulation or accumulation (the loss equal before)."""
    found = e.first_norm_ratio
    if found is None:
        return None
    d, ratio = found
    world = (e.trace_of(d.run) or {}).get("world_size", getattr(e.result, "world_size", 1)) or 1
    match = ratio_pattern(ratio, world, e.scenario.accumulate_grad_batches)
    if match is None:
        return None
    rule, why = match
    if world == e.scenario.accumulate_grad_batches and rule == "averaged_twice":
        # 1/world and 1/accumulation are the same number here: a scenario where they differ decides.
        decided = _decide_by_other_scenario(e, world)
        if decided is not None:
            alone = ratio_pattern(ratio, world, 1) if decided[0] == "averaged_twice" else ratio_pattern(ratio, 1, world)
            rule, why = decided[0], f"{alone[1] if alone else decided[0]}; {decided[1]}"
    return (
        rule,
        d,
        f"with the loss equal, the global grad norm is {ratio:.4g}x the reference's "
        f"(reference/strategy {1 / ratio:.4g}), which is {why}",
    )


def _decide_by_other_scenario(e: Evidence, world: int) -> tuple[str, str] | None:
    """Averaged twice or divided twice for accumulation, from the first grad-norm ratio of another scenario of
    the same strategy run at the same world size with another accumulation (``plain``: 1, ``accumulation``: 4)."""
    from unison.conformance.scenarios import SCENARIOS_BY_NAME

    if e.result is None:
        return None
    for name, runs in sorted(e.result.traces.items()):
        other = SCENARIOS_BY_NAME.get(name)
        if other is None or name == e.scenario.name or other.loss != "mse":
            continue
        a = other.accumulate_grad_batches
        if a == world:
            continue
        mine, ref = (runs.get("main") or {}), (e.reference.get(name, {}).get("main") or {})
        if mine.get("status") != "ok" or int(mine.get("world_size") or 1) != world:
            continue
        got, want = (mine.get("steps") or [{}])[0], (ref.get("steps") or [{}])[0]
        if "grad_norm" not in got or not want.get("grad_norm"):
            continue
        ratio = got["grad_norm"] / want["grad_norm"]
        where = (
            f"scenario {name!r} (accumulation {a}, world size {world}): first grad norm {ratio:.4g}x the reference's"
        )
        if close(ratio, 1 / a):
            return (
                "accumulation_scale",
                f"not 1/world size: {where}, 1/{a}, its accumulation",
            )
        if close(ratio, 1 / world):
            return (
                "averaged_twice",
                f"not 1/accumulate_grad_batches: {where}, 1/{world}, the world size",
            )
    return None


def ratio_pattern(ratio: float, world: int, accumulation: int) -> tuple[str, str] | None:
    """The scale error a strategy/reference grad-norm ratio points at (rule, why), or ``None``."""
    candidates: list[tuple[str, str]] = []
    if world > 1 and close(ratio, 1 / world):
        candidates.append(
            (
                "averaged_twice",
                f"1/world size = 1/{world}: the gradients were divided by the world "
                "size twice (e.g. an averaging all-reduce of a loss already averaged, "
                "or averaging twice)",
            )
        )
    if world > 1 and close(ratio, world):
        candidates.append(
            (
                "summed",
                f"the world size {world}: the gradients were summed over replicas and never divided by the world size",
            )
        )
    if world > 2:
        for divisor in range(2, world):
            if close(ratio, world / divisor):
                candidates.append(
                    (
                        "hard_coded_divisor",
                        f"world size / {divisor} = {world}/{divisor}: the gradients were summed over the {world} "
                        f"replicas and divided by a fixed {divisor}, not by the world size (right only at world "
                        f"size {divisor}, and at world size 1 too when the all-reduce and division are skipped there)",
                    )
                )
    if accumulation > 1 and close(ratio, 1 / accumulation):
        candidates.append(
            (
                "accumulation_scale",
                f"1/accumulate_grad_batches = 1/{accumulation}: the loss was "
                "divided for accumulation twice (trainer and engine both)",
            )
        )
    if accumulation > 1 and close(ratio, accumulation):
        candidates.append(
            (
                "accumulation_scale",
                f"accumulate_grad_batches = {accumulation}: the micro-batch "
                "losses were summed, never divided for accumulation",
            )
        )
    if not candidates:
        return None
    return candidates[0][0], " or ".join(why for _, why in candidates)


def tied_weight_twice(e: Evidence) -> Finding | None:
    """Tied weights, and the first grad norm 1 to sqrt 2 times the reference's with the loss equal at that step."""
    from unison.conformance.models import build_model
    from unison.contract.ownership import Feature
    from unison.contract.strategy import model_features

    found = e.first_norm_ratio
    if found is None:
        return None
    d, ratio = found
    if any(x.run == d.run and x.step == d.step for x in e.losses):
        return None
    if Feature.TIED_WEIGHTS not in model_features(build_model(e.scenario.model)):
        return None
    if not 1.0 < ratio <= math.sqrt(2) * (1 + RATIO_MATCH):
        return None
    return (
        "tied_weight_twice",
        d,
        f"with the loss equal, the global grad norm is {ratio:.4g}x the reference's, in (1, sqrt 2]: the model "
        "ties one weight under two names and its gradient was counted once per name (a norm over "
        "named_parameters(remove_duplicate=False), or over both copies of an untied replica)",
    )


def mesh_dimension_sizes(ownership: dict[str, Any] | None, world: int) -> dict[str, int]:
    """Each declared mesh dimension's size at ``world`` ranks (``{}`` without a declared mesh)."""
    mesh = (ownership or {}).get("mesh")
    if not mesh:
        return {}
    dims = mesh["dims"]
    fixed = math.prod(d["size"] for d in dims if d["size"] is not None)
    if not fixed or world % fixed:
        return {}
    return {d["name"]: d["size"] if d["size"] is not None else world // fixed for d in dims}


def norm_over_replicated_dim(e: Evidence) -> Finding | None:
    """A declared mesh, and the first grad norm sqrt(k) times the reference's (the loss equal at that step),
    k the size of a mesh dimension: the squared norm was also summed over k copies of the same gradient."""
    found = e.first_norm_ratio
    if found is None:
        return None
    d, ratio = found
    if any(x.run == d.run and x.step == d.step for x in e.losses):
        return None
    world = (e.trace_of(d.run) or {}).get("world_size", getattr(e.result, "world_size", 1)) or 1
    sizes = mesh_dimension_sizes(getattr(e.result, "ownership", None), world)
    dims = [name for name, k in sizes.items() if k > 1 and close(ratio, math.sqrt(k))]
    if not dims:
        return None
    k = sizes[dims[0]]
    return (
        "norm_over_replicated_dim",
        d,
        f"with the loss equal, the global grad norm is {ratio:.4g}x the reference's, sqrt({k}) with {k} the size of "
        f"mesh dimension {' or '.join(map(repr, dims))}: the squared norm was all-reduced over a dimension whose "
        f"ranks hold the same gradient (every shard counted {k} times); reduce it only over the dimensions that "
        "split the gradient (DTensor's full_tensor() of the norm does exactly that)",
    )


__all__ = [
    "gradient_scale",
    "hard_coded_divisor",
    "mesh_dimension_sizes",
    "norm_over_replicated_dim",
    "ratio_pattern",
    "tied_weight_twice",
]
