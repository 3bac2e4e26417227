"""The rule that no lifecycle plugin touches training's random numbers, checked where it is asked for.

Callbacks, loggers and progress displays run between the steps of training.
Dropout masks, data shuffles and any random augmentation draw from the global
generators (torch's CPU and CUDA ones, numpy's, Python's ``random``), so a plugin
that draws from them, reseeds or restores them changes what is trained: with it
on or off the weights differ, and a resume in a new process (where a plugin's
one-time draw happens again, or not) stops being exact. Built-in plugins draw
from generators of their own (the MFU probe of ``Throughput`` does).

:func:`install` makes a plugin manager compare those states before and after
every lifecycle hook call (``unison_on_*``, ``unison_log_metrics``,
``unison_validation_progress``) and raise :class:`~unison.errors.PluginError`
naming the hook, the generator and the plugins implementing that hook. The
conformance suite runs every strategy with it (``UNISON_CHECK_PLUGIN_RNG=1``,
which any run may set: it costs a copy of each generator's state per hook call).
"""

from __future__ import annotations

import random
from typing import Any

from unison.errors import PluginError

#: Set to ``1`` to check every lifecycle hook call (:func:`install`); the suite's runs set it.
CHECK_RNG_ENV = "UNISON_CHECK_PLUGIN_RNG"

#: Hooks called between the steps of training, whose implementations must leave the RNG states alone.
_PREFIXES = ("unison_on_", "unison_log_metrics", "unison_validation_progress")


def rng_states() -> dict[str, Any]:
    """A copy of every global generator's state (CUDA only once initialised: reading must not initialise it)."""
    import numpy as np
    import torch

    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "random": random.getstate(),
    }
    if torch.cuda.is_initialized():
        states["torch.cuda"] = torch.cuda.get_rng_state_all()
    return states


def changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The generators whose state differs between two :func:`rng_states` snapshots."""
    import numpy as np
    import torch

    out = []
    if not torch.equal(before["torch"], after["torch"]):
        out.append("torch (CPU)")
    if "torch.cuda" in before or "torch.cuda" in after:
        cuda_before, cuda_after = before.get("torch.cuda", []), after.get("torch.cuda", [])
        if len(cuda_before) != len(cuda_after) or not all(map(torch.equal, cuda_before, cuda_after)):
            out.append("torch.cuda")
    nb, na = before["numpy"], after["numpy"]
    if not (np.array_equal(nb[1], na[1]) and nb[0] == na[0] and tuple(nb[2:]) == tuple(na[2:])):
        out.append("numpy")
    if before["random"] != after["random"]:
        out.append("random")
    return out


def install(pm: Any) -> Any:
    """Check every lifecycle hook call of the pluggy manager ``pm``; returns the function that removes the check."""
    stack: list[dict[str, Any] | None] = []

    def before(hook_name: str, hook_impls: Any, kwargs: Any) -> None:
        stack.append(rng_states() if hook_name.startswith(_PREFIXES) else None)

    def after(outcome: Any, hook_name: str, hook_impls: Any, kwargs: Any) -> None:
        snapshot = stack.pop()
        if snapshot is None or outcome.exception is not None:
            return
        moved = changed(snapshot, rng_states())
        if moved:
            names = ", ".join(sorted({_describe(impl.plugin) for impl in hook_impls}))
            raise PluginError(
                f"a plugin changed the training RNG state during {hook_name} ({', '.join(moved)} generator); "
                f"plugins implementing it: {names}. Callbacks, loggers and progress displays must not draw from, "
                "reseed or restore the global generators (dropout and shuffles draw from them, so training would "
                "change with the plugin on or off, and resume would not be exact): draw from a torch.Generator, "
                "numpy.random.default_rng() or random.Random() of the plugin's own"
            )

    return pm.add_hookcall_monitoring(before, after)


def _describe(plugin: Any) -> str:
    """A plugin as a reader knows it: a module's name, or an object's class."""
    name = getattr(plugin, "__name__", None)
    return str(name) if isinstance(name, str) else f"{type(plugin).__module__}.{type(plugin).__qualname__}"
