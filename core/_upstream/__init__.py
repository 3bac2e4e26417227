"""Every non-public upstream API unison uses, behind one adapter module per upstream library.

* :mod:`.torch` - torch's private names (process groups, launching, data loader workers, tensor
  flattening, dispatch modes and FLOP counting, dynamo counters, ``GradScaler`` internals, pipeline
  stage shape inference, optimizer step hooks);
* :mod:`.deepspeed` - the pipeline engine's schedule runner, ZeRO's fp32 partitions and fragment
  links, ZeRO-3 partition attributes;
* :mod:`.fairscale` - ShardedDataParallel's gradient hooks;
* :mod:`.apex` - the gradient accumulators of apex's fused optimizer (CUDA only).

Why: a private API can change in any upstream release. Keeping each one here, with the reason
beside it and the version it was verified against, makes an upgrade a review of four small files
instead of a hunt through the loop, the launcher and every backend. Each adapter states its
``VERIFIED_VERSION`` (or commit) and warns once, at first use, when another version is installed
(:func:`warn_if_unverified`; the dependency and the extras pin the verified versions).
``tests/test_upstream.py`` fails when code outside this package reaches a private name, and
exercises each adapter against the installed library. The package sits in core's base layer, so the
core, the strategies and the plugins share one adapter per upstream; importing it imports no upstream
library (each module imports its own).
"""

from __future__ import annotations

import functools
import importlib.metadata
import warnings

__all__ = ["warn_if_unverified"]


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
