"""schemas/: every version reads the one before it (BACKWARD) and the one after it (FORWARD),
and the checker can fail."""

from __future__ import annotations

import io
import json
import shutil
import uuid
from decimal import Decimal
from pathlib import Path

import fastavro
import pytest

from calmq import events
from calmq.codec import SchemaStore, SingleObjectCodec, default_schemas_dir
from calmq.tooling.schemas_check import check_backward, check_forward


def test_shipped_schemas_are_backward_compatible() -> None:
    """Each consecutive pair of versions in schemas/ passes the BACKWARD check."""
    assert check_backward(SchemaStore()) == []


def test_checker_catches_a_field_added_without_default(tmp_path: Path) -> None:
    """A v2 that adds a required field without a default is reported."""
    root = tmp_path / "schemas"
    shutil.copytree(default_schemas_dir(), root)
    v1 = json.loads((root / "job_result" / "v1.avsc").read_text())
    v1["fields"].append({"name": "new_required", "type": "string"})
    (root / "job_result" / "v2.avsc").write_text(json.dumps(v1))
    problems = check_backward(SchemaStore(root))
    assert len(problems) == 1
    assert "job.result v2 cannot read v1" in problems[0]


def test_checker_accepts_a_field_added_with_default(tmp_path: Path) -> None:
    """A v2 that adds an optional field with a default passes."""
    root = tmp_path / "schemas"
    shutil.copytree(default_schemas_dir(), root)
    v1 = json.loads((root / "job_result" / "v1.avsc").read_text())
    v1["fields"].append({"name": "cost_usd", "type": ["null", "double"], "default": None})
    (root / "job_result" / "v2.avsc").write_text(json.dumps(v1))
    assert check_backward(SchemaStore(root)) == []


def test_shipped_schemas_are_forward_compatible() -> None:
    """Each version reads records written with the next one: old consumers keep decoding."""
    assert check_forward(SchemaStore()) == []


def test_checker_catches_an_enum_symbol_an_old_reader_does_not_know(tmp_path: Path) -> None:
    """A v3 whose enum gains a symbol breaks readers of v2 (they would fail on that record)."""
    root = tmp_path / "schemas"
    shutil.copytree(default_schemas_dir(), root)
    newest = json.loads((root / "job_result" / "v2.avsc").read_text())
    status = next(f for f in newest["fields"] if f["name"] == "status")
    status["type"]["symbols"] = ["expired", *status["type"]["symbols"]]
    (root / "job_result" / "v3.avsc").write_text(json.dumps(newest))
    assert any("job.result v2 cannot read v3" in p for p in check_forward(SchemaStore(root)))


@pytest.mark.parametrize("status", ["completed", "dead_letter"])
def test_a_consumer_on_job_result_v1_decodes_what_calmq_writes_now(status: str) -> None:
    """calmq writes job.result in the newest schema (with metadata, usage, workflow version);
    a consumer whose reader schema is v1 decodes it, and one on the newest sees the new fields."""
    job = {"id": uuid.uuid4(), "tenant_id": uuid.uuid4(), "workflow": "summarize",
           "workflow_version": 3, "step": "summarize", "attempt": 2,
           "metadata": {"order": "A-17", "shop": 4}, "input_tokens": 1200,
           "output_tokens": 80, "cost_usd": Decimal("0.0042")}
    record = events.result(job, status, error=None if status == "completed" else
                           {"code": "malformed_output", "class": "verifier", "message": "m"})
    store = SchemaStore()
    data = SingleObjectCodec(store).encode("job.result", record)
    writer = store.latest("job.result")
    assert writer.version >= 2
    [v1] = [v for v in store.versions["job.result"] if v.version == 1]
    old = fastavro.schemaless_reader(io.BytesIO(data[10:]), writer.parsed, v1.parsed)
    assert (str(old["job_id"]), old["status"], old["attempt"]) == (str(job["id"]), status, 2)
    assert set(old) == {f["name"] for f in v1.parsed["fields"]}  # v1's fields, no more
    _type, new = SingleObjectCodec(store).decode(data)
    assert json.loads(new["metadata"]) == {"order": "A-17", "shop": 4}
    assert new["workflow_version"] == 3
    assert new["usage"] == {"input_tokens": 1200, "output_tokens": 80, "cost_usd": 0.0042,
                            "lane": "online", "model": None}  # finish_attempts names it
