"""calmq-client against the real stack: every test runs with ``Client`` and with
``AsyncClient`` (conftest's ``connect``), from the built wheel in a virtualenv without calmq.

Submit and wait, get and list, cancel, download, a streamed job's text followed through a
TCP proxy that cuts the connection mid-stream, and, against a small stand-in server, the
retry rules: 429 and 503 are retried no sooner than their Retry-After, a submit carries an
Idempotency-Key only when given one, and a submit whose answer is lost is repeated only
with one.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from calmq_client import ApiError, Backoff, OutcomeUnknown, RetryPolicy
from faultproxy import FaultProxy

FINAL = ("completed", "dead_letter", "cancelled")


def _final(api: Any, job_id: str) -> dict[str, Any]:
    """The job's view once its event stream has ended (the job is final)."""
    types = [e["type"] for e in api.events(job_id)]
    job: dict[str, Any] = api.get(job_id)
    assert job["status"] in FINAL, (job, types)
    return job


def test_submit_with_wait_answers_a_fast_job_with_its_result(api: Any) -> None:
    """submit(..., wait=30) of a fast job returns its final view with the result."""
    answer = api.submit("draft", {"prompt": "answer me now", "tokens": 3}, wait=30)
    assert answer["status"] == "completed"
    assert answer["result"] == {"text": "answer me now"}


def test_get_and_list_filter_and_page_the_tenants_jobs(api: Any) -> None:
    """list filters by workflow and status and pages with next_cursor; get reads one job."""
    draft = api.submit("draft", {"prompt": "list me", "tokens": 3}, wait=30)["job_id"]
    summary = api.submit("summarize", {"text": "list me too", "mode": "success"})["job_id"]
    assert _final(api, summary)["workflow"] == "summarize"
    drafts = [j["job_id"] for j in
              api.list(workflow="draft", status=["completed"], limit=200)["jobs"]]
    assert draft in drafts
    assert summary not in drafts
    first = api.list(limit=1)
    assert len(first["jobs"]) == 1
    assert first["next_cursor"]
    second = api.list(limit=1, cursor=first["next_cursor"])
    assert second["jobs"][0]["job_id"] != first["jobs"][0]["job_id"]
    with pytest.raises(ApiError) as missing:
        api.get(str(uuid.uuid4()))
    assert (missing.value.status, missing.value.code) == (404, "not_found")


def test_rerun_makes_a_new_job_linked_to_the_original(api: Any) -> None:
    """rerun answers 202 with a new job naming the original, which completes and shows
    rerun_of; an unknown step is ApiError 422 unknown_step."""
    job_id = api.submit("summarize", {"text": "rerun me", "mode": "success"})["job_id"]
    assert _final(api, job_id)["status"] == "completed"
    answer = api.rerun(job_id, "summarize", {"text": "rerun me again", "mode": "success"})
    assert answer["rerun_of"] == job_id
    assert answer["job_id"] != job_id
    again = _final(api, answer["job_id"])
    assert (again["status"], again["rerun_of"]) == ("completed", job_id)
    with pytest.raises(ApiError) as refused:
        api.rerun(job_id, "nope")
    assert (refused.value.status, refused.value.code) == (422, "unknown_step")
    # Keyed: the same key and arguments answer the same new job; other arguments a 409.
    key = f"rerun-{uuid.uuid4()}"
    keyed = api.rerun(job_id, "summarize", idempotency_key=key)
    assert keyed["job_id"] != answer["job_id"]
    assert api.rerun(job_id, "summarize", idempotency_key=key)["job_id"] == keyed["job_id"]
    with pytest.raises(ApiError) as reused:
        api.rerun(job_id, "summarize", priority="bulk", idempotency_key=key)
    assert (reused.value.status, reused.value.code) == (409, "idempotency_key_reused")


def test_cancel_ends_a_running_job(api: Any) -> None:
    """cancel answers cancelled, the event stream ends with it, a second cancel is 409."""
    job_id = api.submit("summarize", {"text": "cancel me", "mode": "slow"})["job_id"]
    assert api.cancel(job_id)["status"] == "cancelled"
    assert _final(api, job_id)["status"] == "cancelled"
    with pytest.raises(ApiError) as again:
        api.cancel(job_id)
    assert (again.value.status, again.value.code) == (409, "job_terminal")


