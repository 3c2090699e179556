"""The object store: inputs and artifacts are passed by reference, never inside messages.

``file:///path`` is the embedded default; ``s3://bucket/prefix`` goes through boto3 (AWS,
MinIO, any S3 API; ``CALMQ_S3_ENDPOINT_URL``-style endpoints come from boto3's own env).
Keys are always ``<tenant id>/...`` so a tenant's objects share one prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import mimetypes
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote, unquote, urlparse

from calmq.errors import ConfigError, ContractError, NotFound

__all__ = ["CHUNK_BYTES", "PART_BYTES", "FileObjectStore", "ObjectInfo", "ObjectRef", "ObjectStore",
           "S3ObjectStore", "iter_chunks", "media_type", "open_object_store", "read_bounded",
           "stat_object", "too_large"]

# What a streaming read holds at a time.
CHUNK_BYTES = 64 * 1024
# One part of an S3 multipart upload: S3's smallest part (but the last), so that a stream of
# any length holds at most this much in memory and nothing on disk.
PART_BYTES = 5 * 1024 * 1024


@dataclass(frozen=True)
class ObjectRef:
    uri: str
    sha256: str
    content_type: str
    size: int

    def as_dict(self) -> dict[str, str | int]:
        return asdict(self)


class ObjectStore(Protocol):
    async def put(self, key: str, data: bytes, content_type: str) -> ObjectRef: ...

    async def get(self, uri: str) -> bytes: ...


def _check_key(key: str) -> None:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ConfigError(f"object key {key!r} is not a clean relative path")


class FileObjectStore:
    """Objects as files under one root folder; writes are atomic (temp file + rename)."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self._root = str(self.root)
        self._uri_root = self.root.as_uri()
        self._folders: set[str] = set()  # folders known to exist: no mkdir per object
        self._lock = threading.Lock()
        self._writer_thread: _Writer | None = None  # started by the first small put

    def _put_sync(self, key: str, data: bytes, content_type: str) -> ObjectRef:
        # Plain os calls on strings: pathlib's parsing cost more than the write itself on
        # the worker's hot path (one artifact per completed job).
        _check_key(key)
        folder, _, name = key.rpartition("/")
        folder_path = os.path.join(self._root, folder) if folder else self._root
        if folder_path not in self._folders:
            os.makedirs(folder_path, exist_ok=True)
            self._folders.add(folder_path)
        path = os.path.join(folder_path, name)
        # Unique per writer: puts of the same key may run at once on the executor's threads.
        tmp = os.path.join(folder_path, f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
        except FileNotFoundError:  # the folder was removed meanwhile (a purge): make it again
            self._folders.discard(folder_path)
            os.makedirs(folder_path, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
        os.replace(tmp, path)
        uri = f"{self._uri_root}/{quote(key)}"
        return ObjectRef(uri, hashlib.sha256(data).hexdigest(), content_type, len(data))

    async def put(self, key: str, data: bytes, content_type: str) -> ObjectRef:
        # Off the event loop, always: creating a file is kernel work that cost 0.04 ms or
        # 0.25-0.6 ms on the same disk minutes apart (journal-less ext4 skips recently
        # deleted inodes one by one), and on the worker's loop that stalled every job in
        # flight. Small objects
        # go to one writer thread that settles a whole batch with one loop wake-up; large
        # ones to a thread of their own so they hold up no small write.
        if len(data) < 256 * 1024:
            return await self._writer().put(key, data, content_type)
        return await asyncio.to_thread(self._put_sync, key, data, content_type)

    def _writer(self) -> _Writer:
        with self._lock:
            if self._writer_thread is None:
                self._writer_thread = _Writer(self._put_sync)
            return self._writer_thread

    async def get(self, uri: str) -> bytes:
        path = Path(unquote(urlparse(uri).path))  # put quotes the key into the URI
        if ".." in path.parts or not path.is_relative_to(self.root):
            raise NotFound(f"{uri} is outside this object store")
        try:
            return await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            raise NotFound(f"object {uri} does not exist") from None


_Job = tuple[str, bytes, str, "asyncio.Future[ObjectRef]", asyncio.AbstractEventLoop]


class _Writer:
    """One daemon thread writing small objects in arrival order.

    It takes every put queued while it was busy as one batch and settles the batch's futures
    with a single ``call_soon_threadsafe`` per event loop, so a busy loop is woken once per
    batch rather than once per object. A put whose caller gave up (cancelled) may still be
    written; the key is the same on a retry, so the retry overwrites it. Daemon: at exit
    an unfinished write is like a crash before it — its job's outcome was not recorded yet.
    """

    _BATCH = 256

    def __init__(self, write: Callable[[str, bytes, str], ObjectRef]) -> None:
        self._write = write
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="calmq-objects", daemon=True).start()

    def put(self, key: str, data: bytes, content_type: str) -> asyncio.Future[ObjectRef]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[ObjectRef] = loop.create_future()
        self._queue.put((key, data, content_type, future, loop))
        return future

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < self._BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            settled: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[ObjectRef],
                                                                 ObjectRef | BaseException]]] = {}
            for key, data, content_type, future, loop in batch:
                outcome: ObjectRef | BaseException
                try:
                    outcome = self._write(key, data, content_type)
                except Exception as exc:  # noqa: BLE001 - handed to the caller, who decides
                    outcome = exc
                settled.setdefault(loop, []).append((future, outcome))
            for loop, outcomes in settled.items():
                # A closed loop: nobody waits for these any more.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_settle, outcomes)


