"""Objects the API moves by stream: multipart uploads in, artifacts out, and purges.

The kernel's ObjectStore puts and gets whole byte strings, which suits artifacts a worker
writes; an upload of up to ``max_upload_bytes`` must never be held whole in memory, nor
spooled whole to the pod's small disk, so the API streams it here: to a temp file next to
its final place (file://), or straight into an S3 multipart upload, one part in memory at a
time (s3://, ``S3ObjectStore.put_stream``). Nothing is visible under the final key until the
whole body arrived within the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import IO, Any, Protocol
from urllib.parse import quote, unquote, urlparse

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from calmq.errors import ContractError, NotFound
from calmq.objects import FileObjectStore, ObjectRef, ObjectStore, S3ObjectStore
from calmq.producers.parsing import parse_json

__all__ = ["ChunkSource", "delete_folder", "delete_object", "object_uri", "read_form",
           "read_object", "store_stream", "tenant_owns"]

_CHUNK = 64 * 1024
_FIELD_MAX = 1024 * 1024  # a non-file multipart field; the JSON body has the same limit


class ChunkSource(Protocol):
    async def read_chunk(self, size: int = ...) -> bytes: ...


def tenant_owns(store_url: str, tenant_id: uuid.UUID, ref: str) -> bool:
    """Whether ``ref`` names an object inside the tenant's prefix of the configured store.

    Compares parsed, unquoted paths segment by segment, so ``..``, ``%2e%2e``, another
    bucket, another scheme or a sibling tenant id with the same prefix all fail.
    """
    base, target = urlparse(store_url.rstrip("/")), urlparse(ref)
    if (target.scheme, target.netloc) != (base.scheme, base.netloc):
        return False
    if target.query or target.fragment or target.params:
        return False
    base_parts = [p for p in unquote(base.path).split("/") if p]
    parts = unquote(target.path).split("/")
    if parts and parts[0] == "":
        parts = parts[1:]
    if any(p in ("", ".", "..") or "\\" in p for p in parts):
        return False
    want = [*base_parts, str(tenant_id)]
    return parts[: len(want)] == want and len(parts) > len(want)


async def store_stream(
    objects: ObjectStore, key: str, source: ChunkSource, content_type: str, limit: int
) -> ObjectRef:
    """Copy ``source`` to ``key`` chunk by chunk; ContractError 413 past ``limit`` bytes.

    On any failure nothing is left under ``key`` (and no temp file is left behind).
    """
    if isinstance(objects, S3ObjectStore):
        return await objects.put_stream(key, _bounded(source, limit), content_type)
    if isinstance(objects, FileObjectStore):
        final = objects.root / key
        # A directory create and an empty temp file: metadata calls, cheap next to the upload.
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".up")
    else:
        fd, tmp_name = tempfile.mkstemp(prefix="calmq-upload-", suffix=".up")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as fh:
            digest, size = await _copy(source, fh, limit)
        ref = ObjectRef("", digest, content_type, size)
        if isinstance(objects, FileObjectStore):
            await asyncio.to_thread(tmp.replace, final)
            return ObjectRef(final.as_uri(), ref.sha256, content_type, size)
        # Another ObjectStore implementation: only whole puts are possible.
        data = await asyncio.to_thread(tmp.read_bytes)
        return await objects.put(key, data, content_type)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # noqa: ASYNC240 - one metadata call, on the failure path mostly


async def _bounded(source: ChunkSource, limit: int) -> AsyncIterator[bytes]:
    """``source``'s chunks, and ContractError 413 as soon as they pass ``limit`` bytes."""
    size = 0
    while chunk := await source.read_chunk(_CHUNK):
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        yield chunk


def _too_large(limit: int) -> ContractError:
    return ContractError(f"the file is over the {limit} byte upload limit",
                         code="file_too_large", status=413)


async def _copy(source: ChunkSource, fh: IO[bytes], limit: int) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    while chunk := await source.read_chunk(_CHUNK):
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        digest.update(chunk)
        fh.write(chunk)
    return digest.hexdigest(), size


