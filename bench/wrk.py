"""wrk as the accept scenario's load generator, when it is installed (``apt install wrk``).

The in-process aiohttp generator costs about 0.12 ms of CPU per request on the same two
cores as the API, PostgreSQL and the relay it measures; wrk (C, epoll) costs a fraction of
that, so the figure says more about calmq and less about the generator. Without wrk the
scenario falls back to the in-process generator and says so in its output.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.loadgen import LoadResult

__all__ = ["WrkResult", "available", "run", "version"]


def available() -> str | None:
    return shutil.which("wrk")


def version() -> str:
    wrk = available()
    if wrk is None:
        return ""
    out = subprocess.run([wrk, "--version"], capture_output=True, text=True, check=False)
    found = re.search(r"wrk (\S+)", out.stdout + out.stderr)
    return f"wrk {found.group(1) if found else '?'}"


@dataclass
class WrkResult(LoadResult):
    """LoadResult with wrk's own percentiles (it keeps a histogram, not every latency) and
    the CPU seconds wrk used."""

    p50_ms: float = 0.0
    p99_ms: float = 0.0
    cpu_s: float = 0.0


_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


def _ms(text: str) -> float:
    found = re.fullmatch(r"([\d.]+)(us|ms|s)", text.strip())
    if found is None:
        raise ValueError(f"unreadable wrk latency {text!r}")
    return float(found.group(1)) * _UNITS[found.group(2)]


def parse(output: str) -> dict[str, float]:
    """Requests, errors (non-2xx/3xx and socket errors), rate and p50/p99 from wrk's report."""
    figures: dict[str, float] = {}
    total = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s)", output)
    if total is None:
        raise ValueError(f"wrk printed no request count:\n{output}")
    figures["requests"] = float(total.group(1))
    figures["seconds"] = _ms(total.group(2) + total.group(3)) / 1000
    for pct in ("50", "99"):
        found = re.search(rf"^\s*{pct}(?:\.000)?%\s+(\S+)", output, re.MULTILINE)
        if found is None:
            raise ValueError(f"wrk printed no {pct}th percentile (run it with --latency)")
        figures[f"p{pct}_ms"] = _ms(found.group(1))
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    socket = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)",
                       output)
    figures["errors"] = float(non_2xx.group(1)) if non_2xx else 0.0
    if socket:
        figures["errors"] += sum(float(g) for g in socket.groups())
    return figures


def run(url: str, body: dict[str, Any], headers: dict[str, str], *, connections: int,
        seconds: float) -> WrkResult:
    """POST ``body`` from ``connections`` connections (one wrk thread) for ``seconds``."""
    wrk = available()
    if wrk is None:
        raise RuntimeError("wrk is not installed")
    lines = ['wrk.method = "POST"', f"wrk.body = {json.dumps(json.dumps(body))}",
             'wrk.headers["Content-Type"] = "application/json"']
    lines += [f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}" for k, v in headers.items()]
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "post.lua"
        script.write_text("\n".join(lines) + "\n")
        started = time.time()
        proc = subprocess.Popen(
            [wrk, "-t", "1", "-c", str(connections), "-d", f"{seconds:g}s", "--latency",
             "-s", str(script), url],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        assert proc.stdout is not None
        output = proc.stdout.read()
        # wait4, not wait: wrk's own CPU, apart from every other child of this process.
        _pid, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {output}")
    figures = parse(output)
    result = WrkResult(cpu_s=usage.ru_utime + usage.ru_stime)
    result.started_at = started
    result.elapsed_s = figures["seconds"]
    result.sent = int(figures["requests"])
    errors = int(figures["errors"])
    result.ok = result.sent - errors
    if errors:
        result.errors["non_2xx_or_socket"] = errors
    result.p50_ms = figures["p50_ms"]
    result.p99_ms = figures["p99_ms"]
    return result
