"""The benchmark machinery: result shape, percentiles, the load generator, process costs,
the BENCHMARKS.md refresh and the `calmq bench` exit codes. No speed is asserted here."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from aiohttp import web

from bench import loadgen, report
from bench.procs import Sampler, cpu_seconds
from bench.run_all import BEGIN, END, refresh_benchmarks_md
from bench.skip_locked import QUERIES
from calmq.cli import main


def test_percentile_is_nearest_rank() -> None:
    """p50 and p99 of 1..100 are 50 and 99; an empty list gives 0."""
    values = [float(v) for v in range(100, 0, -1)]
    assert loadgen.percentile(values, 50) == 50.0
    assert loadgen.percentile(values, 99) == 99.0
    assert loadgen.percentile([], 99) == 0.0


def test_result_has_the_contract_shape() -> None:
    """A result carries exactly the seven keys every scenario reports."""
    res = report.result("e2e", 10, {"jobs_per_s": 1.0}, {"skip_locked": {"jobs_per_s": 2.0}},
                        {"jobs_per_s_vs_skip_locked": 0.5}, {"kafka": "4.1.1"})
    assert set(res) == {"scenario", "size", "figures", "baselines", "ratios", "machine",
                        "versions"}
    assert res["versions"]["kafka"] == "4.1.1"
    assert res["machine"]["cpus"] == os.cpu_count()


async def test_closed_loop_counts_answers_and_errors() -> None:
    """The load generator sends exactly `total` requests and sorts 202s from other statuses."""
    seen = 0

    async def handler(_request: web.Request) -> web.Response:
        nonlocal seen
        seen += 1
        return web.json_response({}, status=202 if seen % 4 else 500)

    app = web.Application()
    app.router.add_post("/jobs", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        res = await loadgen.closed_loop(f"http://127.0.0.1:{port}/jobs", {"a": 1}, {},
                                        total=40, concurrency=4)
    finally:
        await runner.cleanup()
    assert res.sent == 40
    assert res.ok == 30
    assert res.errors == {"500": 10}
    assert len(res.latencies_ms) == 30


def test_phase_charges_cpu_and_memory_of_a_process() -> None:
    """A phase over this process records its CPU use and a non-zero peak RSS."""
    sampler = Sampler(interval=0.01)
    phase = sampler.phase({"me": os.getpid()})
    before = cpu_seconds(os.getpid())
    x = 0
    while cpu_seconds(os.getpid()) - before < 0.05:
        x += sum(range(1000))
    sampler.end(phase)
    sampler.close()
    assert phase.cpu["me"] >= 0.05
    assert phase.peak_rss_mb["me"] > 1


def test_refresh_replaces_only_the_marked_block(tmp_path: Path) -> None:
    """The table goes between the markers; the prose around them is kept."""
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(f"# Benchmarks\n\nintro\n\n{BEGIN}\nold\n{END}\n\n## How to read\n")
    res = report.result("slow", 5, {"jobs_per_s": 450.0, "peak_rss_mb": 90.0,
                                    "cpu_s_per_1000_jobs": 2.0},
                        {"serial": {"jobs_per_s": 0.5}}, {"jobs_per_s_vs_serial": 900.0})
    refresh_benchmarks_md({"date": "2026-01-01", "total_seconds": 1.0,
                           "results": [res, {"scenario": "budget", "error": "not built yet"}]},
                          doc)
    text = doc.read_text()
    assert "old" not in text
    assert text.startswith("# Benchmarks\n\nintro")
    assert text.rstrip().endswith("## How to read")
    assert "| slow | jobs_per_s | 450.0 | serial: 0.500 | serial: 900.0x |" in text
    assert "| budget | — | not built yet | | |" in text


def test_skip_locked_queries_are_loaded() -> None:
    """The baseline's SQL file defines each query the scenarios and workers run."""
    assert {"schema", "insert", "claim", "complete", "fail", "summary", "last_id"} <= set(QUERIES)
    assert "SKIP LOCKED" in QUERIES["claim"]