async def _field_text(part: BodyPartReader, room: int) -> tuple[str, int]:
    """The field's text and its size in bytes; ContractError 413 past ``_FIELD_MAX`` or
    past ``room``, what is left of the fields' total allowance."""
    data = bytearray()
    while chunk := await part.read_chunk(_CHUNK):
        data += chunk
        if len(data) > _FIELD_MAX:
            raise ContractError(f"field {part.name} is over {_FIELD_MAX} bytes",
                                code="body_too_large", status=413)
        if len(data) > room:
            raise ContractError("the multipart fields are over their total size limit",
                                code="fields_too_large", status=413)
    try:
        return data.decode(part.get_charset(default="utf-8")), len(data)
    except (UnicodeDecodeError, LookupError) as exc:
        raise ContractError(f"field {part.name} is not text", code="invalid_multipart") from exc


async def read_form(
    request: web.Request, objects: ObjectStore, prefix: str, max_upload: int,
    stored: list[ObjectRef], *, max_parts: int = 16, max_field_bytes: int = _FIELD_MAX,
    file_limit: Callable[[Mapping[str, Any]], int | None] | None = None,
) -> tuple[dict[str, Any], bytes]:
    """A multipart submit's fields, with its ``file`` part streamed to the object store.

    At most ``max_parts`` parts and ``max_field_bytes`` of non-file fields in all (aiohttp's
    ``client_max_size`` does not bound a multipart read): past either a 413 problem
    (``too_many_parts``, ``fields_too_large``), and the caller deletes what was stored.

    ``file_limit`` (given the fields read before the file) may lower the file's limit below
    ``max_upload`` (the workflow's own maximum): past it, a 413 ``input_too_large`` as soon
    as the limit is crossed, not after the whole upload.

    The file goes under ``prefix`` and is appended to ``stored`` as soon as it is written,
    so the caller can delete it if the request fails later. ``input_ref`` names the file;
    the digest covers every field and the file's hash (the Idempotency-Key's body hash).
    """
    fields: dict[str, Any] = {}
    digest = hashlib.sha256()
    parts = 0
    room = max_field_bytes
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            parts += 1
            if parts > max_parts:
                raise ContractError(f"a multipart submit has at most {max_parts} parts",
                                    code="too_many_parts", status=413)
            if not isinstance(part, BodyPartReader) or not part.name:
                raise ContractError("every part needs a name; nested multipart is not supported",
                                    code="invalid_multipart")
            if part.name == "file":
                if stored:
                    raise ContractError("send one part named file", code="invalid_multipart")
                own = file_limit(fields) if file_limit is not None else None
                limit = min(max_upload, own) if own is not None else max_upload
                try:
                    ref = await store_stream(
                        objects, f"{prefix}/{uuid.uuid4()}", part,
                        part.headers.get("Content-Type", "application/octet-stream")[:200],
                        limit)
                except ContractError as exc:
                    if exc.code == "file_too_large" and limit < max_upload:
                        raise ContractError(
                            f"the file is over the workflow's {limit} byte limit for input by"
                            " reference", code="input_too_large", status=413) from None
                    raise
                stored.append(ref)
                digest.update(f"file={ref.sha256}".encode())
            else:
                if part.name in fields:
                    raise ContractError(f"field {part.name} is sent twice",
                                        code="invalid_multipart")
                text, size = await _field_text(part, room)
                room -= size
                fields[part.name] = text
                digest.update(f"{part.name}={text}".encode())
    except (ValueError, AssertionError, RuntimeError, HttpProcessingError) as exc:
        # aiohttp's reader raises these for a missing boundary, a bad part header or a body
        # that ends mid-part.
        raise ContractError(f"the multipart body is malformed: {exc}",
                            code="invalid_multipart") from exc
    for name in ("input", "metadata"):
        if name in fields:
            fields[name] = parse_json(fields[name], f"field {name}")
    if "deadline_seconds" in fields:
        try:
            fields["deadline_seconds"] = int(fields["deadline_seconds"])
        except ValueError as exc:
            raise ContractError("deadline_seconds is not an integer", code="invalid_body",
                                status=422) from exc
    if not stored:
        raise ContractError("a multipart submit needs a part named file", code="missing_file",
                            status=422)
    if "input" in fields or "input_ref" in fields:
        raise ContractError("a multipart submit carries its input as the file part",
                            code="invalid_body", status=422)
    fields["input_ref"] = stored[0].uri
    return fields, digest.digest()


