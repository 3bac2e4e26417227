"""fairscale internals used by unison's strategies (verified against fairscale 0.4.13).

* ``ShardedDataParallel._grad_hooks``: the reduce hooks it installs on the parameters'
  gradient accumulators. fairscale removes them only when it re-installs its own; a
  strategy that tears the wrapper down must remove them, or a later wrapper of the same
  module inherits reduce hooks that point into the old, dead buckets.
"""

from __future__ import annotations

from typing import Any

from unison._upstream import warn_if_unverified

VERIFIED_VERSION = "0.4.13"


def remove_grad_hooks(sharded_ddp: Any) -> None:
    """Remove the gradient reduce hooks a ``ShardedDataParallel`` installed on its module's parameters."""
    warn_if_unverified("fairscale", VERIFIED_VERSION, __name__)
    # PRIVATE ShardedDataParallel._grad_hooks (see the module docstring).
    hooks = sharded_ddp._grad_hooks
    while hooks:
        hooks.pop().remove()


__all__ = ["VERIFIED_VERSION", "remove_grad_hooks"]