def test_download_writes_the_artifact_whole(api: Any, tmp_path: Path) -> None:
    """download writes the artifact's bytes, the same as artifact() yields and the job's
    sha256 and size say."""
    job_id = api.submit("summarize", {"text": "download me", "mode": "success"})["job_id"]
    artifact = _final(api, job_id)["artifact"]
    path = api.download(job_id, tmp_path / "result.json")
    data = path.read_bytes()
    assert hashlib.sha256(data).hexdigest() == artifact["sha256"]
    assert len(data) == artifact["size"]
    assert b"".join(api.artifact(job_id)) == data
    assert "summary" in json.loads(data)


def test_streamed_text_resumes_across_a_cut_connection(
        connect: Callable[..., Any], tmp_path: Path) -> None:
    """A draft's text followed with output() through a proxy cut after the third piece:
    the client reconnects with Last-Event-ID, and the pieces, none lost or repeated, make
    exactly the stored artifact."""
    api_url = urlsplit(os.environ["CALMQ_API_URL"])
    with FaultProxy(api_url.hostname or "127.0.0.1", api_url.port or 80) as proxy:
        api = connect(f"http://127.0.0.1:{proxy.port}",
                      retry=RetryPolicy(attempts=20, backoff=Backoff(initial=0.05, maximum=0.5)))
        job_id = api.submit("draft", {"prompt": "keep every word of this answer",
                                      "tokens": 120, "tokens_per_second": 40},
                            priority="interactive")["job_id"]
        pieces = []
        cut_at = None
        for piece in api.output(job_id):
            assert not piece.reset
            pieces.append(piece)
            if len(pieces) == 3:
                cut_at = api.get(job_id)["status"]
                proxy.cut()  # every open connection dropped, as an API replica going away
                proxy.restore()
        job = api.get(job_id)
        result = json.loads(api.download(job_id, tmp_path / "draft.json").read_bytes())
    assert cut_at not in FINAL  # the cut was mid-stream
    assert len(pieces) > 3  # and the stream went on after it
    assert [p.offset for p in pieces] == [sum(len(p.text) for p in pieces[:n])
                                          for n in range(len(pieces))]
    assert job["status"] == "completed"
    assert "".join(p.text for p in pieces) == result["text"]


def test_submit_many_answers_each_item_in_order_across_chunks(api: Any) -> None:
    """submit_many sends 5 items in chunks of 2 through POST /v1/jobs/bulk and returns one
    result per item in input order (a bad item refused alone); list(metadata=...) finds
    exactly the accepted jobs by their tag."""
    tag = uuid.uuid4().hex
    items: list[dict[str, Any]] = [
        {"workflow": "summarize", "input": {"text": f"bulk {n}", "mode": "success"},
         "metadata": {"batch": tag}} for n in range(5)]
    items[3] = {"workflow": "summarize", "input": {"wrong": True}, "metadata": {"batch": tag}}
    results = api.submit_many(items, chunk_size=2)
    assert [r["index"] for r in results] == [0, 1, 2, 3, 4]
    assert [r["status"] for r in results] == ["accepted"] * 3 + ["refused", "accepted"]
    assert results[3]["problem"]["code"] == "invalid_input"
    listed = api.list(metadata={"batch": tag}, limit=200)["jobs"]
    assert sorted(j["job_id"] for j in listed) == sorted(
        r["job_id"] for r in results if r["status"] == "accepted")


# -- the retry rules, against a stand-in server -------------------------------------------------

class StandIn:
    """An HTTP server that answers each request with the next of ``answers`` (status, headers,
    body), or drops the connection unanswered for ``None``, and records what it was sent."""

    def __init__(self, answers: list[tuple[int, dict[str, str], dict[str, Any]] | None]) -> None:
        self.answers = answers
        self.seen: list[tuple[float, dict[str, str]]] = []
        self.bodies: list[bytes] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                outer.bodies.append(self.rfile.read(int(self.headers.get("Content-Length")
                                                        or 0)))
                outer.seen.append((time.monotonic(), dict(self.headers)))
                answer = outer.answers.pop(0)
                if answer is None:
                    self.close_connection = True
                    self.connection.close()  # sent, never answered: the outcome is unknown
                    return
                status, headers, body = answer
                raw = json.dumps(body).encode()
                self.send_response(status)
                for name, value in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stand_in() -> Iterator[Callable[..., StandIn]]:
    started: list[StandIn] = []

    def start(*answers: tuple[int, dict[str, str], dict[str, Any]] | None) -> StandIn:
        server = StandIn(list(answers))
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


