"""Ctrl-C inside a checkpoint writer is an interrupt, however the writer reports it.

``torch.save`` interrupted by a ``KeyboardInterrupt`` raises its zip writer's ``unexpected pos``
``RuntimeError`` while the interrupt unwinds it, and ``torch.distributed.checkpoint`` wraps that in a
``CheckpointException``. :func:`unison.checkpointing.failures.interrupted` finds the interrupt behind
both, so a save stopped by Ctrl-C ends as an interrupt (its partial directory left for the next start to
clean) instead of a failed save. ``tests/test_lifecycle.py`` sends the real Ctrl-C during a save.
"""

from __future__ import annotations

import pytest
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from unison.checkpointing.checkpointer import Checkpointer
from unison.checkpointing.failures import interrupted


def _writer_fails_while(raised: BaseException) -> RuntimeError:
    """The error a writer raises while ``raised`` unwinds it (so ``raised`` is its context)."""
    try:
        try:
            raise raised
        finally:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as exc:
        return exc


def test_an_interrupt_behind_a_writer_error_and_a_checkpoint_exception_is_found():
    error = _writer_fails_while(KeyboardInterrupt())
    assert interrupted(error)
    assert interrupted(CheckpointException("write", {0: _wrap_exception(error)}))
    assert interrupted(_writer_fails_while(SystemExit(75)))


def test_a_plain_writer_error_is_not_an_interrupt():
    assert not interrupted(_writer_fails_while(OSError(28, "No space left on device")))
    assert not interrupted(CheckpointException("write", {0: _wrap_exception(RuntimeError("unexpected pos"))}))


def test_a_save_whose_writer_was_interrupted_ends_as_an_interrupt_and_keeps_the_last_checkpoint(tmp_path):
    checkpointer = Checkpointer(tmp_path)

    def write_one(directory):
        (directory / "w.pt").write_bytes(b"1")
        return {"strategy": "single", "world_size": 1, "precision": "32-true", "state_dict": {}}

    first = checkpointer.save(1, write_one)

    def write(directory):
        raise CheckpointException("write", {0: _wrap_exception(_writer_fails_while(KeyboardInterrupt()))})

    with pytest.raises(KeyboardInterrupt):
        checkpointer.save(2, write)
    assert Checkpointer(tmp_path).latest() == first
    assert (tmp_path / ".step-00000002.partial").exists()  # left for the next start to clean, as after Ctrl-C
