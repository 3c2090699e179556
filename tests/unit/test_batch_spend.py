"""What a pack may reserve against the spend caps (calmq.spending ``SpendCaps.admit``),
without PostgreSQL: the rule is the holds' rule, counting what is spent and reserved and the
pack's own earlier requests, so a cap is passed by at most one request's estimate and a job
the release pass lets go is one a pack takes."""

from __future__ import annotations

import uuid
from typing import Any

from calmq.data.spending import Charge, Spend, SpendCap, Standing
from calmq.spending import SpendCaps

_NO_CAP = SpendCap(None, None)


def _caps(fleet: SpendCap = _NO_CAP) -> SpendCaps:
    ledger: Any = None  # admit reads nothing: the pack's transaction read the standing
    return SpendCaps(ledger, fleet=fleet, bulk_fraction=0.9, refresh_seconds=1)


def _charges(tenant: uuid.UUID, n: int, cost: float, priority: str = "bulk") -> list[Charge]:
    return [Charge(uuid.uuid4(), tenant, priority, cost) for _ in range(n)]


def test_a_pack_reserves_until_the_tenant_reaches_its_cap_and_holds_the_rest() -> None:
    """At $0 of a $10 daily cap, $1 bulk requests are reserved, oldest first, while spent and
    reserved are below the bulk share of the cap ($9): nine are packed, the rest wait with
    the cap's reason; another tenant with no cap packs everything."""
    capped, free = uuid.uuid4(), uuid.uuid4()
    pack = _charges(capped, 30, 1.0) + _charges(free, 5, 1.0)
    standing = Standing({capped: Spend(0.0, 0.0)}, {capped: SpendCap(10.0, None)})
    refused = _caps().admit(standing, pack)
    assert [c.job_id in refused for c in pack] == [False] * 9 + [True] * 21 + [False] * 5
    assert set(refused.values()) == {"spend_cap_daily"}


def test_what_is_spent_and_reserved_already_counts() -> None:
    """A tenant whose spend and open reservations are at the cap packs nothing; one just
    below packs one more request (the cap is passed by at most that one's estimate)."""
    at, below = uuid.uuid4(), uuid.uuid4()
    standing = Standing({at: Spend(9.0, 9.0), below: Spend(8.95, 8.95)},
                        {at: SpendCap(10.0, None), below: SpendCap(None, 10.0)})
    pack = _charges(at, 3, 0.5) + _charges(below, 3, 0.5)
    refused = _caps().admit(standing, pack)
    assert [refused.get(c.job_id) for c in pack] == [
        "spend_cap_daily"] * 3 + [None, "spend_cap_monthly", "spend_cap_monthly"]


def test_the_fleet_cap_counts_every_tenant_of_the_pack() -> None:
    """The fleet's cap is shared: requests of two tenants without caps of their own are
    reserved, in order, until the fleet reaches the bulk share of its cap."""
    a, b = uuid.uuid4(), uuid.uuid4()
    pack = [c for pair in zip(_charges(a, 5, 1.0), _charges(b, 5, 1.0), strict=True)
            for c in pair]
    standing = Standing({}, {}, fleet=Spend(0.0, 5.0))
    refused = _caps(SpendCap(None, 10.0)).admit(standing, pack)
    assert [c.job_id in refused for c in pack] == [False] * 4 + [True] * 6
    assert set(refused.values()) == {"fleet_spend_cap_monthly"}
