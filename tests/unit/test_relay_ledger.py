"""Unit tests for relay.cdc.PendingTransactions: which end LSN the CDC relay may confirm."""

from __future__ import annotations

from datetime import UTC, datetime

from calmq.relay.cdc import PendingTransactions, lsn_text

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_nothing_is_confirmable_until_every_record_is_acked() -> None:
    """A committed transaction with an unacked record is not confirmable."""
    ledger = PendingTransactions()
    txn = ledger.begin(1, T0)
    first, second = ledger.sent(txn), ledger.sent(txn)
    ledger.commit(txn, 100)
    first()
    assert ledger.confirmable() is None
    second()
    done = ledger.confirmable()
    assert done is not None
    assert (done.end_lsn, done.transactions, done.records) == (100, 1, 2)
    assert (ledger.pending, ledger.in_flight) == (0, 0)


def test_an_unacked_earlier_transaction_holds_back_later_acked_ones() -> None:
    """Confirmation never passes an earlier transaction whose records are not all acked."""
    ledger = PendingTransactions()
    early, late = ledger.begin(1, T0), ledger.begin(2, T0)
    early_ack, late_ack = ledger.sent(early), ledger.sent(late)
    ledger.commit(early, 100)
    ledger.commit(late, 200)
    late_ack()
    assert ledger.confirmable() is None
    early_ack()
    done = ledger.confirmable()
    assert done is not None
    assert (done.end_lsn, done.transactions, done.records) == (200, 2, 2)


def test_a_transaction_still_being_received_is_never_confirmed() -> None:
    """Acked records of a transaction whose Commit has not arrived confirm nothing."""
    ledger = PendingTransactions()
    txn = ledger.begin(7, T0)
    ledger.sent(txn)()
    assert ledger.confirmable() is None
    ledger.commit(txn, 300)
    done = ledger.confirmable()
    assert done is not None
    assert done.end_lsn == 300


def test_empty_committed_transaction_is_confirmable_at_once() -> None:
    """A transaction with no outbox row confirms as soon as its Commit arrives."""
    ledger = PendingTransactions()
    ledger.commit(ledger.begin(3, T0), 50)
    done = ledger.confirmable()
    assert done is not None
    assert (done.end_lsn, done.records) == (50, 0)
    assert ledger.confirmable() is None


def test_lsn_text_matches_postgres_notation() -> None:
    """LSNs print as PostgreSQL prints pg_lsn values."""
    assert lsn_text(0x16_B374D848) == "16/B374D848"
    assert lsn_text(0) == "0/0"
