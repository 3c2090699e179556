"""The pure parts of tenant quotas, spend caps and input by reference (issues 15 and 19)."""

from __future__ import annotations

import asyncio
import contextlib
import tracemalloc
import uuid
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calmq.calls.quota import TenantQuota
from calmq.data.spending import Spend, SpendCap
from calmq.errors import ContractError
from calmq.objects import FileObjectStore, iter_chunks, read_bounded, stat_object
from calmq.processors.admission import QuotaGate
from calmq.processors.request import Request
from calmq.spending import Holds, SpendCaps
from calmq.workflows import ByReference
from calmq.workflows.embed_document import chunk_stream, chunk_text
from calmq.workflows.summarize import SUMMARIZE


async def _chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.sampled_from("ab é\n\u4e2d"), max_size=3000),
       size=st.integers(min_value=50, max_value=400),
       piece=st.integers(min_value=1, max_value=700))
def test_chunk_stream_cuts_the_same_pieces_as_chunk_text(text: str, size: int,
                                                         piece: int) -> None:
    """Read in chunks of any size (a character may be cut between two), the document gives
    exactly chunk_text's pieces."""
    got = asyncio.run(chunk_stream(_chunks(text.encode(), piece), size, 10**9))
    assert got == chunk_text(text, size)


def test_chunk_stream_refuses_past_its_limit() -> None:
    with pytest.raises(ContractError) as refused:
        asyncio.run(chunk_stream(_chunks(b"x" * 5000, 100), 100, 1000))
    assert refused.value.code == "input_too_large"


