"""The library for upstream services: ``enqueue`` in the caller's own transaction, and the
HTTP client.

* ``enqueue(conn, ...)`` / ``enqueue_async(conn, ...)`` write the job, its first history
  event and its outbox row on the CALLER's psycopg connection, inside the caller's open
  transaction: the business write and the job commit or roll back together (the outbox
  pattern). Nothing is committed here; the relay sees the job when the caller commits.
  It needs calmq's data layer, so it lives here and not in calmq-client.
* The HTTP client is the calmq-client distribution's (package ``calmq_client``: a sync
  ``Client`` and an ``AsyncClient``), which calmq depends on rather than holding a copy.
  ``Client`` here stays what it was before calmq-client, the asyncio client, for the code
  written against this module; ``ApiError`` and ``RetryPolicy`` are calmq_client's.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Mapping
from typing import Any

import psycopg
from calmq_client import ApiError, AsyncClient, RetryPolicy

from calmq.data.jobs import NewJob, insert_job, insert_job_sync
from calmq.errors import ContractError
from calmq.jobs import Priority
from calmq.lanes import choose_lane
from calmq.limits import MAX_METADATA_BYTES, check_concurrency_key, check_metadata
from calmq.producers.intake import prepare
from calmq.storable import non_finite
from calmq.workflows import Workflow, find_workflow, load_workflows

__all__ = ["ApiError", "AsyncClient", "Client", "RetryPolicy", "enqueue", "enqueue_async",
           "registered_workflows"]


def registered_workflows() -> dict[str, Workflow]:
    """The registry the API and the workers load: the built-in workflows, the
    ``calmq.workflows`` entry points and the modules of the workflow_modules setting
    (``CALMQ_WORKFLOW_MODULES``), loaded once per value of that setting."""
    return _registry(os.environ.get("CALMQ_WORKFLOW_MODULES", ""))


@functools.cache
def _registry(modules: str) -> dict[str, Workflow]:
    # Settings are read as the API reads them (a settings object costs tens of
    # milliseconds, the entry points more): once, not in every caller's transaction.
    from calmq.settings import Settings

    return load_workflows(Settings(workflow_modules=modules))


def _prepared(  # noqa: PLR0917 - private, called with every field of the public two
    tenant_id: uuid.UUID | str, workflow: str, input: dict[str, Any] | None,
    input_ref: str | None, priority: str, deadline_seconds: int | None,
    callback_url: str | None, metadata: Mapping[str, Any] | None,
    workflows: Mapping[str, Workflow] | None, lane: str | None = None,
    max_metadata_bytes: int = MAX_METADATA_BYTES, concurrency_key: str | None = None,
) -> NewJob:
    if (input is None) == (input_ref is None):
        raise ContractError("pass exactly one of input and input_ref", code="invalid_body",
                            status=422)
    if priority not in tuple(Priority):
        raise ContractError("priority is interactive or bulk", code="invalid_body", status=422)
    # The API's limit on metadata holds for a job written directly too: its events carry it.
    check_metadata(metadata, max_metadata_bytes)
    check_concurrency_key(concurrency_key)
    # jsonb refuses infinity and NaN: found here, not as an error that aborts the caller's
    # own transaction.
    for name, value in (("metadata", metadata), ("input", input)):
        found = non_finite(value, name)
        if found is not None:
            raise ContractError(f"{found} is a number that is not finite",
                                code="non_finite_number")
    wf = find_workflow(workflow, dict(workflows) if workflows is not None
                       else registered_workflows())
    chosen = choose_lane(lane, priority, deadline_seconds or wf.deadline_seconds,
                         bulk_lane=wf.bulk_lane)
    data = wf.validate_input(input) if input is not None else None
    if input_ref is not None:
        # The object's type and size are checked by the API only (this client writes the
        # row directly and reads no store); the worker reads it bounded by the workflow's
        # limit all the same.
        wf.accepts_reference()
    return prepare(wf, uuid.UUID(str(tenant_id)), input=data, input_ref=input_ref,
                   priority=priority, deadline_seconds=deadline_seconds,
                   callback_url=callback_url, metadata=metadata, lane=chosen,
                   concurrency_key=concurrency_key)


def enqueue(
    conn: psycopg.Connection[Any],
    *,
    tenant_id: uuid.UUID | str,
    workflow: str,
    input: dict[str, Any] | None = None,
    input_ref: str | None = None,
    priority: str = "bulk",
    deadline_seconds: int | None = None,
    callback_url: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    workflows: Mapping[str, Workflow] | None = None,
    lane: str | None = None,
    max_metadata_bytes: int = MAX_METADATA_BYTES,
    concurrency_key: str | None = None,
) -> uuid.UUID:
    """Insert a job in the caller's transaction on ``conn``; returns its id. Does not commit.

    ``workflow`` is any workflow the API knows by that name (``registered_workflows()``:
    the built-ins, the entry points, CALMQ_WORKFLOW_MODULES); ``workflows`` replaces that
    registry (``load_workflows(settings)`` for settings of your own).
    The input is validated exactly as the API validates it (ContractError on bad input),
    and ``metadata`` is held to ``max_metadata_bytes`` as the job's events carry it (the
    API's setting max_metadata_bytes; ContractError ``metadata_too_large``).
    ``callback_url`` is not checked for private addresses here: the caller is inside the
    trust boundary; the webhook dispatcher still refuses them unless allowed.
    """
    job = _prepared(tenant_id, workflow, input, input_ref, priority, deadline_seconds,
                    callback_url, metadata, workflows, lane, max_metadata_bytes,
                    concurrency_key)
    insert_job_sync(conn, job)
    return job.id


async def enqueue_async(
    conn: psycopg.AsyncConnection[Any],
    *,
    tenant_id: uuid.UUID | str,
    workflow: str,
    input: dict[str, Any] | None = None,
    input_ref: str | None = None,
    priority: str = "bulk",
    deadline_seconds: int | None = None,
    callback_url: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    workflows: Mapping[str, Workflow] | None = None,
    lane: str | None = None,
    max_metadata_bytes: int = MAX_METADATA_BYTES,
    concurrency_key: str | None = None,
) -> uuid.UUID:
    """``enqueue`` for an async psycopg connection."""
    job = _prepared(tenant_id, workflow, input, input_ref, priority, deadline_seconds,
                    callback_url, metadata, workflows, lane, max_metadata_bytes,
                    concurrency_key)
    await insert_job(conn, job)
    return job.id


class Client(AsyncClient):
    """calmq_client.AsyncClient under the name this module gave it before calmq-client, with
    its old method names (``job``, ``list_jobs``). New code imports ``Client`` (sync) or
    ``AsyncClient`` from calmq_client."""

    async def job(self, job_id: str) -> dict[str, Any]:
        return await self.get(job_id)

    async def list_jobs(self, **filters: Any) -> dict[str, Any]:
        return await self.list(**filters)
