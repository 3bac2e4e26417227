"""Whether apex's DistributedFusedAdam can run here, found without importing apex where it cannot."""

from __future__ import annotations

import importlib
import importlib.util

import torch

#: The apex commit whose source this package was written against.
APEX_COMMIT = "6424da3b4faa6c8f062da4a48c424fff3f02d42d"
DISTRIBUTED_FUSED_ADAM_MODULE = "apex.contrib.optimizers.distributed_fused_adam"

NOT_INSTALLED = "NVIDIA apex is not installed (the PyPI package named apex is unrelated)"
CUDA_ONLY = "apex's DistributedFusedAdam is CUDA-only, and CUDA is not available here"
BUILD_HINT = (
    "build NVIDIA apex from https://github.com/NVIDIA/apex with its CUDA extensions "
    "(APEX_CPP_EXT=1 APEX_CUDA_EXT=1 APEX_DISTRIBUTED_ADAM=1 APEX_DEPRECATED_FUSED_ADAM=1 "
    "pip install -v --no-build-isolation . in a clone)"
)


def distributed_fused_adam_unavailable() -> str | None:
    """Why ``DistributedFusedAdam`` cannot run here, or ``None``.

    apex is looked up with ``find_spec`` first, and nothing of it is imported
    unless CUDA is available (its extensions need it), so listing strategies on
    a machine without apex or CUDA imports nothing.
    """
    try:
        installed = importlib.util.find_spec("apex") is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:
        return NOT_INSTALLED
    if not torch.cuda.is_available():
        return CUDA_ONLY
    try:
        importlib.import_module(DISTRIBUTED_FUSED_ADAM_MODULE)
    except Exception as exc:  # a partial build raises ImportError for its missing extension modules, or worse
        return (
            f"{DISTRIBUTED_FUSED_ADAM_MODULE} fails to import ({type(exc).__name__}: {exc}); the installed apex lacks "
            f"its distributed Adam extension: {BUILD_HINT}"
        )
    return None
