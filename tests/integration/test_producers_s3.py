"""Uploads, downloads and purges against a real S3 HTTP endpoint (moto in server mode)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest

from calmq.errors import ContractError
from calmq.objects import S3ObjectStore
from calmq.producers.uploads import delete_object, read_object, store_stream, tenant_owns
from calmq.tooling.devstack import processes

pytestmark = pytest.mark.integration

moto_server = pytest.importorskip("moto.server")


class Chunks:
    """A ChunkSource over bytes, handing out at most ``size`` bytes per read."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    async def read_chunk(self, size: int = 65536) -> bytes:
        chunk = self.data[self.at:self.at + size]
        self.at += len(chunk)
        return chunk


@pytest.fixture(scope="module")
def s3(request: pytest.FixtureRequest) -> Iterator[S3ObjectStore]:
    port = processes.free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = pytest.MonkeyPatch()
    env.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    env.setenv("AWS_ACCESS_KEY_ID", "test")
    env.setenv("AWS_SECRET_ACCESS_KEY", "test")
    env.setenv("AWS_DEFAULT_REGION", "us-east-1")
    try:
        store = S3ObjectStore("calmq-test", "objects")
        store._client.create_bucket(Bucket="calmq-test")
        yield store
    finally:
        env.undo()
        server.stop()


def _keys(store: S3ObjectStore) -> list[str]:
    listed = store._client.list_objects_v2(Bucket="calmq-test")
    return [o["Key"] for o in listed.get("Contents", [])]


def test_upload_download_and_purge_on_s3(s3: S3ObjectStore) -> None:
    """A streamed upload lands under the tenant prefix, streams back whole, and is deleted."""
    tenant = uuid.uuid4()
    data = bytes(range(256)) * 1000  # several chunks

    async def run() -> bytes:
        ref = await store_stream(s3, f"{tenant}/inputs/a", Chunks(data), "text/plain", 10**6)
        assert ref.uri == f"s3://calmq-test/objects/{tenant}/inputs/a"
        assert ref.size == len(data)
        assert tenant_owns("s3://calmq-test/objects", tenant, ref.uri)
        size, chunks = await read_object(s3, ref.uri)
        assert size == len(data)
        got = b"".join([c async for c in chunks])
        assert await delete_object(s3, ref.uri)
        return got

    assert asyncio.run(run()) == data
    assert f"objects/{tenant}/inputs/a" not in _keys(s3)


def test_oversized_upload_stores_nothing_on_s3(s3: S3ObjectStore) -> None:
    """Past the limit the upload fails with 413 and no object appears in the bucket."""
    tenant = uuid.uuid4()
    with pytest.raises(ContractError) as too_big:
        asyncio.run(store_stream(s3, f"{tenant}/inputs/b", Chunks(b"x" * 5000), "text/plain",
                                 4096))
    assert (too_big.value.code, too_big.value.status) == ("file_too_large", 413)
    assert not [k for k in _keys(s3) if str(tenant) in k]
