"""schemas/: every version reads the one before it (BACKWARD), and the checker can fail."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from calmq.codec import SchemaStore, default_schemas_dir
from calmq.tooling.schemas_check import check_backward


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
