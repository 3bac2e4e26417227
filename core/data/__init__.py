"""The data path (:mod:`~unison.data.loader` describes it whole).

* :mod:`~unison.data.plan` - which samples form optimizer step ``k`` (pure index arithmetic);
* :mod:`~unison.data.sources` - map-style or iterable sources and the loader options;
* :mod:`~unison.data.shards` - :class:`~unison.data.shards.ShardedDataset`, shard files on disk or in object
  storage read by byte range (:mod:`~unison.data.shard_index`: the per-shard sample index);
* :mod:`~unison.data.streams` - what the ``DataLoader`` runs (index-list sampler, stream cutter);
* :mod:`~unison.data.loader` - :class:`~unison.data.loader.TrainData`, the one object the trainer asks for
  step ``k``'s micro-batches, its resume position;
* :mod:`~unison.data.validation` - validation batches with per-sample weights;
* :mod:`~unison.data.batch` - batches of any structure (device moves, sizes, tokens).
"""

from typing import Any


def __getattr__(name: str) -> Any:
    """The names of the 0.1 module ``unison.data`` (``TrainData``...), from their homes
    today, each use with a DeprecationWarning naming the home (until 0.3; :mod:`unison._moved`)."""
    from unison._moved import old_name

    return old_name(__name__, name)
