"""``calmq bench streaming``: time to the first token through calmq, and what streaming costs.

``size`` interactive ``draft`` jobs are submitted at once beside a bulk backlog (ten bulk
jobs per streamed one, queued before the worker starts), each followed by a client on
``GET /v1/jobs/{id}/events``. The fake provider streams 400 tokens per job, the first after
300 ms, then 50 a second (~8.3 s a call), and records its own first-token time
(``GET /admin/streams``).

Time to first token through calmq is the client's first ``output.delta`` minus the time it
sent the submit; the fake's own is its first token minus the call's arrival. Everything runs
on one machine, one clock, so the two are compared job by job: ``added`` (calmq's minus the
fake's, target ≤ 50 ms at p95) splits into ``before_call`` (submit → the call reaches the
provider: accept, relay, claim) and ``delivery`` (the provider's first token → the client),
and delivery into ``delivery_worker`` (→ the first chunk's group write begins: the worker
reading the provider's stream) and ``delivery_api`` (→ the client: commit, NOTIFY, the
API's listener, SSE, the client's read; the chunk rows' times are read twice a second
while the run lasts).

The same jobs run three times on one stack, a fresh worker each time:

- ``notify`` (calmq's transport): chunks coalesced every 50 ms, the first at once, written
  with their ``pg_notify``;
- ``not_streamed`` (the CPU baseline): the same calls as a bench-only workflow whose step
  does not stream (``bench/stream_workflows.py``), the provider answering whole after the
  same 8.3 s, the same clients following the same SSE streams (status events only);
- ``per_token`` (the alternative): ``CALMQ_OUTPUT_FLUSH_SECONDS=0``, a row and a
  notification for every token, no coalescing.

The extra CPU per streamed job on the worker and the API is a run's CPU minus the
not-streamed run's, over the streamed jobs; the bulk backlog is the same in each run.
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp

from bench import loadgen, stream_workflows
from bench.common import Log, completed, high_watermark, job_body, ratio, rounded, wait
from bench.loadgen import percentile
from bench.procs import Sampler
from bench.report import result
from bench.rig import Rig

__all__ = ["DEFAULT_SIZE", "Timing", "first_tokens", "streaming", "ttft_figures",
           "without_ttft"]

DEFAULT_SIZE = 200
TTFT_MS = 300
TOKENS_PER_SECOND = 50.0
TOKENS = 400
# The provider's whole call: the first token, then the other 399 at 50 a second.
CALL_MS = round(TTFT_MS + (TOKENS - 1) / TOKENS_PER_SECOND * 1000)
BACKLOG_PER_STREAM = 10
BULK_TOPIC = "calmq.default.bulk"
_DELTA = b"event: output.delta"
_PROBE = {"workflow": "draft", "priority": "interactive",
          "input": {"prompt": "probe", "tokens": 1, "ttft_ms": 0}}
_END = b"event: end"


@dataclass
class Timing:
    """One followed job: when its submit was sent, its first delta came (epoch seconds),
    how many deltas it got and whether its stream ended (the job final)."""

    job_id: str
    submitted: float
    first_delta: float | None = None
    deltas: int = 0
    ended: bool = False


def first_tokens(streams: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """The fake's own record (``GET /admin/streams``) per job: (arrival, first token) of
    the job's first stream that wrote a token."""
    found: dict[str, tuple[float, float]] = {}
    for s in streams:
        first = s.get("first_token_at")
        if first is None:
            continue
        job = str(s["job"])
        if job not in found or first < found[job][1]:
            found[job] = (float(s["at"]), float(first))
    return found


def _p(values: list[float], q: float) -> float:
    return rounded(percentile(values, q), 1)


