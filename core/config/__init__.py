"""Config files for ``unison train``: loading (:mod:`~unison.config.load`), the schema
(:mod:`~unison.config.schema`), where each key came from (:mod:`~unison.config.source`), optimizer and
scheduler checks (:mod:`~unison.config.optim`) and what a file's factories may load
(:mod:`~unison.config.trust`).
"""