def test_bench_exits_2_for_a_scenario_not_built_yet(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scenario that raises NotBuiltError makes `calmq bench` exit 2 and say so."""
    from bench import scenarios

    def not_built(*_args: object, **_kw: object) -> dict[str, object]:
        raise scenarios.NotBuiltError("needs calmq.calls.budget")

    monkeypatch.setitem(scenarios.SCENARIOS, "budget", not_built)
    assert main(["bench", "budget", "--json"]) == 2
    captured = capsys.readouterr()
    assert "not built yet: needs calmq.calls.budget" in captured.err
    assert captured.out == ""


def test_budget_scenario_says_what_is_missing() -> None:
    """Without calmq.calls.budget the budget scenario raises NotBuiltError naming it; with it, the
    setting it drives exists."""
    from bench import budget, scenarios
    from calmq.settings import Settings

    if importlib.util.find_spec("calmq.calls.budget") is None:
        with pytest.raises(scenarios.NotBuiltError, match=r"calmq\.budget"):
            budget.budget(1, log=lambda _m: None, sampler=Sampler())
    else:
        assert "budget_tokens_per_minute" in Settings.model_fields


def test_bench_rejects_an_unknown_scenario() -> None:
    """An unknown scenario is a usage error (exit 2) before anything starts."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", "nope"])
    assert exc.value.code == 2


def test_profile_summary_scales_shares_to_measured_cpu(tmp_path: Path) -> None:
    """Frames are reported as their share of a process's samples times its /proc CPU per job;
    samples parked in epoll are left out."""
    from bench.procs import Phase
    from bench.profile import summarize_profiles

    folded = tmp_path / "worker.folded"
    folded.write_text(
        "process 1:main (x.py:1);run (processors/runner.py:10);dumps (json/encoder.py:5) 30\n"
        "process 1:main (x.py:1);run (processors/runner.py:10);claim (calmq/store.py:7) 10\n"
        "process 1:main (x.py:1);EpollSelector.select (selectors.py:9) 60\n"
    )
    phase = Phase({"worker": 1})
    phase.cpu = {"worker": 2.0}  # 2 s of CPU for 1,000 jobs: 2 ms per job
    out = tmp_path / "profile.md"
    summarize_profiles({"worker": folded}, 1000, phase, out)
    text = out.read_text()
    assert "## worker: 2.00 CPU ms per job, 40 samples" in text
    assert "| 75.0% | 1.500 | `dumps (json/encoder.py)` |" in text
    assert "| 25.0% | 0.500 | `claim (calmq/store.py)` |" in text
    assert "EpollSelector" not in text


def test_scrape_reads_counters_and_histogram_quantiles() -> None:
    """A /metrics text gives counters by name and Prometheus-style quantiles of a histogram
    (linear inside the bucket holding the rank; the last finite bound past it)."""
    from bench.scrape import Scrape

    text = "\n".join([
        "# TYPE calmq_event_loop_lag_seconds histogram",
        'calmq_event_loop_lag_seconds_bucket{le="0.01"} 90.0',
        'calmq_event_loop_lag_seconds_bucket{le="0.05"} 98.0',
        'calmq_event_loop_lag_seconds_bucket{le="0.1"} 100.0',
        'calmq_event_loop_lag_seconds_bucket{le="+Inf"} 100.0',
        "calmq_event_loop_lag_seconds_count 100.0",
        "calmq_event_loop_lag_seconds_sum 1.0",
        "# TYPE calmq_lease_expirations_total counter",
        "calmq_lease_expirations_total 3.0",
        "# TYPE calmq_commit_lag_seconds histogram",
        'calmq_commit_lag_seconds_bucket{le="0.5"} 1.0',
        'calmq_commit_lag_seconds_bucket{le="+Inf"} 4.0', ""])
    got = Scrape(text)
    assert got.value("calmq_lease_expirations_total") == 3.0
    assert got.quantile("calmq_event_loop_lag_seconds", 0.5) == pytest.approx(0.01 * 50 / 90)
    assert got.quantile("calmq_event_loop_lag_seconds", 0.99) == pytest.approx(0.075)
    assert got.quantile("calmq_commit_lag_seconds", 0.99) == 0.5  # in +Inf: the last bound
    assert got.quantile("calmq_nothing_seconds", 0.99) == 0.0


@pytest.mark.parametrize("argv", [["bench", "e2e", "--runs", "0"],
                                  ["bench", "priority", "--size", "0"]])
