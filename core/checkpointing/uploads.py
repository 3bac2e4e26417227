"""Uploads that cannot land after unison gave up on them: objects of a save go up as S3 multipart uploads.

Why: a PUT the client gave up on (its read timeout, 15 s in s3fs, passed while a slow link or proxy
still held the request) is not cancelled at the server. The client retries it, the retry succeeds,
the save commits and removes its temporary prefix ``.step-N.partial/``, the job releases its lease,
and then the original request's last byte arrives and the server stores the object: an orphan under a
prefix nobody writes any more (measured: four of them, 6 s after the lease was released).

A multipart upload closes that door. Its parts land only in their upload, never as objects; the
object appears when the client completes the upload; and an upload that was completed or aborted
refuses every part that arrives later (``NoSuchUpload``). So when :func:`put_object` returns (or
raises, after aborting its upload) nothing it started can still appear, and the checkpointer
releases the lease only after its saves returned: every upload is finished or cancelled by then.

Each call (start, each part, complete) is retried on transient errors within
``UNISON_STORAGE_RETRY_S``, counted in :attr:`FsspecStorage.retries`. A retried *complete* whose first
try was applied after all finds its upload gone: the object is there, which is success. Empty objects
have no part to send and go up as one PUT (nothing to delay). A process killed mid-upload leaves an
upload that is never completed (invisible; the store keeps its parts): :func:`abort_uploads` aborts
those under a prefix when the checkpointer removes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from unison.checkpointing.retry import RemoteStore, call_retrying, first_line
from unison.checkpointing.storage import StorageUnavailableError

#: Bytes per part (S3: at least 5 MiB except the last, at most 10,000 parts: objects up to 320 GB).
PART = 32 << 20
#: Files uploaded at once by :func:`put_files`.
CONCURRENCY = 8


def in_partial(key: str) -> bool:
    """Whether ``key`` lies under a save's temporary ``.step-N.partial/`` prefix."""
    return any(part.startswith(".") and part.endswith(".partial") for part in key.split("/"))


def _retrying(storage: RemoteStore, what: str, key: str, call: Callable[[], Any]) -> Any:
    def count() -> None:
        storage.retries += 1

    def give_up(tries: int, waited: float, budget: float, exc: BaseException) -> Exception:
        return StorageUnavailableError(
            f"object storage at {storage.endpoint} failed to {what} {storage.scheme}://{key}: {tries} tries over "
            f"{waited:.0f} s (UNISON_STORAGE_RETRY_S={budget:g}); last error: {type(exc).__name__}: "
            f"{first_line(exc)}. The last committed checkpoint is untouched; once the store answers, restart "
            "with --resume auto (ckpt_path='auto')"
        )

    return call_retrying(call, count, give_up)


def _chunks(source: Path | bytes) -> Iterator[bytes]:
    if isinstance(source, bytes):
        for start in range(0, len(source), PART):
            yield source[start : start + PART]
        return
    with open(source, "rb") as f:
        while chunk := f.read(PART):
            yield chunk


def _no_such_upload(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code") == "NoSuchUpload":
            return True
        if "NoSuchUpload" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def put_object(storage: RemoteStore, key: str, source: Path | bytes) -> None:
    """Store ``source`` (a local file or bytes) as object ``key`` (``bucket/name``) through one multipart upload,
    completed, or aborted when this raises: nothing it sent can land afterwards."""
    size = len(source) if isinstance(source, bytes) else source.stat().st_size
    fs = storage.fs
    if size == 0:
        _retrying(storage, "write", key, lambda: fs.pipe_file(key, b""))
        return
    bucket, _, name = key.partition("/")
    started = _retrying(
        storage, "start an upload of", key, lambda: fs.call_s3("create_multipart_upload", Bucket=bucket, Key=name)
    )
    upload = started["UploadId"]
    try:
        parts = []
        for number, chunk in enumerate(_chunks(source), start=1):

            def send(chunk: bytes = chunk, number: int = number) -> str:
                answer = fs.call_s3(
                    "upload_part", Bucket=bucket, Key=name, UploadId=upload, PartNumber=number, Body=chunk
                )
                return str(answer["ETag"])

            parts.append({"ETag": _retrying(storage, "upload to", key, send), "PartNumber": number})
        tries = 0

        def complete() -> None:
            nonlocal tries
            tries += 1
            try:
                fs.call_s3(
                    "complete_multipart_upload",
                    Bucket=bucket,
                    Key=name,
                    UploadId=upload,
                    MultipartUpload={"Parts": parts},
                )
            except Exception as exc:
                # A retry whose first try completed the upload after all: the object is there.
                if not (tries > 1 and _no_such_upload(exc) and fs.exists(key)):
                    raise

        _retrying(storage, "complete the upload of", key, complete)
    except BaseException:
        with contextlib.suppress(Exception):  # refuses the parts still on their way
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=name, UploadId=upload)
        raise


def put_files(storage: RemoteStore, local: Path, key: str, names: list[str]) -> None:
    """Upload the files ``names`` (relative POSIX paths) of ``local`` to ``key/name``, several at once."""
    if not names:
        return
    with ThreadPoolExecutor(max_workers=min(CONCURRENCY, len(names))) as pool:
        futures = [pool.submit(put_object, storage, f"{key}/{n}", local / n) for n in names]
        for future in futures:
            future.result()  # the first failure raises, once every upload has finished or been aborted


def abort_uploads(storage: RemoteStore, key: str) -> None:
    """Abort the unfinished multipart uploads into partial prefixes under ``key`` (a process killed mid-upload
    left them; only a save's own uploads are touched, never another writer's objects)."""
    bucket, _, prefix = key.partition("/")
    with contextlib.suppress(Exception):  # a store without the listing: nothing this can clean
        answer = storage.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix.rstrip("/") + "/")
        for upload in answer.get("Uploads", []):
            if not in_partial(upload["Key"]):
                continue
            with contextlib.suppress(Exception):
                storage.fs.call_s3(
                    "abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                )
