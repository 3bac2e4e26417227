"""The version of the strategy plugin API, its changes, and the check that enforces them.

A strategy class may say which API it was written against::

    class MyStrategy(ReplicatedStrategy):
        api_version = "2.0"

A class that says nothing is judged by its code: one that overrides
``setup`` without an ``env`` keyword was written against API 1.x (before the
template method), anything else against the current API.

:data:`MIGRATIONS` is the table of incompatible changes, as data: each entry
names the API version that made the change, what changed and how to migrate.
:func:`check_strategy_class` runs when a plugin's strategy specs are collected
(:class:`~unison.plugin.registry.StrategyRegistry`), so a plugin written for an
older API is refused at registration with the migration to make, instead of
failing every run with a ``TypeError`` deep in ``fit``. A change registered
with ``removed_in`` is a deprecation: the old form still works until that
version, and registration warns (:class:`DeprecationWarning`) instead of
refusing. Deprecations last at least one minor version (the project's rule).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from unison.errors import PluginError

#: The strategy plugin API this unison speaks. 1.x: ``setup(module, make_optimizer, *, precision, settings)``
#: implemented by every strategy; 2.0: ``setup`` is a template method taking ``env=``, strategies implement hooks;
#: 2.1 (additive, no migration): the ``apply_features`` hook and the ``compile`` / ``activation_checkpointing``
#: features a strategy may refuse. A minor version only adds, so a plugin written for 2.0 registers unchanged.
#: 2.1 (additive): ``Ownership.mesh`` declares a composed strategy's device mesh (:mod:`unison.contract.mesh`).
#: 2.2 (additive, no migration): the ``unison_tensor_parallel_plan`` hookspec (plans for known block types)
#: and ``Strategy.plugins`` (the run's plugin manager, for the hooks a strategy asks about the model);
#: ``tensor_parallel_plan`` moved to :mod:`unison.contract.tensor_parallel` (still importable from
#: :mod:`unison.contract.strategy`).
#: 2.3 (additive, no migration): ``Ownership.loss_normalisation``
#: (:class:`~unison.contract.ownership.LossNormalisation`: how backward and the gradient reduction divide),
#: ``Strategy.scale_gradients``, and the
#: ``item_weighted_loss`` feature (``(loss_sum, num_items)`` losses); a 2.2 strategy on the trainer's
#: accumulation path takes that form unchanged, an engine or schedule that declares nothing refuses it;
#: the ``build(module, make_optimizer)`` hook of the ``setup`` template, for engines that wrap and build the
#: optimizer in one call (an override of ``setup`` keeps working).
#: 2.4 (additive, no migration): ``Strategy.reports_step_losses``: a strategy whose step losses exist on some
#: ranks only (a pipeline's last stage) has the trainer sum them over the world, zeros elsewhere, instead of
#: sending them to every rank itself; a 2.3 strategy answers ``None`` and is summed with ``reduce_sum``.
API_VERSION = "2.4"


@dataclass(frozen=True)
class Migration:
    """One change of the plugin API, and what a plugin written before it must do."""

    #: The API version that made the change.
    version: str
    #: What changed, in a sentence.
    change: str
    #: How to migrate, in a sentence.
    how: str
    #: ``None``: the old form is refused from :attr:`version` on. Set: the old form keeps working
    #: (registration warns) until this API version, from which it is refused.
    removed_in: str | None = None


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        version="2.0",
        change=(
            "Strategy.setup(module, make_optimizer, *, env, precision, settings) is a template method that takes "
            "env= and runs configure_module -> wrap_module -> build_optimizer; "
            "setup(module, make_optimizer, *, precision, settings) without env is the 1.x signature"
        ),
        how=(
            "delete your setup() and implement the hooks (configure_module, wrap_module, build_optimizer; "
            "unison.contract.ReplicatedStrategy gives clipping and checkpoints of whole replicas), or add the env "
            "keyword: def setup(self, module, make_optimizer, *, env=None, precision, settings); then declare "
            'api_version = "2.0" on the class'
        ),
    ),
)


def parse_version(version: str) -> tuple[int, ...]:
    """``"2.0"`` -> ``(2, 0)``; a version that is not dotted integers is a :class:`PluginError`."""
    try:
        return tuple(int(part) for part in version.split("."))
    except (AttributeError, ValueError):
        raise PluginError(f"api_version {version!r} is not a version like {API_VERSION!r}") from None


def target_version(cls: type[Any]) -> str:
    """The API version ``cls`` was written against: declared, or read from its ``setup`` signature."""
    from unison.contract.strategy import Strategy

    declared = getattr(cls, "api_version", None)
    if declared is not None:
        return str(declared)
    if cls.setup is not Strategy.setup and not _accepts_keyword(inspect.signature(cls.setup), "env"):
        return "1.0"
    return API_VERSION


def check_strategy_class(
    cls: type, *, plugin: str, api_version: str = API_VERSION, migrations: Sequence[Migration] = MIGRATIONS
) -> None:
    """Refuse ``cls`` (a :class:`PluginError`) when it targets an API it cannot run under; warn when deprecated.

    Then compare every contract method ``cls`` overrides with the base's signature, so a
    mismatch is reported here with both signatures rather than as a ``TypeError`` in ``fit``.
    """
    target = target_version(cls)
    what = f"strategy class {cls.__module__}.{cls.__qualname__} (plugin {plugin!r})"
    current = parse_version(api_version)
    if parse_version(target) > current:
        raise PluginError(f"{what} targets plugin API {target}, newer than this unison's {api_version}; upgrade unison")
    pending = [m for m in migrations if parse_version(target) < parse_version(m.version) <= current]
    refused = [m for m in pending if m.removed_in is None or current >= parse_version(m.removed_in)]
    if refused:
        steps = "; ".join(f"API {m.version}: {m.change}. Migrate: {m.how}" for m in refused)
        raise PluginError(f"{what} targets plugin API {target}, but this unison speaks API {api_version}. {steps}")
    for m in pending:
        warnings.warn(
            f"{what} targets plugin API {target}: {m.change} (deprecated since API {m.version}, removed in "
            f"API {m.removed_in}). Migrate: {m.how}",
            DeprecationWarning,
            stacklevel=2,
        )
    if not pending:
        check_signatures(cls, what)


def check_signatures(cls: type, what: str) -> None:
    """A :class:`PluginError` naming the first contract method whose override cannot take the base's call."""
    from unison.contract.strategy import Strategy

    for name in CONTRACT_METHODS:
        method = getattr(cls, name, None)
        base = getattr(Strategy, name)
        if method is None or method is base or isinstance(inspect.getattr_static(cls, name), property):
            continue
        expected, found = inspect.signature(base), inspect.signature(method)
        if not _compatible(expected, found):
            raise PluginError(
                f"{what}: {name}{found} does not match the plugin API {API_VERSION} signature {name}{expected}; "
                "the trainer calls it with the latter"
            )