def test_bench_rejects_runs_or_size_below_one(argv: list[str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """--runs 0 and --size 0 are usage errors (exit 2) naming the flag, before a stack starts."""
    assert main(argv) == 2
    assert "must be 1 or more" in capsys.readouterr().err


def test_scale_is_registered_at_the_issues_size_and_checks_its_steady_run(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`calmq bench scale` preloads 20 M jobs by default; --steady-minutes 0 is a usage error
    before a stack starts; its headline figures and their ratios to the empty database are
    in the BENCHMARKS.md table."""
    from bench import scenarios

    assert scenarios.DEFAULT_SIZES["scale"] == 20_000_000
    assert main(["bench", "scale", "--size", "1000", "--steady-minutes", "0"]) == 2
    assert "--steady-minutes must be above 0" in capsys.readouterr().err
    table = report.markdown_table([report.result(
        "scale", 1, {"jobs_per_s": 450.0, "dispatch_p99_ms": 30.0},
        {"empty_database": {"jobs_per_s": 500.0, "dispatch_p99_ms": 25.0}},
        {"jobs_per_s_vs_empty": 0.9, "dispatch_p99_ms_vs_empty": 1.2})])
    assert "| scale | jobs_per_s | 450.0 | empty_database: 500.0 | empty: 0.900x |" in table
    assert "| scale | dispatch_p99_ms | 30.0 | empty_database: 25.0 | empty: 1.200x |" in table


def test_new_scenarios_are_registered_with_full_default_sizes() -> None:
    """priority and longcalls run by name with the issue's sizes as their defaults, and their
    headline figures are in the BENCHMARKS.md table."""
    from bench import scenarios

    assert scenarios.DEFAULT_SIZES["priority"] == 50_000
    assert scenarios.DEFAULT_SIZES["longcalls"] == 60_000
    assert {"priority", "longcalls"} <= set(scenarios.SCENARIOS)
    table = report.markdown_table([report.result(
        "longcalls", 1, {"jobs_per_s": 450.0, "jobs_per_s_vs_ideal": 0.91,
                         "loop_lag_p99_ms": 12.0, "lease_expiries": 0}, {}, {})])
    assert "| longcalls | jobs_per_s_vs_ideal | 0.910 |" in table
    assert "| longcalls | lease_expiries | 0 |" in table


def test_statement_attribution_is_written_per_side(tmp_path: Path) -> None:
    """e2e/drain write each side's heaviest statements (ms, calls and WAL per job) beside
    PostgreSQL's CPU per job and the jobs table's HOT share."""
    from bench.common import hot_share, write_statements

    row = {"ms_per_job": 0.1234, "share_of_toplevel": 0.5, "calls_per_job": 0.02,
           "rows_per_call": 50.0, "wal_bytes_per_job": 900.0, "blocks_dirtied_per_job": 1.0,
           "query": "WITH input AS (SELECT 1) | x"}
    res = report.result("e2e", 10, {"pg_cpu_ms_per_job": 0.3},
                        {"skip_locked": {"pg_cpu_ms_per_job": 0.4}}, {})
    res["pg_statements"] = {"calmq": [row], "skip_locked": []}
    res["jobs_table"] = hot_share({"inserts": 10, "updates": 30, "hot_updates": 6,
                                    "deletes": 0})
    assert res["jobs_table"]["hot_share"] == 0.2
    assert res["jobs_table"]["updates_per_insert"] == 3.0
    out = tmp_path / "e2e-pg-statements.md"
    write_statements(out, "e2e", res)
    text = out.read_text()
    assert "calmq 0.3 ms, skip_locked 0.4 ms" in text
    assert "## calmq" in text
    assert "## skip_locked" in text
    assert "| 0.1234 | 50.0% | 0.02 | 50.0 | 900.0 | `WITH input AS (SELECT 1) / x` |" in text


def test_no_bench_module_imports_another_ones_private_names() -> None:
    """The scenarios share bench/common.py's public helpers; none reaches into another
    module's private names (which is how the registry once doubled as a helper library)."""
    import ast

    bench_dir = Path(__file__).resolve().parents[2] / "bench"
    private = []
    for path in sorted(bench_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench"):
                private += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_")]
    assert private == []
    from bench import scenarios

    assert all(callable(run) for run in scenarios.SCENARIOS.values())
    assert set(scenarios.DEFAULT_SIZES) == set(scenarios.SCENARIOS)


def test_streaming_scenario_is_registered_with_the_issues_size() -> None:
    """calmq bench streaming runs by name with 200 streamed jobs by default, and its
    added time to first token is a headline of the BENCHMARKS.md table."""
    from bench import scenarios

    assert scenarios.DEFAULT_SIZES["streaming"] == 200
    assert "streaming" in scenarios.SCENARIOS
    table = report.markdown_table([report.result(
        "streaming", 1, {"ttft_added_p95_ms": 42.0}, {}, {})])
    assert "| streaming | ttft_added_p95_ms | 42.0 |" in table


def test_streaming_added_latency_is_compared_job_by_job() -> None:
    """Time to first token through calmq (first delta minus submit) is compared with the
    fake's own (first token minus arrival) per job, split into before the call and
    delivery (and delivery at the first chunk's write when known); a job without a delta
    or without the fake's record is left out."""
    from bench.streaming import Timing, first_tokens, ttft_figures

    timings = [Timing(f"j{n}", submitted=100.0, first_delta=100.0 + (400 + n) / 1000)
               for n in range(20)]
    timings += [Timing("no-delta", submitted=100.0), Timing("unknown", 100.0, 100.5)]
    # The fake took each call 10 ms after its submit and wrote its first token 300 ms later;
    # j0's first stream broke before a token, its second one counts.
    streams = [{"job": f"j{n}", "at": 100.010, "first_token_at": 100.310} for n in range(20)]
    streams.insert(0, {"job": "j0", "at": 100.005, "first_token_at": None})
    streams.append({"job": "no-delta", "at": 100.0, "first_token_at": 100.3})
    figs = ttft_figures(timings, first_tokens(streams))
    assert figs["ttft_jobs_measured"] == 20
    # calmq's times are 400..419 ms: nearest rank p50 is the 10th (409), p95 the 19th (418).
    assert figs["ttft_calmq_p50_ms"] == 409.0
    assert figs["ttft_calmq_p95_ms"] == 418.0
    assert figs["ttft_fake_p95_ms"] == 300.0
    assert figs["ttft_added_p50_ms"] == 109.0
    assert figs["ttft_added_p95_ms"] == 118.0
    assert figs["ttft_added_max_ms"] == 119.0
    assert figs["before_call_p95_ms"] == 10.0
    assert figs["delivery_p95_ms"] == 108.0
    split = ttft_figures(timings, first_tokens(streams), {f"j{n}": 100.320 for n in range(20)})
    # The first chunk's write 10 ms after the first token; the client 80..99 ms after that.
    assert split["delivery_worker_p95_ms"] == 10.0
    assert split["delivery_api_p50_ms"] == 89.0
    assert split["delivery_api_p95_ms"] == 98.0
    assert "delivery_api_p95_ms" not in figs
    # Before the call, by stage: the row 2 ms after the submit, the claim 5 ms after it,
    # the call 3 ms after the claim.
    staged = ttft_figures(timings, first_tokens(streams), None,
                          {f"j{n}": (100.002, 100.007) for n in range(20)})
    assert staged["before_call_intake_p95_ms"] == 2.0
    assert staged["before_call_dispatch_p95_ms"] == 5.0
    assert staged["before_call_worker_p95_ms"] == 3.0
    assert "before_call_intake_p95_ms" not in split


def test_a_run_without_deltas_reports_no_time_to_first_token() -> None:
    """The not-streamed baseline carries its CPU figures but no time-to-first-token keys,
    rather than zeros that would read as a measurement."""
    from bench.streaming import Timing, ttft_figures, without_ttft

    figs = {**ttft_figures([Timing("j", 1.0)], {}), "worker_cpu_s": 1.5, "streams_ended": 1}
    assert without_ttft(figs) == {"worker_cpu_s": 1.5, "streams_ended": 1}


def test_happy_path_is_registered_and_its_cpu_ratio_is_a_headline() -> None:
    """calmq bench happy_path runs by name (20,000 jobs by default) and BENCHMARKS.md's
    table shows its PostgreSQL CPU per job against the history rows' baseline."""
    from bench import scenarios

    assert scenarios.DEFAULT_SIZES["happy_path"] == 20_000
    assert "happy_path" in scenarios.SCENARIOS
    table = report.markdown_table([report.result(
        "happy_path", 1, {"pg_cpu_ms_per_job": 0.25},
        {"history_rows": {"pg_cpu_ms_per_job": 0.3}},
        {"pg_cpu_per_job_vs_history_rows": 0.833})])
    assert "| happy_path | pg_cpu_ms_per_job | 0.250 | history_rows: 0.300 |" in table


def test_the_scale_pass_reports_the_share_of_hot_updates_of_jobs() -> None:
    """The e2e pass's server counters give the share of the job rows' updates that were
    HOT, and the updates per job, from pg_stat_user_tables' two counters."""
    from bench.scale import _per_job

    before = dict.fromkeys(("wal_records", "wal_fpi", "wal_bytes", "blocks_read",
                            "blocks_hit", "checkpoints", "autovacuums", "autoanalyzes",
                            "jobs_updates", "jobs_hot_updates"), 0.0)
    after = {**before, "jobs_updates": 2000.0, "jobs_hot_updates": 500.0, "autovacuums": 1.0}
    out = _per_job(before, after, 1000)
    assert out["jobs_hot_update_share"] == 0.25
    assert out["jobs_updates_per_job"] == 2.0
    assert out["autovacuums"] == 1.0
    assert _per_job(before, before, 1000)["jobs_hot_update_share"] == 0.0


def test_the_scale_dispatch_runs_take_turns_each_side_first_as_often() -> None:
    """The two databases' dispatch runs come in adjacent pairs, every other pair reversed,
    so a drift of the host over the runs falls on both: each side runs as often, and as
    often first in a pair."""
    from bench.scale import turns

    assert turns(1) == ["empty", "preloaded"]
    assert turns(3) == ["empty", "preloaded", "preloaded", "empty", "empty", "preloaded"]
    order = turns(8)
    assert order.count("empty") == order.count("preloaded") == 8
    pairs = [order[i:i + 2] for i in range(0, len(order), 2)]
    assert all(sorted(p) == ["empty", "preloaded"] for p in pairs)
    assert [p[0] for p in pairs].count("empty") == 4


def test_the_scale_dispatch_ratio_is_the_median_of_the_pairs_ratios() -> None:
    """One pair whose run met a stall of the host does not move the ratio; a slower
    preloaded side in every pair does."""
    from bench.scale import paired_ratio

    empty = [60.0, 62.0, 58.0, 61.0, 59.0]
    assert paired_ratio(empty, [61.0, 60.0, 600.0, 62.0, 60.0]) == pytest.approx(1.017, abs=1e-3)
    assert paired_ratio(empty, [e * 1.5 for e in empty]) == 1.5
    assert paired_ratio([50.0, 100.0], [60.0, 100.0]) == 1.1  # an even count: the middle two
    with pytest.raises(ValueError, match="longer"):  # runs that do not pair up
        paired_ratio([1.0], [1.0, 2.0])


def test_the_scale_dispatch_ratio_comes_with_its_bootstrap_interval() -> None:
    """The interval holds the median, reads the same twice, and is wide where the pairs
    disagree and narrow where they agree."""
    from bench.scale import paired_interval, paired_ratio

    empty = [60.0, 50.0, 70.0, 65.0, 55.0, 58.0, 62.0, 61.0]
    noisy = [30.0, 120.0, 60.0, 140.0, 50.0, 70.0, 40.0, 90.0]
    low, high = paired_interval(empty, noisy)
    assert low <= paired_ratio(empty, noisy) <= high
    assert paired_interval(empty, noisy) == (low, high)
    steady = [e * 1.05 for e in empty]
    s_low, s_high = paired_interval(empty, steady)
    assert s_low == s_high == pytest.approx(1.05)
    assert high - low > 0.5


def test_the_median_dispatch_run_is_taken_per_figure_and_the_lower_of_an_even_count() -> None:
    """e2e and scale hold their dispatch targets to the same median run: p50 and p99 each
    their own median, the lower middle one where the runs are even."""
    from bench.common import median_run

    runs = [{"p50_ms": 10.0, "p99_ms": 90.0}, {"p50_ms": 30.0, "p99_ms": 50.0},
            {"p50_ms": 20.0, "p99_ms": 70.0}, {"p50_ms": 40.0, "p99_ms": 60.0}]
    assert median_run(runs) == {"dispatch_p50_ms": 20.0, "dispatch_p99_ms": 60.0}
    assert median_run(runs[:3]) == {"dispatch_p50_ms": 20.0, "dispatch_p99_ms": 70.0}
