"""Profiler marks at the strategy's sync points, where a profile (and the conformance suite) sees them.

The training loop (:mod:`unison.training.loop`) calls these strategy methods inside
``torch.profiler.record_function`` ranges named here, while a profiler records:

* :data:`NO_SYNC`: the micro-steps a trainer-owned, boundary-sync accumulation runs inside
  ``strategy.no_sync()`` (forward and backward; not the last micro-step);
* :data:`BACKWARD`: each micro-step's ``strategy.backward(loss)``;
* :data:`CLIP_GRAD_NORM`: the step's ``strategy.clip_grad_norm(max_norm)``;
* :data:`BOUNDARY_TRUE` / :data:`BOUNDARY_FALSE`: an engine that owns accumulation answered
  ``is_accumulation_boundary()`` after a micro-step's backward (an empty range, named by the answer).

A profile of a fit (torch's profiler, the ``Profiler`` callback's Chrome trace) shows which micro-step a
gradient collective belongs to and whether it ran inside ``no_sync()``; the conformance suite reads these
marks to check a strategy's declared gradient sync instead of wrapping its methods. A pipeline schedule
runs its micro-batches itself: its strategy's calls are not marked, and its step is one range, the
schedule's. Outside a profile nothing is entered (one flag read per mark, about 0.7 us).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from unison._upstream.torch import profiler_enabled

NO_SYNC = "unison::no_sync"
BACKWARD = "unison::backward"
CLIP_GRAD_NORM = "unison::clip_grad_norm"
BOUNDARY_TRUE = "unison::accumulation_boundary=true"
BOUNDARY_FALSE = "unison::accumulation_boundary=false"

__all__ = ["BACKWARD", "BOUNDARY_FALSE", "BOUNDARY_TRUE", "CLIP_GRAD_NORM", "NO_SYNC", "boundary", "mark"]


def mark(name: str, on: bool = True) -> Any:
    """A ``record_function`` range named ``name`` while a profiler records (and ``on``); else a no-op context."""
    if on and profiler_enabled():
        return torch.autograd.profiler.record_function(name)
    return contextlib.nullcontext()


def boundary(answer: bool) -> None:
    """Mark an engine's ``is_accumulation_boundary()`` answer (an empty range named by it)."""
    with mark(BOUNDARY_TRUE if answer else BOUNDARY_FALSE):
        pass
