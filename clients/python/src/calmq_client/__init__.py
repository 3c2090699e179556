"""calmq-client: submit calmq jobs and follow them, from sync or asyncio code.

``Client`` and ``AsyncClient`` are one API (the second's calls are awaited, its iterators
are async): ``submit`` (with ``wait=``), ``submit_file``, ``get``, ``list``, ``cancel``,
``delete``, ``events`` and ``output`` (iterators that resume across a dropped connection
with ``Last-Event-ID``), ``artifact`` and ``download``. Failures a retry may cure are
retried with growing, jittered pauses, never sooner than the API's ``Retry-After``
(``RetryPolicy``). It depends on httpx2 alone: nothing of the calmq server.
"""

from calmq_client._async_client import AsyncClient
from calmq_client._client import Client
from calmq_client._errors import ApiError, ClientError, ConnectionFailed, OutcomeUnknown
from calmq_client._events import Delta
from calmq_client._retrying import Backoff, RetryPolicy
from calmq_client._version import __version__

__all__ = [
    "ApiError",
    "AsyncClient",
    "Backoff",
    "Client",
    "ClientError",
    "ConnectionFailed",
    "Delta",
    "OutcomeUnknown",
    "RetryPolicy",
    "__version__",
]