def ttft_figures(timings: list[Timing], fake: dict[str, tuple[float, float]],
                 written: dict[str, float] | None = None,
                 stages: dict[str, tuple[float, float]] | None = None) -> dict[str, float]:
    """p50/p95 (ms) of the time to first token through calmq, the fake's own, and what
    calmq added (split into before the call and delivery), over the jobs both sides saw.
    With ``written`` (a job's first chunk's write, epoch seconds), delivery splits into
    the worker's leg (first token → chunk written) and the rest (→ the client). With
    ``stages`` (a job's row written and its first claim, epoch seconds), before the call
    splits into the intake (submit sent → the API's transaction), dispatch (→ claimed:
    relay, Kafka, the worker's claim) and the worker's start (→ the call reaches the
    provider)."""
    calmq, own, added, before, delivery, worker, api = [], [], [], [], [], [], []
    intake: list[float] = []
    dispatch: list[float] = []
    start: list[float] = []
    for t in timings:
        if t.first_delta is None or t.job_id not in fake:
            continue
        arrived, token = fake[t.job_id]
        calmq.append((t.first_delta - t.submitted) * 1000)
        own.append((token - arrived) * 1000)
        added.append(calmq[-1] - own[-1])
        before.append((arrived - t.submitted) * 1000)
        delivery.append((t.first_delta - token) * 1000)
        if written and t.job_id in written:
            worker.append((written[t.job_id] - token) * 1000)
            api.append((t.first_delta - written[t.job_id]) * 1000)
        if stages and t.job_id in stages:
            created, claimed = stages[t.job_id]
            intake.append((created - t.submitted) * 1000)
            dispatch.append((claimed - created) * 1000)
            start.append((arrived - claimed) * 1000)
    figs: dict[str, float] = {"ttft_jobs_measured": len(added)}
    legs = (("delivery_worker", worker), ("delivery_api", api)) if written else ()
    if stages:
        legs = (*legs, ("before_call_intake", intake), ("before_call_dispatch", dispatch),
                ("before_call_worker", start))
    for name, values in (("ttft_added", added), ("ttft_calmq", calmq), ("ttft_fake", own),
                         ("before_call", before), ("delivery", delivery), *legs):
        figs[f"{name}_p50_ms"] = _p(values, 50)
        figs[f"{name}_p95_ms"] = _p(values, 95)
    figs["ttft_added_max_ms"] = _p(added, 100)
    return figs


def _stages(rig: Rig, tenant_id: str) -> dict[str, tuple[float, float]]:
    """Each followed job's row write (the API's transaction time) and first claim."""
    rows = rig.query(
        """SELECT j.id::text, extract(epoch FROM j.created_at),
                  (SELECT extract(epoch FROM min(e.at)) FROM job_events e
                    WHERE e.job_id = j.id AND e.type = 'running')
             FROM jobs j WHERE j.tenant_id = %s""", (tenant_id,))
    return {job: (float(created), float(claimed)) for job, created, claimed in rows
            if claimed is not None}


# -- the clients --------------------------------------------------------------------------------

async def _follow(session: aiohttp.ClientSession, api: str, auth: dict[str, str],
                  body: dict[str, Any]) -> Timing:
    """Submit one job and follow its SSE stream to the end; the first delta's arrival is
    taken when its bytes are read (the rest is only counted)."""
    sent = time.time()
    async with session.post(f"{api}/v1/jobs", json=body, headers=auth) as resp:
        if resp.status != 202:
            raise RuntimeError(f"submit answered {resp.status}: {await resp.text()}")
        timing = Timing(str((await resp.json())["job_id"]), sent)
    async with session.get(f"{api}/v1/jobs/{timing.job_id}/events", headers=auth) as resp:
        if resp.status != 200:
            raise RuntimeError(f"events answered {resp.status}: {await resp.text()}")
        tail = b""
        async for data in resp.content.iter_any():
            now = time.time()
            buf = tail + data
            found = buf.count(_DELTA) - tail.count(_DELTA)
            if found and timing.first_delta is None:
                timing.first_delta = now
            timing.deltas += found
            if _END in buf:
                timing.ended = True
                break
            tail = buf[-32:]
    return timing


async def _clients(api: str, key: str, body: dict[str, Any], count: int) -> list[Timing]:
    auth = {"Authorization": f"Bearer {key}"}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        return list(await asyncio.gather(*(_follow(session, api, auth, body)
                                           for _ in range(count))))


