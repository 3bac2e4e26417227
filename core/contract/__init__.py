"""The strategy contract: what a backend plugin implements and declares.

* :mod:`~unison.contract.strategy` - the :class:`Strategy` base (``setup`` a template method) and its
  accumulation interfaces;
* :mod:`~unison.contract.replicated` - :class:`ReplicatedStrategy`, the public base of data parallel
  with whole replicas;
* :mod:`~unison.contract.version` - :data:`API_VERSION`, the table of API changes (:data:`MIGRATIONS`)
  and the registration-time check;
* :mod:`~unison.contract.ownership` - the frozen declaration of who owns accumulation, precision,
  state_dict and replica init;
* :mod:`~unison.contract.precision` - the precision contract the trainer drives;
* :mod:`~unison.contract.state` - DCP model/optimizer state and RNG helpers strategies share;
* :mod:`~unison.contract.tensor_parallel` - tensor-parallel plans: the model's own, else the plans
  plugins register for its block types (``unison_tensor_parallel_plan``), and how entries name layers;
* :mod:`~unison.contract.env` - where a process sits in the world;
* :mod:`~unison.contract.settings` - the trainer settings every strategy receives.

Nothing here imports the trainer, the launcher or any plugin. The names a strategy author needs
are importable from here: ``from unison.contract import API_VERSION, ReplicatedStrategy``.
Importing the package itself costs nothing (PEP 562: a name loads its module, and torch, on first use).
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> the submodule of unison.contract that defines it.
_EXPORTS = {
    "API_VERSION": "version",
    "MIGRATIONS": "version",
    "Migration": "version",
    "DCP_FULL_STATE": "replicated",
    "TRAINER_PRECISION": "replicated",
    "ReplicatedStrategy": "replicated",
    "Strategy": "strategy",
    "LossDivisor": "ownership",
    "LossNormalisation": "ownership",
    "Reduction": "ownership",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'unison.contract' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"unison.contract.{module}"), name)
    globals()[name] = value
    return value