#: The methods the trainer calls whose signatures are part of the contract.
CONTRACT_METHODS = (
    "setup",
    "configure_module",
    "build",
    "wrap_module",
    "build_optimizer",
    "forward",
    "to_device",
    "backward",
    "scale_gradients",
    "clip_grad_norm",
    "optimizer_step",
    "zero_grad",
    "full_state_dict",
    "save_state",
    "load_state",
    "teardown",
)


def _accepts_keyword(signature: inspect.Signature, name: str) -> bool:
    """Whether a call may pass ``name=`` (a parameter of that name, or ``**kwargs``)."""
    kinds = inspect.Parameter
    return any(
        p.kind is kinds.VAR_KEYWORD or (p.name == name and p.kind in (kinds.KEYWORD_ONLY, kinds.POSITIONAL_OR_KEYWORD))
        for p in signature.parameters.values()
    )


def _compatible(expected: inspect.Signature, found: inspect.Signature) -> bool:
    """Whether ``found`` accepts every call ``expected`` allows, and requires nothing more."""
    kinds = inspect.Parameter
    exp, got = list(expected.parameters.values()), list(found.parameters.values())
    positional = [p for p in exp if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    slots = [p for p in got if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    if len(slots) < len(positional) and not any(p.kind is kinds.VAR_POSITIONAL for p in got):
        return False
    if not all(_accepts_keyword(found, p.name) for p in exp if p.kind is kinds.KEYWORD_ONLY):
        return False
    offered = {p.name for p in exp if p.kind is kinds.KEYWORD_ONLY}
    extra_required = [
        p
        for p in got[len(positional) :]
        if p.default is inspect.Parameter.empty
        and p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
        and p.name not in offered
    ]
    return not extra_required


def strategy_class(factory: Any) -> type | None:
    """The Strategy subclass a spec's factory builds, when it can be read without calling it."""
    from unison.contract.strategy import Strategy

    while isinstance(factory, functools.partial):
        factory = factory.func
    return factory if isinstance(factory, type) and issubclass(factory, Strategy) else None
