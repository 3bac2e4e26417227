"""The typed facade of the plugin manager says exactly what the hookspecs say.

Each ``PluginManager.unison_*`` method passes its keyword arguments to the hook of
the same name, so a parameter, type or return type that drifts from
:mod:`unison.plugin.hookspecs` is a wrong promise to every caller (mypy checks the
callers against the facade, not against the spec).
"""

from __future__ import annotations

import inspect

import pytest

from unison.plugin import hookspecs
from unison.plugin.manager import PluginManager

#: Registration hooks reached through the manager's registries, not through a facade method.
THROUGH_REGISTRIES = {"unison_strategies", "unison_precisions"}

SPECS = {name: fn for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("unison_")}


def _shape(fn) -> tuple[list[tuple[str, object]], object]:
    """(name, annotation) of each parameter but ``self``, and the return annotation (strings: postponed)."""
    signature = inspect.signature(fn)
    params = [(p.name, p.annotation) for p in signature.parameters.values() if p.name != "self"]
    return params, signature.return_annotation


@pytest.mark.parametrize("name", sorted(set(SPECS) - THROUGH_REGISTRIES))
def test_facade_method_matches_its_hookspec(name):
    method = getattr(PluginManager, name, None)
    assert method is not None, f"PluginManager has no typed method for the hookspec {name}"
    assert _shape(method) == _shape(SPECS[name]), f"PluginManager.{name} disagrees with hookspecs.{name}"
    positional = [
        p for p in inspect.signature(method).parameters.values() if p.name != "self" and p.kind != p.KEYWORD_ONLY
    ]
    assert not positional, f"PluginManager.{name}: hook arguments are keyword-only, as pluggy calls them"


def test_the_comparison_sees_a_disagreement():
    def unison_on_before_optimizer_step(self, *, trainer: Trainer, step: int, grad_norm: float) -> None:  # noqa: F821
        """A facade whose grad_norm type drifted from the spec's."""

    spec = SPECS["unison_on_before_optimizer_step"]
    assert _shape(unison_on_before_optimizer_step) != _shape(spec)


def test_every_facade_method_has_a_hookspec():
    facade = {name for name in vars(PluginManager) if name.startswith("unison_")}
    assert facade <= set(SPECS), f"facade methods without a hookspec: {sorted(facade - set(SPECS))}"
