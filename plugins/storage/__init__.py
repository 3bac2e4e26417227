"""Built-in storage backends, registered by URL scheme through the ``unison_storage_backends`` hook.

* :mod:`~unison.plugins.storage.s3` - ``s3://bucket/prefix`` through s3fs.

Each module is its own entry point, so a backend's client library is imported only when a
location of its scheme is opened; a third-party backend registers the same way.
"""