async def read_object(objects: ObjectStore, uri: str) -> tuple[int, AsyncIterator[bytes]]:
    """The object's size and an iterator over its bytes in chunks (never read whole)."""
    if isinstance(objects, FileObjectStore):
        path = _file_path(objects, uri)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise NotFound("the artifact object is gone") from None
        return size, _file_chunks(path)
    if isinstance(objects, S3ObjectStore):
        parsed = urlparse(uri)
        if parsed.netloc != objects.bucket:
            raise NotFound("the artifact is outside this object store")
        client: Any = objects._client
        try:
            obj = await asyncio.to_thread(
                client.get_object, Bucket=objects.bucket, Key=parsed.path.lstrip("/"))
        except client.exceptions.NoSuchKey:
            raise NotFound("the artifact object is gone") from None
        return int(obj["ContentLength"]), _s3_chunks(obj["Body"])
    data = await objects.get(uri)

    async def whole() -> AsyncIterator[bytes]:
        yield data

    return len(data), whole()


def _file_path(objects: FileObjectStore, uri: str) -> Path:
    path = Path(unquote(urlparse(uri).path)).resolve()
    if not path.is_relative_to(objects.root):
        raise NotFound("the object is outside this object store")
    return path


async def _file_chunks(path: Path) -> AsyncIterator[bytes]:
    fh = await asyncio.to_thread(path.open, "rb")
    try:
        while chunk := await asyncio.to_thread(fh.read, _CHUNK):
            yield chunk
    finally:
        fh.close()


async def _s3_chunks(body: Any) -> AsyncIterator[bytes]:
    try:
        while chunk := await asyncio.to_thread(body.read, _CHUNK):
            yield chunk
    finally:
        body.close()


async def delete_object(objects: ObjectStore, uri: str) -> bool:
    """Delete one object; False when it was not there (deletion is idempotent)."""
    if isinstance(objects, FileObjectStore):
        try:
            path = _file_path(objects, uri)
        except NotFound:
            return False
        try:
            await asyncio.to_thread(path.unlink)
        except FileNotFoundError:
            return False
        return True
    if isinstance(objects, S3ObjectStore):
        parsed = urlparse(uri)
        if parsed.netloc != objects.bucket:
            return False
        await asyncio.to_thread(
            objects._client.delete_object,
            Bucket=objects.bucket, Key=parsed.path.lstrip("/"),
        )
        return True
    return False


def object_uri(objects: ObjectStore, key: str) -> str | None:
    """The URI a put of ``key`` would have returned, or None for another kind of store."""
    if isinstance(objects, FileObjectStore):
        return f"{objects.root.as_uri()}/{quote(key)}"
    if isinstance(objects, S3ObjectStore):
        return f"s3://{objects.bucket}/{objects._key(key)}"
    return None


async def delete_folder(objects: ObjectStore, key: str) -> int:
    """Delete every object under the folder ``key`` (``<tenant>/<job>``: what a job's steps
    wrote with ``StepContext.object_key``); returns how many. Idempotent."""
    key = key.strip("/")
    if not key or any(p in ("", ".", "..") for p in key.split("/")):
        raise ValueError(f"{key!r} is not a clean folder key")
    if isinstance(objects, FileObjectStore):
        folder = objects.root / key
        return await asyncio.to_thread(_remove_tree, folder)
    if isinstance(objects, S3ObjectStore):
        return await asyncio.to_thread(_delete_s3_prefix, objects, objects._key(key) + "/")
    return 0


def _remove_tree(folder: Path) -> int:
    if not folder.is_dir():
        return 0
    count = sum(len(files) for _d, _s, files in os.walk(folder))
    shutil.rmtree(folder, ignore_errors=True)
    return count


def _delete_s3_prefix(objects: S3ObjectStore, prefix: str) -> int:
    client: Any = objects._client
    count = 0
    for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=objects.bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:  # a page holds at most 1000 keys, what one delete_objects takes
            client.delete_objects(Bucket=objects.bucket, Delete={"Objects": keys, "Quiet": True})
            count += len(keys)
    return count