def test_a_streamed_file_is_never_held_whole(tmp_path: Path) -> None:
    """Chunking a 2 MB file by reference allocates about the pieces' size, not the file's
    bytes plus their text (reading it whole and decoding it holds both at once)."""
    store = FileObjectStore(tmp_path)
    path = tmp_path / "t" / "doc.txt"
    path.parent.mkdir()
    size = 2 * 1024 * 1024
    path.write_bytes((b"word " * (size // 5 + 1))[:size])

    async def stream() -> int:
        return len(await chunk_stream(iter_chunks(store, path.as_uri()), 1000, size))

    async def whole() -> int:
        return len(chunk_text(path.read_bytes().decode(), 1000))

    def peak(run: Coroutine[Any, Any, int]) -> int:
        tracemalloc.start()
        try:
            asyncio.run(run)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    streamed, read_whole = peak(stream()), peak(whole())
    assert streamed < read_whole * 0.75, (streamed, read_whole)


def test_read_bounded_stops_past_the_limit(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path)
    path = tmp_path / "big.txt"
    path.write_bytes(b"x" * 1_000_000)
    with pytest.raises(ContractError) as refused:
        asyncio.run(read_bounded(store, path.as_uri(), 100_000))
    assert refused.value.code == "input_too_large"
    assert asyncio.run(read_bounded(store, path.as_uri(), 1_000_000)) == path.read_bytes()


@pytest.mark.parametrize(("name", "data", "kind"), [
    ("a.txt", b"hello", "text/plain"), ("a.pdf", b"%PDF-1.4", "application/pdf"),
    ("noext", b"%PDF-1.4 x", "application/pdf"), ("noext", b' {"a": 1}', "application/json"),
    ("noext", "caf\u00e9".encode(), "text/plain"), ("noext", b"\xff\xfe\x00\x01" * 10,
                                                       "application/octet-stream"),
])
def test_stat_object_names_a_files_type(tmp_path: Path, name: str, data: bytes,
                                        kind: str) -> None:
    store = FileObjectStore(tmp_path)
    (tmp_path / name).write_bytes(data)
    info = asyncio.run(stat_object(store, (tmp_path / name).as_uri()))
    assert (info.size, info.content_type) == (len(data), kind)


def test_by_reference_checks_type_then_size() -> None:
    accepts = ByReference(frozenset({"text/plain"}), max_bytes=10)
    accepts.check("w", "Text/Plain; charset=utf-8", 10)
    for content_type, size, code in (("image/png", 1, "unsupported_input_type"),
                                     ("text/plain", 11, "input_too_large")):
        with pytest.raises(ContractError) as refused:
            accepts.check("w", content_type, size)
        assert refused.value.code == code
    assert SUMMARIZE.accepts_reference().max_bytes > 0


# -- spend caps ----------------------------------------------------------------------------

class _Ledger:
    """A SpendLedger's reads, from dicts."""

    def __init__(self, caps: dict[uuid.UUID, SpendCap], spend: dict[uuid.UUID, Spend]) -> None:
        self._caps, self._spend = caps, spend

    async def caps(self) -> dict[uuid.UUID, SpendCap]:
        return self._caps

    async def spend(self) -> dict[uuid.UUID, Spend]:
        return self._spend


_NO_CAP = SpendCap(None, None)


def _holds(caps: dict[uuid.UUID, SpendCap], spend: dict[uuid.UUID, Spend],
           fleet: SpendCap = _NO_CAP) -> Holds:
    ledger: Any = _Ledger(caps, spend)  # the reads of a SpendLedger
    caps_ = SpendCaps(ledger, fleet=fleet, bulk_fraction=0.9, refresh_seconds=1)
    return asyncio.run(caps_.refresh())


def test_bulk_waits_first_and_interactive_at_the_full_cap() -> None:
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    holds = _holds({a: SpendCap(10, None), b: SpendCap(None, 100), c: SpendCap(10, 100)},
                   {a: Spend(9.5, 9.5), b: Spend(100, 100), c: Spend(1, 1)})
    assert holds.reason(a, "bulk") == "spend_cap_daily"
    assert holds.reason(a, "interactive") is None
    assert holds.reason(b, "interactive") == "spend_cap_monthly"
    assert holds.reason(c, "bulk") is None
    assert holds.reason(uuid.uuid4(), "bulk") is None  # no cap of its own


def test_the_fleet_cap_holds_every_tenant() -> None:
    a, b = uuid.uuid4(), uuid.uuid4()
    holds = _holds({}, {a: Spend(6, 6), b: Spend(4, 4)}, fleet=SpendCap(10, None))
    assert holds.reason(b, "bulk") == "fleet_spend_cap_daily"
    assert holds.reason(b, "interactive") == "fleet_spend_cap_daily"
    assert _holds({}, {a: Spend(1, 1)}) == Holds()


class _SlowLedger(_Ledger):
    """A ledger whose spend read waits until let go: a read of the caps in flight."""

    def __init__(self, caps: dict[uuid.UUID, SpendCap], spend: dict[uuid.UUID, Spend]) -> None:
        super().__init__(caps, spend)
        self.go = asyncio.Event()
        self.reads = 0

    async def spend(self) -> dict[uuid.UUID, Spend]:
        self.reads += 1
        await self.go.wait()
        return self._spend

    async def release(self, **holds: Any) -> list[Any]:
        return []  # nothing waits


def test_a_gate_waits_for_the_read_in_flight_rather_than_take_the_holds_before_it() -> None:
    """A cap lowered just before a read started: a gate asking while that read is in flight gets
    its holds (the read before it predates the cap), and the two share one read."""

    async def run() -> None:
        tenant = uuid.uuid4()
        ledger = _SlowLedger({tenant: SpendCap(100, None)}, {tenant: Spend(5, 5)})
        ledger.go.set()
        reads: Any = ledger  # the reads of a SpendLedger
        caps_ = SpendCaps(reads, fleet=_NO_CAP, bulk_fraction=0.9, refresh_seconds=60)
        assert (await caps_.holds()).reason(tenant, "bulk") is None
        ledger._caps = {tenant: SpendCap(1, None)}  # the cap is lowered
        ledger.go.clear()
        release = asyncio.create_task(caps_.release())  # the release pass starts a read
        await asyncio.sleep(0)
        gate = asyncio.create_task(caps_.holds())  # within the refresh interval
        await asyncio.sleep(0)
        assert not gate.done()  # it waits for the read in flight
        ledger.go.set()
        assert (await gate).reason(tenant, "bulk") == "spend_cap_daily"
        assert ledger.reads == 2
        assert await release == 0

    asyncio.run(run())


# -- the tenant token quota -----------------------------------------------------------------

class _Tokens:
    """A tenant token ledger that grants only into debt: every bulk call waits."""

    def __init__(self) -> None:
        self.given_back: list[float] = []
        self.debts: list[float] = []

    async def take(self, tenant_id: uuid.UUID, need: float, rate: float, cap: float, *,
                   debt: float = 0.0) -> tuple[bool, float]:
        self.debts.append(debt)
        return debt > 0, 0.05

    async def give_back(self, tenant_id: uuid.UUID, tokens: float, cap: float) -> None:
        self.given_back.append(tokens)

    async def quotas(self) -> dict[uuid.UUID, int]:
        return {}

    async def active_tenants(self) -> int:
        return self.active

    active = 1


def test_a_tenants_allowance_is_what_its_quota_serves_soon() -> None:
    """6000 tokens a minute serve 2 calls of 500 tokens in 10 s: a worker holds 2 of the
    tenant's jobs at most; calls waiting at the quota are counted while they wait; a tenant
    with a quota of 0 has none (no allowance)."""

    async def run() -> None:
        tokens = _Tokens()
        quota = TenantQuota(tokens, 6000, queue_seconds=10)
        tenant = uuid.uuid4()
        waiting = [asyncio.create_task(quota.acquire(str(tenant), 500)) for _ in range(3)]
        # One turn of the loop runs them to their wait: the fake ledger never suspends.
        await asyncio.sleep(0)
        assert quota.waiting(tenant) == 3
        assert quota.allowance(tenant) == 2
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        assert quota.waiting(tenant) == 0
        assert TenantQuota(tokens, 0).allowance(tenant) is None
        # An interactive call goes at once, into debt if need be: at most 10 s of the
        # quota (6000 a minute: 1000 tokens).
        assert await quota.acquire(str(tenant), 500, "interactive") is not None
        assert tokens.debts[-1] == pytest.approx(1000)
        assert set(tokens.debts[:-1]) == {0.0}  # bulk calls: none

    asyncio.run(run())


def test_interactive_jobs_have_a_room_of_their_own_and_a_flood_of_them_waits() -> None:
    """A worker holds a tenant's jobs up to what its quota serves soon (2 at 6000 a minute,
    10 s, 500-token calls): its interactive jobs count only against each other, so a bulk
    backlog at the allowance leaves them room, and an interactive flood waits past it as
    ``token_quota`` like a bulk one."""

    class Held:
        async def hold(self, ids: list[uuid.UUID], reason: str,
                       detail: dict[str, Any]) -> list[uuid.UUID]:
            assert reason == "token_quota"
            return ids

    class Holding:
        def __init__(self, bulk: int, interactive: int) -> None:
            self.bulk, self.interactive = bulk, interactive

        def running(self, job_id: uuid.UUID) -> bool:
            return False

        def held_by(self, tenant_id: uuid.UUID, priority: str | None = None) -> int:
            return self.interactive + (self.bulk if priority is None else 0)

    quota = TenantQuota(_Tokens(), 6000, queue_seconds=10, interactive_debt_seconds=10)
    tenant = uuid.uuid4()
    gate = QuotaGate(quota.allowance, Held())  # type: ignore[arg-type]
    # The interactive room is what the debt bound serves at once, never above the bulk one.
    assert TenantQuota(_Tokens(), 6000, queue_seconds=10,
                       interactive_debt_seconds=5).allowance(tenant, "interactive") == 1
    assert TenantQuota(_Tokens(), 6000, queue_seconds=10,
                       interactive_debt_seconds=0).allowance(tenant, "interactive") == 2

    def requests(priority: str) -> list[Request]:
        return [Request(((f"calmq.p.{priority}", 0), n), uuid.uuid4(), "s", "w", str(tenant),
                        priority, None) for n in range(10)]

    async def held(batch: list[Request], occupancy: Holding) -> set[uuid.UUID]:
        async with contextlib.AsyncExitStack() as stack:
            return await gate.hold(batch, occupancy, stack)

    async def run() -> None:
        flood = requests("interactive")
        assert await held(flood, Holding(0, 0)) == {r.job_id for r in flood[2:]}
        bulk = requests("bulk")
        assert await held(bulk, Holding(0, 0)) == {r.job_id for r in bulk[2:]}
        # The tenant's bulk at its allowance: its interactive work still has its room.
        assert await held(flood, Holding(2, 0)) == {r.job_id for r in flood[2:]}
        # Its interactive jobs count against its bulk: none of those fit beside 2 of them.
        assert await held(bulk, Holding(0, 2)) == {r.job_id for r in bulk}

    asyncio.run(run())


def test_the_fair_share_is_all_of_it_alone_and_an_equal_part_among_active_tenants() -> None:
    """Without a quota of its own a tenant gets the larger of the share floor and the
    fleet's quota divided among the tenants active in the last minute."""

    async def run() -> None:
        tokens = _Tokens()
        quota = TenantQuota(tokens, 3000, fleet_per_minute=12000, refresh_seconds=0)
        tenant = uuid.uuid4()
        assert await quota.per_minute(tenant) == 12000
        tokens.active = 2
        assert await quota.per_minute(tenant) == 6000
        tokens.active = 10
        assert await quota.per_minute(tenant) == 3000  # the floor

    asyncio.run(run())
