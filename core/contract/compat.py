"""What a strategy written against an older plugin API is given, so it keeps working unchanged.

API 2.0 told a backend whose engine wraps the model and builds the optimizer in one call (DeepSpeed,
pipelines) to keep its own ``setup`` and add the ``env`` keyword. Two things such a class never does,
because they came later or were the template's job, are done for it:

* ``env``, ``precision`` and ``settings`` are bound on the strategy by the trainer before it calls
  ``setup`` (:meth:`~unison.training.trainer.Trainer.fit`), so an override that ignores its ``env=``
  still finds :attr:`Strategy.env` set in its hooks (``to_device``, ``reduce_sum``).
* API 2.1 added module features (``compile``, ``activation_checkpointing``), applied by the template's
  ``apply_features`` hook. A class written for 2.0 that overrides ``setup`` runs no such hook, so it
  declares both refused, with :data:`SETUP_OVERRIDE_REASON`: a run asking for one is refused before any
  process group (never trained silently without it), ``unison describe`` shows why, and the
  conformance suite reports those scenarios *declared out*, not failed. A class written for 2.1 or
  later that overrides ``setup`` applies them itself or declares them refused (the 2.1 contract).

Which classes: those that override ``setup`` and target an API before 2.1, declared
(``api_version = "2.0"``) or read from the code (:func:`~unison.contract.version.target_version`). One
whose override still calls the template (``super().setup(...)``) is refused the features too: whether it
does cannot be read without running it, and a refusal is honest where a silent no-op is not.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from unison.contract.ownership import Feature, Ownership

#: Why a strategy written for API 2.0 that overrides ``setup`` refuses the module features.
SETUP_OVERRIDE_REASON = (
    "the strategy overrides setup and does not apply features (written for plugin API {version}, before "
    "compile and activation checkpointing; apply them in setup with unison.contract.transforms, or move to "
    "the setup hooks, and declare the API you target)"
)

#: The features the template applies since API 2.1.
TEMPLATE_FEATURES = (Feature.COMPILE, Feature.ACTIVATION_CHECKPOINTING)


def setup_predates_features(cls: type) -> str | None:
    """The API version ``cls`` targets when it overrides ``setup`` and was written before API 2.1, else ``None``."""
    from unison.contract.strategy import Strategy
    from unison.contract.version import parse_version, target_version
    from unison.errors import PluginError

    if getattr(cls, "setup", None) is Strategy.setup:
        return None
    try:
        version = target_version(cls)
        return version if parse_version(version) < (2, 1) else None
    except PluginError:
        return None  # a version that is no version: registration refuses the class, with its message


def with_features_refused(ownership: Ownership, version: str) -> Ownership:
    """``ownership`` that also refuses the template's features (a refusal it declares itself is kept)."""
    reason = SETUP_OVERRIDE_REASON.format(version=version)
    refuses = {feature: reason for feature in TEMPLATE_FEATURES}
    refuses.update(ownership.refuses)
    return dataclasses.replace(ownership, refuses=refuses)


def declare_features_out(cls: type) -> None:
    """Make ``cls``'s declaration refuse the template's features when its own ``setup`` predates them.

    Called for every :class:`~unison.contract.strategy.Strategy` subclass as it is created. The declaration
    (an ``ownership`` property, or an :class:`Ownership` class attribute) is wrapped once; subclasses
    that inherit the wrapped one keep it.
    """
    version = setup_predates_features(cls)
    if version is None:
        return
    declared = inspect.getattr_static(cls, "ownership", None)
    if isinstance(declared, Ownership):
        setattr(cls, "ownership", with_features_refused(declared, version))  # noqa: B010 - a class attribute
        return
    if not isinstance(declared, property) or declared.fget is None:
        return
    if getattr(declared, "__isabstractmethod__", False) or getattr(declared.fget, "features_refused", False):
        return
    read = declared.fget

    def ownership(self: Any) -> Ownership:
        return with_features_refused(read(self), version)

    ownership.features_refused = True  # type: ignore[attr-defined]  # marks the wrapper, so it is not wrapped twice
    setattr(cls, "ownership", property(ownership, doc=declared.__doc__))  # noqa: B010 - replaces the property
