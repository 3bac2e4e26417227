"""The ``[optimizer]`` and ``[scheduler]`` sections: classes, and their arguments checked before launch.

:func:`check_optimizer` and :func:`check_scheduler` find every problem a
section has without training anything: an unknown class, a keyword the class
does not take (with the closest one), a NaN, infinite or negative number, and
whatever torch's own constructor refuses (it is run once on a one-element
dummy parameter, for ``torch.optim`` classes only: other classes may need a device).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from unison.config.schema import ClassConfig
from unison.config.source import Loc, Problem
from unison.config.trust import Trust
from unison.errors import ConfigurationError, did_you_mean

#: Keywords that are rates, decays or small constants: negative values are refused for any optimizer class.
NON_NEGATIVE = frozenset(
    {"lr", "weight_decay", "eps", "momentum", "dampening", "lr_decay", "initial_accumulator_value"}
)

#: Words of torch's constructor messages -> the keyword they are about.
_MESSAGE_KEYS = {"learning rate": "lr", "epsilon": "eps", "beta": "betas", "weight_decay": "weight_decay"}


#: Why ``apex.*`` optimizer names fail on a machine without NVIDIA apex.
APEX_NOT_INSTALLED = "NVIDIA apex is not installed (the PyPI package named apex is unrelated)"


def optimizer_factory(config: ClassConfig, trust: Trust | None = None) -> Callable[[Any], torch.optim.Optimizer]:
    """The ``[optimizer]`` section as a factory ``params -> Optimizer``.

    ``name`` is one of

    * a class of ``torch.optim`` (``"AdamW"``);
    * ``"apex.NAME"``: NVIDIA apex's fused optimizer ``apex.optimizers.NAME``
      (``"apex.FusedAdam"``, ``"apex.FusedLAMB"``); apex is imported here, and a
      missing apex is a :class:`ConfigurationError` (its fused kernels are
      CUDA-only: apex itself raises when they are not built);
    * ``"package.module:Class"``: a ``torch.optim.Optimizer`` subclass in a module ``trust`` allows
      (any importable one when ``trust`` is ``None``, as for Python callers).
    """
    cls = _optimizer_class(config.name, trust)
    return lambda params: cls(params, **config.kwargs)


def _optimizer_class(name: str, trust: Trust | None = None) -> type[torch.optim.Optimizer]:
    option = "optimizer.name"
    if ":" in name:
        module_name, _, attr = name.partition(":")
        if trust is not None and module_name != "torch.optim":
            trust.check(name, option)
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigurationError(
                option,
                f"cannot import {name!r} ({type(exc).__name__}: {exc})",
                "write 'package.module:Class' naming an importable optimizer class",
            ) from None
    elif name.startswith("apex."):
        cls = _apex_optimizer(name.removeprefix("apex."))
    else:
        cls = getattr(torch.optim, name, None)
        if cls is None:
            raise ConfigurationError(
                option,
                f"torch.optim has no {name!r}{did_you_mean(name, _torch_optimizers())}",
                "use e.g. 'AdamW' or 'SGD', 'apex.FusedAdam', or 'package.module:Class'",
            )
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigurationError(option, f"{name!r} is not a torch.optim.Optimizer subclass", "name an optimizer class")
    return cls


def _torch_optimizers() -> list[str]:
    return [n for n, c in vars(torch.optim).items() if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)]


def _apex_optimizer(attr: str) -> Any:
    """``apex.optimizers.<attr>``, or a ConfigurationError saying what is missing."""
    option, fix = (
        "optimizer.name",
        (
            "build NVIDIA apex from https://github.com/NVIDIA/apex with its CUDA extensions, or use a torch.optim name "
            "such as 'AdamW'"
        ),
    )
    try:
        installed = importlib.util.find_spec("apex") is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:
        raise ConfigurationError(option, f"'apex.{attr}' needs NVIDIA apex: {APEX_NOT_INSTALLED}", fix)
    try:
        module = importlib.import_module("apex.optimizers")
    except Exception as exc:  # a partial build can raise more than ImportError
        problem = f"'apex.optimizers' fails to import ({type(exc).__name__}: {exc})"
        raise ConfigurationError(option, problem, fix) from None
    cls = getattr(module, attr, None)
    if cls is None:
        known = sorted(n for n in dir(module) if n.startswith("Fused"))
        raise ConfigurationError(option, f"apex.optimizers has no {attr!r}", f"use one of {known}")
    return cls


def scheduler_factory(config: ClassConfig | None) -> Callable[[Any], Any] | None:
    """The ``[scheduler]`` section as a factory ``optimizer -> scheduler`` (``None`` without one)."""
    if config is None:
        return None
    cls = _scheduler_class(config.name)
    return lambda optimizer: cls(optimizer, **config.kwargs)


def _scheduler_class(name: str) -> Any:
    cls = getattr(torch.optim.lr_scheduler, name, None)
    if not isinstance(cls, type) or name.startswith("_"):
        known = [n for n, c in vars(torch.optim.lr_scheduler).items() if isinstance(c, type) and n[0].isupper()]
        raise ConfigurationError(
            "scheduler.name",
            f"torch.optim.lr_scheduler has no {name!r}{did_you_mean(name, known)}",
            "use e.g. 'CosineAnnealingLR'",
        )
    return cls


def keyword_problems(
    target: Callable[..., Any], kwargs: dict[str, Any], loc: Loc, what: str, positional: int = 0
) -> list[Problem]:
    """A problem for each keyword ``target`` does not take (after ``positional`` leading arguments)."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    params = [n for n, p in signature.parameters.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return []
    keywords = params[positional:]
    return [
        Problem(
            (*loc, k),
            f"{what} takes no keyword {k!r}{did_you_mean(k, keywords)}",
            f"use one of: {', '.join(keywords)}",
        )
        for k in kwargs
        if k not in keywords
    ]


