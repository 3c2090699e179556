"""The object store: inputs and artifacts are passed by reference, never inside messages.

``file:///path`` is the embedded default; ``s3://bucket/prefix`` goes through boto3 (AWS,
MinIO, any S3 API; ``CALMQ_S3_ENDPOINT_URL``-style endpoints come from boto3's own env).
Keys are always ``<tenant id>/...`` so a tenant's objects share one prefix.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import quote, unquote, urlparse

from calmq.errors import ConfigError, NotFound

__all__ = ["FileObjectStore", "ObjectRef", "ObjectStore", "S3ObjectStore", "open_object_store"]


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
        # Small objects in place: creating a file in an existing folder and renaming it take
        # ~0.1 ms, less than a thread hop, and a pool thread holding the GIL delays the event
        # loop more than that. Creating folders is what is slow (~0.8 ms on ext4), so keys
        # that make one per object (artifact_key did) must not be used on hot paths.
        if len(data) < 256 * 1024:
            return self._put_sync(key, data, content_type)
        return await asyncio.to_thread(self._put_sync, key, data, content_type)

    async def get(self, uri: str) -> bytes:
        path = Path(unquote(urlparse(uri).path))  # put quotes the key into the URI
        if ".." in path.parts or not path.is_relative_to(self.root):
            raise NotFound(f"{uri} is outside this object store")
        try:
            return await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            raise NotFound(f"object {uri} does not exist") from None


class S3ObjectStore:
    """Objects in an S3 bucket under a prefix, through boto3 (run in a thread: boto3 blocks)."""

    def __init__(self, bucket: str, prefix: str) -> None:
        import boto3

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._client = boto3.client("s3")

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