def _settle(outcomes: list[tuple[asyncio.Future[ObjectRef], ObjectRef | BaseException]]) -> None:
    for future, outcome in outcomes:
        if future.done():  # cancelled while it was being written
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


class S3ObjectStore:
    """Objects in an S3 bucket under a prefix, through boto3 (run in a thread: boto3 blocks)."""

    def __init__(self, bucket: str, prefix: str) -> None:
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        # SigV4 for every request and for presigned URLs (the legacy signature, boto3's
        # default for presigning in some regions, is refused by newer regions and stores).
        self._client = boto3.client("s3", config=Config(signature_version="s3v4"))

    def _key(self, key: str) -> str:
        _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    async def put(self, key: str, data: bytes, content_type: str) -> ObjectRef:
        full = self._key(key)
        await asyncio.to_thread(
            self._client.put_object,
            Bucket=self.bucket, Key=full, Body=data, ContentType=content_type,
        )
        return ObjectRef(
            f"s3://{self.bucket}/{full}", hashlib.sha256(data).hexdigest(), content_type, len(data)
        )

    async def put_stream(self, key: str, chunks: AsyncIterator[bytes], content_type: str
                         ) -> ObjectRef:
        """Store the bytes ``chunks`` yields under ``key`` without holding them whole: one
        ``PART_BYTES`` part at a time as an S3 multipart upload (a stream shorter than one
        part is a single put). Nothing is visible under ``key`` unless the stream ends
        normally: on any error (one ``chunks`` raises, say, past a size limit) the upload
        is aborted and S3 drops its parts."""
        full = self._key(key)
        digest = hashlib.sha256()
        size = 0
        pending: list[bytes] = []
        held = 0
        upload_id: str | None = None
        parts: list[dict[str, Any]] = []
        client: Any = self._client
        try:
            async for chunk in chunks:
                digest.update(chunk)
                size += len(chunk)
                pending.append(chunk)
                held += len(chunk)
                if held < PART_BYTES:
                    continue
                if upload_id is None:
                    started = await asyncio.to_thread(
                        client.create_multipart_upload, Bucket=self.bucket, Key=full,
                        ContentType=content_type)
                    upload_id = str(started["UploadId"])
                body = b"".join(pending)
                pending, held = [], 0
                parts.append(await self._part(full, upload_id, len(parts) + 1, body))
                del body
            if upload_id is None:  # shorter than a part: one put
                body = b"".join(pending)
                await asyncio.to_thread(client.put_object, Bucket=self.bucket, Key=full,
                                        Body=body, ContentType=content_type)
            else:
                if pending:
                    parts.append(await self._part(full, upload_id, len(parts) + 1,
                                                  b"".join(pending)))
                await asyncio.to_thread(
                    client.complete_multipart_upload, Bucket=self.bucket, Key=full,
                    UploadId=upload_id, MultipartUpload={"Parts": parts})
        except BaseException:
            if upload_id is not None:
                # Best effort: S3's lifecycle rule for incomplete uploads is the backstop
                # (docs/how-to/production-checklist.md).
                with contextlib.suppress(Exception):
                    await asyncio.shield(asyncio.to_thread(
                        client.abort_multipart_upload, Bucket=self.bucket, Key=full,
                        UploadId=upload_id))
            raise
        return ObjectRef(f"s3://{self.bucket}/{full}", digest.hexdigest(), content_type, size)

    async def _part(self, full: str, upload_id: str, number: int, body: bytes
                    ) -> dict[str, Any]:
        done = await asyncio.to_thread(
            self._client.upload_part, Bucket=self.bucket, Key=full, UploadId=upload_id,
            PartNumber=number, Body=body)
        return {"PartNumber": number, "ETag": done["ETag"]}

    async def get(self, uri: str) -> bytes:
        parsed = urlparse(uri)
        if parsed.netloc != self.bucket:
            raise NotFound(f"{uri} is outside this object store")
        try:
            obj = await asyncio.to_thread(
                self._client.get_object, Bucket=self.bucket, Key=parsed.path.lstrip("/")
            )
        except self._client.exceptions.NoSuchKey:
            raise NotFound(f"object {uri} does not exist") from None
        body: bytes = await asyncio.to_thread(obj["Body"].read)
        return body


def presigned_url(store: ObjectStore, uri: str, seconds: int) -> str | None:
    """An HTTPS URL that fetches the object without calmq's credentials for ``seconds``
    (S3's presigned GET, signed locally: no request to S3), or None where the store has
    none (files: the API's artifact route serves them)."""
    if not isinstance(store, S3ObjectStore):
        return None
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or parsed.netloc != store.bucket:
        return None
    url: str = store._client.generate_presigned_url(
        "get_object", Params={"Bucket": store.bucket, "Key": parsed.path.lstrip("/")},
        ExpiresIn=seconds)
    return url