def number_problems(kwargs: dict[str, Any], loc: Loc) -> list[Problem]:
    """NaN or infinite numbers anywhere in ``kwargs``; negative values of the :data:`NON_NEGATIVE` keywords."""
    problems = []
    for key, value in kwargs.items():
        values = value if isinstance(value, list | tuple) else [value]
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                problems.append(Problem((*loc, key), f"{v} is not a finite number", "give a finite number"))
                break
            if key in NON_NEGATIVE and isinstance(v, int | float) and not isinstance(v, bool) and v < 0:
                problems.append(Problem((*loc, key), f"must not be negative (got {v})", "give a value >= 0"))
                break
    return problems


def _constructor_problem(exc: Exception, kwargs: dict[str, Any], loc: Loc) -> Problem:
    message = str(exc)
    key = next((k for word, k in _MESSAGE_KEYS.items() if word in message.lower() and k in kwargs), None)
    key = key or next((k for k in kwargs if k in message), None)
    return Problem(loc + ((key,) if key else ()), f"refused by the class: {message}", "give a valid value")


def check_optimizer(config: ClassConfig, trust: Trust | None) -> list[Problem]:
    """Every problem of an ``[optimizer]`` section, found before launch."""
    try:
        cls = _optimizer_class(config.name, trust)
    except ConfigurationError as exc:
        return [Problem(("optimizer", "name"), exc.problem, exc.fix)]
    loc = ("optimizer", "kwargs")
    problems = keyword_problems(cls, config.kwargs, loc, cls.__name__, positional=1)
    problems += number_problems(config.kwargs, loc)
    if not problems and cls.__module__.startswith("torch.optim"):
        try:
            cls([torch.nn.Parameter(torch.zeros(1))], **config.kwargs)
        except (ValueError, TypeError) as exc:
            problems.append(_constructor_problem(exc, config.kwargs, loc))
    return problems


def check_scheduler(config: ClassConfig) -> list[Problem]:
    """Every problem of a ``[scheduler]`` section, found before launch (on a dummy SGD optimizer)."""
    try:
        cls = _scheduler_class(config.name)
    except ConfigurationError as exc:
        return [Problem(("scheduler", "name"), exc.problem, exc.fix)]
    loc = ("scheduler", "kwargs")
    problems = keyword_problems(cls, config.kwargs, loc, cls.__name__, positional=1)
    problems += number_problems(config.kwargs, loc)
    if not problems:
        try:
            cls(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), **config.kwargs)
        except (ValueError, TypeError) as exc:
            problems.append(_constructor_problem(exc, config.kwargs, loc))
    return problems
