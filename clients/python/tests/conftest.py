"""Fixtures of calmq-client's test module: one test body, run with ``Client`` and with
``AsyncClient``.

tests/integration/test_client_distribution.py runs this folder in a clean virtualenv that
holds the built calmq-client wheel and pytest, and no calmq, against the running stack:
``CALMQ_API_URL`` and ``CALMQ_TEST_API_KEY`` name the API and a tenant's key. It puts a copy
of the repository's tests/support/faultproxy.py beside this file.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from calmq_client import AsyncClient, Client


class Blocking:
    """An AsyncClient called like a Client: each call awaited to its end on a loop of its
    own, each async iterator stepped one item at a time (and closed when left early). A
    test body then drives both clients alike, and the async one still does its own I/O."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self._runner = asyncio.Runner()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            result = attr(*args, **kwargs)
            if inspect.iscoroutine(result):
                return self._runner.run(result)
            if inspect.isasyncgen(result):
                return self._iterate(result)
            return result

        return call

    def _iterate(self, items: AsyncIterator[Any]) -> Iterator[Any]:
        async def step() -> Any:
            return await anext(items)

        async def close() -> None:
            await items.aclose()  # type: ignore[attr-defined]

        try:
            while True:
                try:
                    yield self._runner.run(step())
                except StopAsyncIteration:
                    return
        finally:
            self._runner.run(close())

    def close(self) -> None:
        self._runner.run(self._client.close())
        self._runner.close()


@pytest.fixture(params=["sync", "async"])
def connect(request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """Opens a client of the test's kind: ``connect(base_url=None, **options)``."""
    opened: list[Client | Blocking] = []

    def make(base_url: str | None = None, **options: Any) -> Any:
        url = base_url or os.environ["CALMQ_API_URL"]
        key = os.environ.get("CALMQ_TEST_API_KEY", "any")  # the stand-in takes any
        client = (Client(url, key, **options) if request.param == "sync"
                  else Blocking(AsyncClient(url, key, **options)))
        opened.append(client)
        return client

    yield make
    for client in opened:
        client.close()


@pytest.fixture
def api(connect: Callable[..., Any]) -> Any:
    """A client of the test's kind, straight to the API."""
    return connect()
