"""A CPU stand-in for the parts of NVIDIA apex that unison uses. Tests only; not apex.

apex's optimizers are CUDA-only, and this machine has no GPU. To test unison's
apex wiring anyway, this package provides modules with apex's names, signatures
and observable semantics (read from apex's source at
``6424da3b4faa6c8f062da4a48c424fff3f02d42d``), implemented with plain torch on
the CPU and gloo collectives:

* :mod:`apex_standin.distributed_fused_adam` stands for
  ``apex.contrib.optimizers.distributed_fused_adam`` (``DistributedFusedAdam``);
* :mod:`apex_standin.optimizers` stands for ``apex.optimizers``
  (``FusedAdam``, ``FusedLAMB``).

:func:`modules` maps apex's module names to them; tests install them into
``sys.modules`` (``monkeypatch.setitem``, so they are removed afterwards), and
spawned ranks call :func:`install`. What passes against the stand-in proves
unison's wiring (which apex calls happen when, with which arguments, and that
the results equal the single-process reference); it proves nothing about apex
itself, which runs only on a CUDA machine.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

#: The apex commit whose source the stand-in follows.
APEX_COMMIT = "6424da3b4faa6c8f062da4a48c424fff3f02d42d"


def _package(name: str, **attrs: object) -> types.ModuleType:
    module = types.ModuleType(name, f"apex stand-in package {name} (tests only)")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []  # a package: its submodules come from sys.modules
    module.STANDIN = True  # type: ignore[attr-defined]
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def modules() -> dict[str, types.ModuleType]:
    """apex's module names -> the stand-in's modules (nothing is installed)."""
    from apex_standin import distributed_fused_adam, optimizers

    contrib_optimizers = _package(
        "apex.contrib.optimizers",
        distributed_fused_adam=distributed_fused_adam,
        DistributedFusedAdam=distributed_fused_adam.DistributedFusedAdam,
    )
    contrib = _package("apex.contrib", optimizers=contrib_optimizers)
    apex = _package("apex", contrib=contrib, optimizers=optimizers)
    return {
        "apex": apex,
        "apex.contrib": contrib,
        "apex.contrib.optimizers": contrib_optimizers,
        "apex.contrib.optimizers.distributed_fused_adam": distributed_fused_adam,
        "apex.optimizers": optimizers,
    }


def install() -> None:
    """Install the stand-in under apex's names for the rest of this process (spawned ranks)."""
    if getattr(sys.modules.get("apex"), "STANDIN", False):
        return
    sys.modules.update(modules())
