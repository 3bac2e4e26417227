"""``s3://bucket/prefix`` checkpoints and run directories, through s3fs.

Registered through the ``unison_storage_backends`` hook as the ``s3`` scheme, exactly as a
third-party backend registers its own. The object-storage mechanics (stage locally,
upload per rank, commit by copying with the manifest last, conditional writes for the
lease) are :class:`unison.checkpointing.remote_storage.FsspecStorage`; this module checks
that s3fs is installed and opens the bucket. Configuration is s3fs's and botocore's own
(``AWS_*`` and ``FSSPEC_S3_*`` variables) or the ``storage_options`` given (s3fs's keyword
arguments). Nothing heavy is imported until an ``s3://`` location is opened.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from unison.checkpointing.storage import LocalStorage, StorageFactory, split_url
from unison.errors import ConfigurationError
from unison.plugin import hookimpl


def open_s3(location: str, storage_options: dict[str, Any], option: str) -> tuple[Path, LocalStorage]:
    """The root path and storage of an ``s3://bucket/prefix`` location (the ``s3`` factory)."""
    if importlib.util.find_spec("s3fs") is None:
        raise ConfigurationError(
            option,
            "s3:// locations need the s3fs package, which is not installed",
            "pip install 'unison[s3]' (or pip install s3fs)",
        )
    from unison.checkpointing.remote_storage import FsspecStorage

    url = split_url(location)
    assert url is not None and url[0] == "s3", location
    storage = FsspecStorage("s3", storage_options, option=option)
    return storage.root_path(url[1]), storage


@hookimpl
def unison_storage_backends() -> dict[str, StorageFactory]:
    return {"s3": open_s3}
