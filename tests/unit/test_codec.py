"""The Avro codec: single-object and Confluent wire formats round-trip; bad bytes are errors."""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from calmq.codec import RegistryCodec, SingleObjectCodec
from calmq.errors import ContractError, InfrastructureError


def _requested() -> dict:
    return {
        "event_id": str(uuid.uuid4()),
        "job_id": str(uuid.uuid4()),
        "tenant_id": str(uuid.uuid4()),
        "workflow": "summarize",
        "workflow_version": 1,
        "step": "summarize",
        "attempt": 0,
        "priority": "bulk",
        "pool": "default",
        "input_ref": None,
        "deadline_at": None,
        "created_at": int(time.time() * 1000),
        "trace_parent": None,
    }


def test_single_object_round_trip() -> None:
    """Single-object encoding starts C3 01 + fingerprint and decodes to the same record."""
    codec = SingleObjectCodec()
    record = _requested()
    data = codec.encode("job.requested", record)
    assert data[:2] == b"\xc3\x01"
    event_type, decoded = codec.decode(data)
    assert event_type == "job.requested"
    assert str(decoded["job_id"]) == record["job_id"]
    assert decoded["priority"] == "bulk"


def test_registry_round_trip_uses_confluent_wire_format() -> None:
    """The registry codec writes magic byte 0 and a 4-byte schema id, then decodes."""
    codec = RegistryCodec("mock://unit")
    codec.register_all()  # a deployment step; encode only looks the id up
    data = codec.encode("job.requested", _requested())
    assert data[0] == 0
    assert int.from_bytes(data[1:5], "big") > 0
    assert codec.decode(data)[0] == "job.requested"


def test_writing_an_unregistered_schema_names_the_deployment_step() -> None:
    """A service never registers schemas itself: writing before `calmq schemas register`
    fails with schema_not_registered; once the deployment registered them, a service's codec
    looks the id up and writes it."""
    registry = SchemaRegistryClient.new_client({"url": "mock://unregistered"})
    service = RegistryCodec("", client=registry)
    with pytest.raises(InfrastructureError) as info:
        service.encode("job.requested", _requested())
    assert info.value.code == "schema_not_registered"
    assert "calmq schemas register" in info.value.message
    ids = RegistryCodec("", client=registry).register_all()  # the deployment step
    data = service.encode("job.requested", _requested())
    assert int.from_bytes(data[1:5], "big") == ids["job.requested"]


def test_record_that_does_not_fit_is_schema_mismatch() -> None:
    """A payload missing a required field is a ContractError with code schema_mismatch."""
    record = _requested()
    del record["workflow"]
    with pytest.raises(ContractError) as info:
        SingleObjectCodec().encode("job.requested", record)
    assert info.value.code == "schema_mismatch"


@pytest.mark.parametrize(
    "data", [b"", b"\xc3\x01short", b"garbage bytes here", b"\xc3\x01" + b"\x00" * 12]
)
def test_undecodable_bytes_are_contract_errors(data: bytes) -> None:
    """Bytes that are not a known schema's encoding raise ContractError, never crash."""
    with pytest.raises(ContractError) as info:
        SingleObjectCodec().decode(data)
    assert info.value.code in ("undecodable", "unknown_schema")


def test_unknown_event_type_is_named() -> None:
    """Encoding an event type with no schema names the known ones."""
    with pytest.raises(ContractError, match=r"job\.requested"):
        SingleObjectCodec().encode("job.unknown", {})


class _FailingRegistry:
    """A registry client (the methods RegistryCodec calls) whose lookups fail as given."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def get_schema(self, schema_id: int) -> object:
        raise self.error


@pytest.mark.parametrize(("error", "expected"), [
    (SchemaRegistryError(404, 40403, "Schema not found"), ContractError),
    (SchemaRegistryError(503, 50003, "unavailable"), InfrastructureError),
    (ConnectionError("connection refused"), InfrastructureError),
])
def test_a_registry_that_is_away_is_not_a_bad_message(error: Exception,
                                                      expected: type[Exception]) -> None:
    """Only "no such schema" makes a message unreadable (poison); a 5xx or a refused
    connection is the registry's outage (retried by the worker, never acknowledged)."""
    codec = RegistryCodec("", client=_FailingRegistry(error))  # type: ignore[arg-type]
    data = b"\x00" + (7).to_bytes(4, "big") + b"\x02"
    assert not codec.knows(data)
    with pytest.raises(expected) as info:
        codec.decode(data)
    assert type(info.value) is expected
def test_connector_json_decodes_like_the_relays_avro() -> None:
    """The Debezium connector's JSON value (type in the eventType header) reads as the same
    record as the relay's Avro; a payload that does not fit the schema is a contract error."""
    import json

    from calmq.codec import decode_message

    codec = SingleObjectCodec()
    record = _requested()
    avro = decode_message(codec, codec.encode("job.requested", record), "job.requested")
    assert decode_message(codec, json.dumps(record).encode(), "job.requested") == avro
    with pytest.raises(ContractError):
        decode_message(codec, json.dumps({**record, "attempt": "x"}).encode(), "job.requested")
    with pytest.raises(ContractError):
        decode_message(codec, json.dumps(record).encode(), None)
