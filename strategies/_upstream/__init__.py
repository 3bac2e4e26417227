"""Every non-public upstream API unison's strategies use, behind one adapter module per upstream.

* :mod:`.torch` – ``torch._utils`` tensor flattening and ``torch.amp.GradScaler`` internals;
* :mod:`.deepspeed` – the pipeline engine's schedule runner, ZeRO's fp32 partitions and fragment
  links, ZeRO-3 partition attributes;
* :mod:`.fairscale` – ShardedDataParallel's gradient hooks.

Why: a private API can change in any upstream release. Keeping each one here, with the
reason beside it and the version it was verified against, makes an upgrade a review of
three small files instead of a hunt through every backend. Each adapter module states
its ``VERIFIED_VERSION`` and warns once, at first use, when another version is installed
(the package extras pin the verified versions). ``tests/test_upstream.py`` fails when code
in ``strategies/`` outside this package reaches a private name, and exercises each
adapter against the installed library.
"""

from __future__ import annotations

import functools
import importlib.metadata
import warnings


@functools.cache
def warn_if_unverified(distribution: str, verified: str, adapter: str) -> None:
    """Warn once when the installed ``distribution`` is not the version ``adapter`` was verified against."""
    try:
        installed = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return  # the caller's import fails with its own message
    if installed.split("+")[0] != verified:
        warnings.warn(
            f"unison's {adapter} adapter was verified against {distribution} {verified}, but {installed} is "
            f"installed: the non-public APIs listed in {adapter} may have changed; run the conformance suite",
            RuntimeWarning,
            stacklevel=3,
        )


__all__ = ["warn_if_unverified"]