def open_object_store(url: str) -> ObjectStore:
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return FileObjectStore(Path(parsed.path))
    if parsed.scheme == "s3":
        return S3ObjectStore(parsed.netloc, parsed.path)
    raise ConfigError(
        f"object_store_url {url!r} is neither file:///path nor s3://bucket/prefix",
        code="invalid_object_store_url",
    )


# -- input by reference: what an object is, and reading it without holding it whole -------


@dataclass(frozen=True)
class ObjectInfo:
    size: int
    content_type: str  # a bare media type, lower case ("text/plain")


def media_type(content_type: str) -> str:
    """``Text/Plain; charset=utf-8`` -> ``text/plain``."""
    return content_type.split(";", 1)[0].strip().lower()


def _sniff(head: bytes, name: str) -> str:
    """A file's media type: a file store keeps none, so from its name, else its first bytes."""
    guessed, _ = mimetypes.guess_type(name)
    if guessed:
        return guessed
    if head.startswith(b"%PDF"):
        return "application/pdf"
    if head.lstrip()[:1] in (b"{", b"["):
        return "application/json"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 3:  # not just a character cut at the end of the sample
            return "application/octet-stream"
    return "text/plain"


def _file_of(store: FileObjectStore, uri: str) -> Path:
    parsed = urlparse(uri)
    path = Path(unquote(parsed.path))
    if parsed.scheme != "file" or ".." in path.parts or not path.is_relative_to(store.root):
        raise NotFound(f"{uri} is outside this object store")
    return path


async def stat_object(store: ObjectStore, uri: str) -> ObjectInfo:
    """The size and media type of an object, without reading it (NotFound when absent)."""
    if isinstance(store, FileObjectStore):
        path = _file_of(store, uri)

        def look() -> ObjectInfo:
            try:
                size = path.stat().st_size
                with path.open("rb") as fh:
                    head = fh.read(4096)
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                raise NotFound(f"object {uri} does not exist") from None
            return ObjectInfo(size, _sniff(head, path.name))

        return await asyncio.to_thread(look)
    if isinstance(store, S3ObjectStore):
        parsed = urlparse(uri)
        if parsed.scheme != "s3" or parsed.netloc != store.bucket:
            raise NotFound(f"{uri} is outside this object store")
        client: Any = store._client
        try:
            head = await asyncio.to_thread(client.head_object, Bucket=store.bucket,
                                           Key=parsed.path.lstrip("/"))
        except client.exceptions.ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code")) in ("404", "NoSuchKey",
                                                                    "NotFound"):
                raise NotFound(f"object {uri} does not exist") from None
            raise
        return ObjectInfo(int(head["ContentLength"]),
                          media_type(str(head.get("ContentType") or "application/octet-stream")))
    data = await store.get(uri)  # another store: only whole reads exist
    return ObjectInfo(len(data), _sniff(data[:4096], urlparse(uri).path))


async def iter_chunks(store: ObjectStore, uri: str, chunk: int = CHUNK_BYTES
                      ) -> AsyncIterator[bytes]:
    """The object's bytes, ``chunk`` at a time (never whole, for the file and S3 stores)."""
    if isinstance(store, FileObjectStore):
        path = _file_of(store, uri)
        try:
            fh = await asyncio.to_thread(path.open, "rb")
        except FileNotFoundError:
            raise NotFound(f"object {uri} does not exist") from None
        try:
            while data := await asyncio.to_thread(fh.read, chunk):
                yield data
        finally:
            fh.close()
        return
    if isinstance(store, S3ObjectStore):
        parsed = urlparse(uri)
        if parsed.netloc != store.bucket:
            raise NotFound(f"{uri} is outside this object store")
        client: Any = store._client
        try:
            obj = await asyncio.to_thread(client.get_object, Bucket=store.bucket,
                                          Key=parsed.path.lstrip("/"))
        except client.exceptions.NoSuchKey:
            raise NotFound(f"object {uri} does not exist") from None
        body = obj["Body"]
        try:
            while data := await asyncio.to_thread(body.read, chunk):
                yield data
        finally:
            body.close()
        return
    yield await store.get(uri)


def too_large(uri: str, limit: int) -> ContractError:
    return ContractError(f"the input {uri} is over the workflow's {limit} byte limit for "
                         "input by reference", code="input_too_large", status=413)


async def read_bounded(store: ObjectStore, uri: str, limit: int) -> bytes:
    """The object's bytes, read in chunks and never more than ``limit`` + one chunk of them:
    ContractError ``input_too_large`` past ``limit`` (an object grown since it was checked)."""
    data = bytearray()
    chunks = iter_chunks(store, uri)
    try:
        async for piece in chunks:
            data += piece
            if len(data) > limit:
                raise too_large(uri, limit)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    return bytes(data)
