"""The file object store: writes happen on a writer thread and come back as references."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from pathlib import Path

import pytest

from calmq.errors import ConfigError
from calmq.objects import FileObjectStore


def _temp_files(root: Path) -> list[Path]:
    return list(root.rglob("*.tmp"))


async def test_many_puts_at_once_each_land_whole_under_their_key(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path)
    bodies = {f"tenant/artifacts/job-{i}.step.json": f'{{"n": {i}}}'.encode() for i in range(300)}
    refs = await asyncio.gather(*(store.put(k, v, "application/json") for k, v in bodies.items()))
    for (key, body), ref in zip(bodies.items(), refs, strict=True):
        assert (tmp_path / key).read_bytes() == body
        assert ref.sha256 == hashlib.sha256(body).hexdigest()
        assert ref.size == len(body)
        assert await store.get(ref.uri) == body
    assert not _temp_files(tmp_path)  # renamed into place, none left behind


async def test_a_small_put_is_written_off_the_event_loop_thread(tmp_path: Path) -> None:
    writers: list[str] = []
    store = FileObjectStore(tmp_path)
    write = store._put_sync

    def spy(key: str, data: bytes, content_type: str):  # type: ignore[no-untyped-def]
        writers.append(threading.current_thread().name)
        return write(key, data, content_type)

    store._put_sync = spy  # type: ignore[method-assign]
    await store.put("t/a.json", b"{}", "application/json")
    await store.put("t/big.bin", b"x" * (512 * 1024), "application/octet-stream")
    assert threading.current_thread().name not in writers
    assert len(writers) == 2


async def test_a_bad_key_fails_the_put_that_asked_and_not_the_others(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path)
    good, bad = await asyncio.gather(store.put("t/ok.json", b"1", "application/json"),
                                     store.put("t/../escape", b"2", "application/json"),
                                     return_exceptions=True)
    assert isinstance(bad, ConfigError)
    assert not isinstance(good, BaseException)
    assert (tmp_path / "t/ok.json").read_bytes() == b"1"
    with pytest.raises(ConfigError):
        await store.put("/absolute", b"3", "application/json")
