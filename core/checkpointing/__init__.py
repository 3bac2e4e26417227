"""Checkpoints and where they live.

* :mod:`~unison.checkpointing.checkpointer` - verified, atomic, resumable checkpoints;
* :mod:`~unison.checkpointing.manifest` and :mod:`~unison.checkpointing.safe_io` - proof a checkpoint is
  intact, and files that load without running code;
* :mod:`~unison.checkpointing.storage`, :mod:`~unison.checkpointing.remote_storage` - the storage seam
  (local disk, object storage);
* :mod:`~unison.checkpointing.lease` - one writer per checkpoint directory;
* :mod:`~unison.checkpointing.export` - weights out of a checkpoint (the ``unison checkpoint ...``
  command that uses it is :mod:`unison.cli.checkpoint`).
"""