_ACCEPTED = (202, {}, {"job_id": "00000000-0000-4000-8000-000000000001", "status": "queued",
                       "status_url": "/v1/jobs/00000000-0000-4000-8000-000000000001"})


@pytest.mark.parametrize(("status", "code"), [(429, "rate_limited"),
                                              (503, "database_unavailable")])
def test_a_submit_refused_with_retry_after_is_sent_again_no_sooner(
        connect: Callable[..., Any], stand_in: Callable[..., StandIn], status: int,
        code: str) -> None:
    """429 and 503 with Retry-After: 1 are retried after at least a second (the backoff
    alone would pause 10 ms), and a submit carries no Idempotency-Key unless given one."""
    server = stand_in((status, {"Retry-After": "1"}, {"code": code, "detail": "later"}),
                      _ACCEPTED)
    api = connect(server.url, retry=RetryPolicy(backoff=Backoff(initial=0.01, maximum=0.01)))
    assert api.submit("summarize", {"text": "t"})["status"] == "queued"
    (first, sent), (second, again) = server.seen
    assert second - first >= 1.0
    assert "idempotency-key" not in {k.lower() for k in (*sent, *again)}


def test_a_submit_whose_answer_is_lost_is_repeated_only_with_a_key(
        connect: Callable[..., Any], stand_in: Callable[..., StandIn]) -> None:
    """A dropped connection after the submit was sent raises OutcomeUnknown without a key;
    with idempotency_key the submit is sent again under the same key."""
    policy = RetryPolicy(backoff=Backoff(initial=0.01, maximum=0.01))
    server = stand_in(None, _ACCEPTED)
    with pytest.raises(OutcomeUnknown):
        connect(server.url, retry=policy).submit("summarize", {"text": "t"})
    assert len(server.seen) == 1
    server = stand_in(None, _ACCEPTED)
    answer = connect(server.url, retry=policy).submit("summarize", {"text": "t"},
                                                      idempotency_key="order-1234")
    assert answer["status"] == "queued"
    assert [h.get("Idempotency-Key") for _t, h in server.seen] == ["order-1234"] * 2


def test_a_bulk_chunk_whose_answer_is_lost_is_sent_again_with_the_same_keys(
        connect: Callable[..., Any], stand_in: Callable[..., StandIn]) -> None:
    """submit_many gives each item without a key one of its own, so a chunk whose answer
    was lost is sent again with the same keys (the API answers it duplicate, never twice);
    with idempotent=False it sends no keys and a lost answer raises OutcomeUnknown."""
    policy = RetryPolicy(backoff=Backoff(initial=0.01, maximum=0.01))
    done = (200, {}, {"results": [{"index": 0, "status": "accepted", "job_id": "j0"},
                                  {"index": 1, "status": "duplicate", "job_id": "j1"}],
                      "accepted": 1, "duplicate": 1, "refused": 0})
    items = [{"workflow": "summarize", "input": {"text": "a"}},
             {"workflow": "summarize", "input": {"text": "b"}, "idempotency_key": "mine-1"}]
    server = stand_in(None, done)
    results = connect(server.url, retry=policy).submit_many(items)
    assert [r["status"] for r in results] == ["accepted", "duplicate"]
    first, second = (json.loads(b)["jobs"] for b in server.bodies)
    assert first == second
    assert first[1]["idempotency_key"] == "mine-1"
    assert first[0]["idempotency_key"]
    server = stand_in(None, done)
    with pytest.raises(OutcomeUnknown):
        connect(server.url, retry=policy).submit_many(items[:1], idempotent=False)
    assert "idempotency_key" not in json.loads(server.bodies[0])["jobs"][0]
