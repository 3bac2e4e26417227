"""The data path: the trainer-owned sampler and loader (:mod:`~unison.data.loader`) and batches
of any structure (:mod:`~unison.data.batch`).
"""