class _FirstChunks:
    """Each job's first chunk's write time (the row's ``at``, the group write's start),
    read every half second while the run lasts: a final job's chunks are compacted away."""

    def __init__(self, rig: Rig) -> None:
        self.found: dict[str, float] = {}
        self._rig = rig
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-first-chunks",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            for job, at in self._rig.query(
                    "SELECT job_id::text, extract(epoch FROM min(at)) FROM job_output_chunks "
                    "WHERE seq = 1 GROUP BY job_id"):
                self.found.setdefault(str(job), float(at))
            if self._stop.wait(0.5):  # poll: a sampling interval, not a synchronisation
                return

    def close(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(30)
        return self.found


def _fake_streams(url: str) -> list[dict[str, Any]]:
    import json

    with urllib.request.urlopen(f"{url}/admin/streams", timeout=30) as resp:
        found: list[dict[str, Any]] = json.loads(resp.read())["streams"]
    return found


# -- one run ------------------------------------------------------------------------------------

def _warm(rig: Rig, env: dict[str, str], log: Log) -> None:
    """A few short streamed and bulk jobs through every process once, so the first run
    does not pay for first connections, topics' metadata and imports."""
    api = rig.procs["api"]
    rig.calmq("worker", env=env)
    _tenant_id, key = rig.tenant(f"bench-swarm-{uuid.uuid4().hex[:6]}")
    asyncio.run(loadgen.closed_loop(f"{api.url}/v1/jobs", job_body(),
                                    {"Authorization": f"Bearer {key}"}, total=50,
                                    concurrency=8))
    timings = asyncio.run(_clients(api.url, key, {
        **_PROBE, "input": {"prompt": "warm up", "tokens": 20, "ttft_ms": 0,
                            "tokens_per_second": 200}}, 10))
    log(f"  warm-up: {sum(t.ended for t in timings)} of 10 streams ended")
    rig.stop("worker")


def _run(rig: Rig, sampler: Sampler, log: Log, name: str, *, workflow: str,
         job_input: dict[str, Any], worker_env: dict[str, str], streams: int,
         backlog: int) -> dict[str, Any]:
    """One run: the bulk backlog queued while no worker runs, then a fresh worker and
    ``streams`` followed jobs at once. CPU from the worker's start until the backlog and
    the followed jobs are done (the worker's start-up is in every run alike)."""
    api, fp = rig.procs["api"], rig.procs["fake-provider"]
    bulk_id, bulk_key = rig.tenant(f"bench-sbulk-{uuid.uuid4().hex[:6]}")
    tenant_id, key = rig.tenant(f"bench-stream-{uuid.uuid4().hex[:6]}")
    _probe_id, probe_key = rig.tenant(f"bench-sprobe-{uuid.uuid4().hex[:6]}")
    before = high_watermark(rig.bootstrap, BULK_TOPIC)
    load = asyncio.run(loadgen.closed_loop(f"{api.url}/v1/jobs", job_body(),
                                           {"Authorization": f"Bearer {bulk_key}"},
                                           total=backlog, concurrency=32))
    wait(lambda: high_watermark(rig.bootstrap, BULK_TOPIC) - before, load.ok,
         60 + backlog / 100, f"{name}: bulk backlog published", log)
    log(f"  {name}: {streams} followed {workflow} jobs beside a backlog of {load.ok} bulk "
        "jobs")
    phase = sampler.phase({**rig.pids("api", "relay", "fake-provider"), **rig.infra_pids()})
    worker = rig.calmq("worker", env=worker_env)
    phase.pids["worker"] = worker.pid  # from its start: cpu_start is 0
    # One short job through the new worker first: its consumer has joined the group and
    # claims, so the followed jobs measure a running worker, not its start-up.
    asyncio.run(_clients(api.url, probe_key, _PROBE, 1))
    left = rig.query("SELECT count(*) FROM jobs WHERE tenant_id = %s AND status <> "
                     "'completed'", (bulk_id,))[0][0]
    started = time.monotonic()
    chunks = _FirstChunks(rig)
    timings = asyncio.run(_clients(api.url, key, {"workflow": workflow, "input": job_input,
                                                  "priority": "interactive"}, streams))
    followed_s = time.monotonic() - started
    written = chunks.close()
    bulk_left = rig.query("SELECT count(*) FROM jobs WHERE tenant_id = %s AND status <> "
                          "'completed'", (bulk_id,))[0][0]
    wait(lambda: completed(rig, bulk_id), load.ok, 120 + backlog / 20, f"{name}: bulk", log)
    sampler.end(phase)
    done = completed(rig, tenant_id)
    rig.stop("worker")
    n = max(done, 1)
    figs: dict[str, Any] = {
        **ttft_figures(timings, first_tokens(_fake_streams(fp.url)), written,
                       _stages(rig, tenant_id)),
        "streamed_jobs_completed": done, "bulk_jobs_completed": completed(rig, bulk_id),
        "bulk_left_when_streams_began": int(left),
        "bulk_left_when_streams_ended": int(bulk_left),
        "streams_ended": sum(t.ended for t in timings),
        "deltas_per_job": rounded(sum(t.deltas for t in timings) / max(len(timings), 1), 1),
        "followed_s": rounded(followed_s, 1), "phase_s": rounded(phase.wall_s, 1)}
    for proc in ("worker", "api", "postgres", "relay"):
        figs[f"{proc}_cpu_s"] = rounded(phase.cpu.get(proc, 0.0), 3)
        figs[f"{proc}_cpu_ms_per_streamed_job"] = rounded(
            phase.cpu.get(proc, 0.0) * 1000 / n, 2)
    return figs


def _extra(run: dict[str, Any], base: dict[str, Any], jobs: int) -> dict[str, float]:
    """CPU a run spent beyond the not-streamed run, per streamed job (ms), and as a ratio."""
    figs: dict[str, float] = {}
    for proc in ("worker", "api", "postgres"):
        figs[f"{proc}_extra_cpu_ms_per_streamed_job"] = rounded(
            (run[f"{proc}_cpu_s"] - base[f"{proc}_cpu_s"]) * 1000 / max(jobs, 1), 2)
    return figs


def without_ttft(figs: dict[str, Any]) -> dict[str, Any]:
    """A run without deltas (the not-streamed baseline): no time-to-first-token figures,
    rather than zeros that read as a measurement."""
    return {k: v for k, v in figs.items()
            if not k.startswith(("ttft_", "before_call_", "delivery_"))}


def streaming(size: int, log: Log, sampler: Sampler, **_: Any) -> dict[str, Any]:
    backlog = size * BACKLOG_PER_STREAM
    streamed = {"prompt": "Reply to the customer about the delayed parcel and its refund.",
                "tokens": TOKENS, "max_tokens": 1024}
    # The same call, answered whole after the time the streamed one takes.
    whole = {**streamed, "delay_ms": CALL_MS}
    with Rig(log=log) as rig:
        fp = rig.calmq("fake-provider", "--stream-ttft-ms", str(TTFT_MS),
                       "--stream-tokens-per-second", str(TOKENS_PER_SECOND))
        env = {"CALMQ_FAKE_PROVIDER_URL": fp.url,
               "CALMQ_WORKFLOW_MODULES": stream_workflows.__name__,
               # every follower is one tenant's stream in one API process
               "CALMQ_API_STREAMS_PER_TENANT": "0",
               # The worker sized for the burst: bulk calls keep their slots for the ~8 s
               # the model takes, so interactive calls beyond the reserve (an eighth of the
               # window by default, 36) would wait seconds for them to end.
               "CALMQ_INTERACTIVE_RESERVE": str(size)}
        rig.calmq("api", env=env)
        rig.calmq("relay", env=env)
        _warm(rig, env, log)
        runs = {}
        for name, workflow, job_input, worker_env in (
                ("notify", "draft", streamed, env),
                ("not_streamed", stream_workflows.NAME, whole, env),
                ("per_token", "draft", streamed, {**env, "CALMQ_OUTPUT_FLUSH_SECONDS": "0"})):
            runs[name] = _run(rig, sampler, log, name, workflow=workflow, job_input=job_input,
                              worker_env=worker_env, streams=size, backlog=backlog)
            log(f"  {name}: {runs[name]}")
        versions = rig.versions
    notify, alt = runs["notify"], runs["per_token"]
    base = without_ttft(runs["not_streamed"])
    figures = {**notify, **_extra(notify, base, size), "streams": size,
               "interactive_reserve": size, "bulk_backlog": backlog, "fake_ttft_ms": TTFT_MS,
               "fake_tokens_per_second": TOKENS_PER_SECOND, "fake_tokens": TOKENS,
               "target_ttft_added_p95_ms": 50}
    per_token = {**alt, **_extra(alt, base, size)}
    ratios = {
        "ttft_added_p95_ms_vs_per_token": ratio(notify["ttft_added_p95_ms"],
                                                alt["ttft_added_p95_ms"]),
        "delivery_p95_ms_vs_per_token": ratio(notify["delivery_p95_ms"],
                                              alt["delivery_p95_ms"]),
        "worker_cpu_s_vs_not_streamed": ratio(notify["worker_cpu_s"], base["worker_cpu_s"]),
        "api_cpu_s_vs_not_streamed": ratio(notify["api_cpu_s"], base["api_cpu_s"]),
        "worker_cpu_s_vs_per_token": ratio(notify["worker_cpu_s"], alt["worker_cpu_s"]),
        "api_cpu_s_vs_per_token": ratio(notify["api_cpu_s"], alt["api_cpu_s"]),
        "postgres_cpu_s_vs_per_token": ratio(notify["postgres_cpu_s"], alt["postgres_cpu_s"]),
    }
    return result("streaming", size, figures, {"not_streamed": base, "per_token": per_token},
                  ratios, versions, extra_versions={"load_generator": loadgen.NAME,
                                                     "transport": "notify"})
