"""Errors unison raises for bad input. All are raised before any process group starts."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

#: Exit codes of a unison worker and of ``unison run`` / ``unison train`` (the launcher exits with the
#: code of the first real failure). ``PREEMPTED_EXIT_CODE`` (75, a stop after a checkpoint) lives in
#: :mod:`unison.launch.lifecycle`; an interrupt is 130 (128 + SIGINT).
EXIT_FAILED = 1  # an exception
EXIT_CONFIGURATION = 2  # a ConfigurationError: bad input, named with its fix
EXIT_STALLED = 3  # the watchdog found a rank that stopped making progress


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``" (did you mean 'ddp'?)"`` for the closest of ``known`` names, or ``""`` when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


class UnisonError(Exception):
    """Base class of every error unison raises on purpose."""

    #: The exit code a worker (and the launcher) ends with after this error.
    exit_code = EXIT_FAILED


class ConfigurationError(UnisonError, ValueError):
    """An option, or a combination of options, that cannot work.

    The message always names the option and says how to fix it.
    """

    exit_code = EXIT_CONFIGURATION

    def __init__(self, option: str, problem: str, fix: str) -> None:
        self.option, self.problem, self.fix = option, problem, fix
        super().__init__(f"{option}: {problem}. Fix: {fix}")


class DeclaredRefusal(ConfigurationError):
    """A run asks for something the strategy's declaration says it refuses.

    ``feature`` names it: a :class:`~unison.contract.ownership.Feature` value,
    ``"precision:NAME"`` or ``"world_size"``. The conformance suite counts
    only these (and refusals of declared-refused features) as "declared out".
    """

    def __init__(self, option: str, problem: str, fix: str, *, feature: str) -> None:
        super().__init__(option, problem, fix)
        self.feature = feature


class UnknownStrategyError(ConfigurationError, KeyError):
    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class StrategyUnavailableError(ConfigurationError):
    """A registered strategy whose dependency is missing on this machine."""


class PluginError(UnisonError):
    """A plugin that does not match the hook specifications, or cannot be loaded: the environment's
    configuration (``UNISON_PLUGINS``, an installed entry point), fixed by the user like a ConfigurationError."""

    exit_code = EXIT_CONFIGURATION
