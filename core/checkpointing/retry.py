"""Object-storage calls retried for transient failures, within a time budget.

A call that fails for a transient reason (throttling, a dropped connection, a 5xx answer) is tried
again with a doubling wait, from 0.5 s up to 8 s, until ``UNISON_STORAGE_RETRY_S`` (60 s by default)
has passed; then it fails with a :class:`~unison.checkpointing.storage.StorageUnavailableError` that
says the last committed checkpoint is untouched and how to resume.
"""

from __future__ import annotations

import errno
import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from unison.checkpointing.storage import StorageUnavailableError


class RemoteStore(Protocol):
    """What retrying and uploading need of an object store
    (:class:`~unison.checkpointing.remote_storage.FsspecStorage` is one)."""

    scheme: str

    @property
    def endpoint(self) -> str:
        """Where the store is (named in errors)."""
        ...

    #: Retries so far (the trainer logs them as ``checkpoint/storage_retries``).
    retries: int
    #: The fsspec filesystem.
    fs: Any


#: Seconds unison keeps retrying an object-storage call that failed for a transient reason
#: (``UNISON_STORAGE_RETRY_S`` overrides); the wait doubles from 0.5 s up to 8 s between tries.
DEFAULT_RETRY_S = 60.0


def retry_budget() -> float:
    return float(os.environ.get("UNISON_STORAGE_RETRY_S", DEFAULT_RETRY_S))


def transient(exc: BaseException) -> bool:
    """An error a later try may not see: the endpoint unreachable, a dropped connection, a timeout, a 5xx."""
    import botocore.exceptions

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (FileNotFoundError, PermissionError, FileExistsError, StorageUnavailableError)):
            return False
        if isinstance(seen, (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError, TimeoutError)):
            return True
        if isinstance(seen, ConnectionError) or getattr(seen, "errno", None) in _NET_ERRNOS:
            return True
        if type(seen).__module__.startswith("aiohttp"):
            return True
        response = getattr(seen, "response", None)
        if isinstance(response, dict) and response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) >= 500:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


_NET_ERRNOS = {errno.ECONNREFUSED, errno.ECONNRESET, errno.ETIMEDOUT, errno.EPIPE, errno.EHOSTUNREACH}


def precondition_failed(exc: BaseException) -> bool:
    """A conditional write or delete the server refused because the object is not at the version named."""
    seen: BaseException | None = exc
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                return True
        if "pre-condition" in str(seen).lower() or "precondition" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def retried(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Retry a storage method on transient errors with bounded backoff, then fail with one clear message.

    Every retry is counted in :attr:`FsspecStorage.retries` (the trainer logs
    it as ``checkpoint/storage_retries``). The final error names the object,
    the endpoint, the tries and the last cause, without botocore's traceback.
    """

    def decorate(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def wrapper(self: RemoteStore, target: Any, *args: Any, **kwargs: Any) -> Any:
            budget, start, delay, tries = retry_budget(), time.monotonic(), 0.5, 0
            while True:
                tries += 1
                try:
                    return method(self, target, *args, **kwargs)
                except Exception as exc:
                    if not transient(exc):
                        raise
                    waited = time.monotonic() - start
                    if waited + delay > budget:
                        where = target if isinstance(target, Path) else f"{self.scheme}://{target}"
                        raise StorageUnavailableError(
                            f"object storage at {self.endpoint} failed to {what} {where}: {tries} tries over "
                            f"{waited:.0f} s (UNISON_STORAGE_RETRY_S={budget:g}); last error: "
                            f"{type(exc).__name__}: {first_line(exc)}. The last committed checkpoint is "
                            "untouched; once the store answers, restart with --resume auto (ckpt_path='auto')"
                        ) from None
                    self.retries += 1
                    time.sleep(delay)
                    delay = min(delay * 2, 8.0)

        return wrapper

    return decorate


def call_retrying(call: Callable[[], Any], on_retry: Callable[[], None], give_up: Callable[..., Exception]) -> Any:
    """``call()``, tried again on transient errors with the doubling wait (0.5 s to 8 s) within the budget.

    ``on_retry()`` counts each retry; once the budget is spent, ``give_up(tries, waited_s, budget_s,
    last_error)`` returns the error to raise. Other errors propagate at once. (The sharded data
    source reads through this; checkpoints' storage methods through :func:`retried`.)
    """
    budget, start, delay, tries = retry_budget(), time.monotonic(), 0.5, 0
    while True:
        tries += 1
        try:
            return call()
        except Exception as exc:
            if not transient(exc):
                raise
            waited = time.monotonic() - start
            if waited + delay > budget:
                raise give_up(tries, waited, budget, exc) from None
            on_retry()
            time.sleep(delay)
            delay = min(delay * 2, 8.0)


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (its type when it has none)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
