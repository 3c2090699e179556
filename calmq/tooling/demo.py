"""`calmq demo` / `make demo`: the main job on the embedded defaults, start to finish.

Starts the local stack, creates a tenant, submits a handful of ``summarize`` jobs over HTTP
(one of them asks the fake model for malformed output), prints each job's journey with
timings and its artifact, and stops the stack.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from calmq.tooling.devstack import Stack

__all__ = ["run_demo"]

_TEXTS = [
    ("success", "Invoices from ACME are due in 30 days and must be paid by bank transfer."),
    ("success", "The call was about a late delivery; the customer wants a refund or a new date."),
    ("success", "Our fraud model flags orders over 5,000 EUR shipped to a new address."),
    ("success", "The 300-page report argues that queue age, not CPU, is the metric to watch."),
    ("malformed", "This one asks the fake model to answer with something that is not JSON."),
]


def _call(method: str, url: str, key: str, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={  # noqa: S310
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 - our own API
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def run_demo(data_dir: Path, *, keep: bool = False) -> int:
    import asyncio

    from calmq.data import Store

    stack = Stack(data_dir)
    if stack.running():
        stack.down(log=lambda _m: None)
    state = stack.up(log=lambda m: print(f"  {m}", flush=True))
    print(f"stack ready in {state.ready_seconds:.1f} s "
          f"(PostgreSQL {state.versions.get('postgres')}, Kafka {state.versions.get('kafka')})")
    try:
        async def tenant() -> str:
            store = Store(state.env["CALMQ_DATABASE_URL"], max_size=1)
            await store.open()
            try:
                _t, key = await store.tenants.create(f"demo-{int(time.time())}")
                return key
            finally:
                await store.close()

        key = asyncio.run(tenant())
        api = state.env["CALMQ_API_URL"]
        jobs = []
        for mode, text in _TEXTS:
            started = time.monotonic()
            status, body = _call("POST", f"{api}/v1/jobs", key,
                                 {"workflow": "summarize", "priority": "interactive",
                                  "input": {"text": text, "mode": mode}})
            if status != 202:
                print(f"submit failed: {status} {body}")
                return 1
            jobs.append((body["job_id"], mode, started))
        print(f"submitted {len(jobs)} jobs")
        failed = 0
        for job_id, mode, started in jobs:
            view = _wait_terminal(api, key, job_id)
            ok = view["status"] == ("completed" if mode == "success" else "dead_letter")
            failed += not ok
            print(_journey(view, started))
            if view["artifact"]:
                uri = view["artifact"]["uri"]
                print(f"    artifact {uri}: {Path(uri.removeprefix('file://')).read_text()}")
            if view["error"]:
                print(f"    error {view['error']['class']}/{view['error']['code']}")
        return 1 if failed else 0
    finally:
        if keep:
            print(f"stack left running under {data_dir}; `calmq dev down` stops it")
        else:
            stack.down(log=lambda _m: None)
            print("stack stopped")


def _wait_terminal(api: str, key: str, job_id: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    view: dict[str, Any] = {}
    while time.monotonic() < deadline:
        _status, view = _call("GET", f"{api}/v1/jobs/{job_id}", key)
        if view.get("status") in ("completed", "dead_letter", "cancelled"):
            return view
        time.sleep(0.05)
    raise TimeoutError(f"job {job_id} still {view.get('status')} after {timeout} s")


def _journey(view: dict[str, Any], _started: float) -> str:
    from datetime import datetime

    events = view["events"]
    t0 = datetime.fromisoformat(events[0]["at"])
    steps = " > ".join(
        f"{e['type']} (+{(datetime.fromisoformat(e['at']) - t0).total_seconds() * 1000:.0f} ms)"
        for e in events
    )
    return f"  job {view['job_id']} [{view['status']}]: {steps}"
