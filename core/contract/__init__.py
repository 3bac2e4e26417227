"""The strategy contract: what a backend plugin implements and declares.

* :mod:`~unison.contract.strategy` - the :class:`Strategy` base and its accumulation interfaces;
* :mod:`~unison.contract.ownership` - the frozen declaration of who owns accumulation, precision,
  state_dict and replica init;
* :mod:`~unison.contract.precision` - the precision contract the trainer drives;
* :mod:`~unison.contract.state` - DCP model/optimizer state and RNG helpers strategies share;
* :mod:`~unison.contract.env` - where a process sits in the world;
* :mod:`~unison.contract.settings` - the trainer settings every strategy receives.

Nothing here imports the trainer, the launcher or any plugin.
"""
