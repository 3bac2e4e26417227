"""Config files for ``unison train``: loading (:mod:`~unison.config.load`), the schema
(:mod:`~unison.config.schema`), where each key came from (:mod:`~unison.config.source`), optimizer and
scheduler checks (:mod:`~unison.config.optim`) and what a file's factories may load
(:mod:`~unison.config.trust`).
"""

from typing import Any


def __getattr__(name: str) -> Any:
    """The names of the 0.1 module ``unison.config`` (``load_config``...), from their homes
    today, each use with a DeprecationWarning naming the home (until 0.3; :mod:`unison._moved`)."""
    from unison._moved import old_name

    return old_name(__name__, name)
