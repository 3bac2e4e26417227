"""Every non-public upstream API unison's strategies use, behind one adapter module per upstream.

* :mod:`.torch` – ``torch._utils`` tensor flattening and ``torch.amp.GradScaler`` internals;
* :mod:`.deepspeed` – the pipeline engine's schedule runner, ZeRO's fp32 partitions and fragment
  links, ZeRO-3 partition attributes;
* :mod:`.fairscale` – ShardedDataParallel's gradient hooks.

Why: a private API can change in any upstream release. Keeping each one here, with the
reason beside it and the version it was verified against, makes an upgrade a review of
three small files instead of a hunt through every backend. Each adapter module states
its ``VERIFIED_VERSION`` and warns once, at first use, when another version is installed
(:func:`unison._upstream.warn_if_unverified`, shared with core's adapter)
(the package extras pin the verified versions). ``tests/test_upstream.py`` fails when code
in ``strategies/`` outside this package reaches a private name, and exercises each
adapter against the installed library.
"""

from __future__ import annotations
