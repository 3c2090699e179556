"""``make bench``: every scenario at its default size, into bench/results/latest.json and the
table in BENCHMARKS.md. A scenario that is not built yet is recorded as such, not skipped
silently. ``python -m bench.run_all [--only e2e,slow] [--no-profile]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from bench import SCENARIOS, NotBuiltError, markdown_table, run_scenario

__all__ = ["main", "refresh_benchmarks_md"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BEGIN = "<!-- bench:begin -->"
END = "<!-- bench:end -->"


def refresh_benchmarks_md(doc: dict[str, Any], path: Path = ROOT / "BENCHMARKS.md") -> None:
    """Replace the text between the bench markers with this run's table."""
    results = doc["results"]
    first: dict[str, Any] = next((r for r in results if "machine" in r), {})
    m = first.get("machine", {})
    v = first.get("versions", {})
    block = "\n".join([
        BEGIN,
        f"Run of {doc['date']} in {doc['total_seconds']:.0f} s with `make bench`.",
        f"Machine: {m.get('cpus')} CPUs ({m.get('cpu_model')}), {m.get('memory_gb')} GB, "
        f"{m.get('os')}, load average {m.get('load_avg_1m_at_start')} when the first scenario "
        "started (shared with other work: figures are noisy).",
        "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()
                                 if k != "load_generator") + ".",
        "Load generator: " + "; ".join(
            f"{r['scenario']}: {r['versions']['load_generator']}" for r in results
            if r.get("versions", {}).get("load_generator")) + ".",
        "",
        markdown_table(results),
        "",
        "Full figures (per-process RSS, CPU split by process): `bench/results/latest.json`.",
        END,
    ])
    text = path.read_text() if path.exists() else f"# Benchmarks\n\n{BEGIN}\n{END}\n"
    if BEGIN in text and END in text:
        text = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _m: block, text,
                      flags=re.S)
    else:
        text += "\n" + block + "\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run_all")
    parser.add_argument("--only", help="comma list of scenarios (default: all)")
    parser.add_argument("--no-profile", action="store_true", help="skip the e2e py-spy profile")
    parser.add_argument("--runs", type=int, default=None,
                        help="e2e dispatch passes (default 5; the target is the median run)")
    parser.add_argument("--size", type=int, default=None,
                        help="one size for every scenario run (smoke runs; default: each own)")
    args = parser.parse_args(argv)
    if (args.runs is not None and args.runs < 1) or (args.size is not None and args.size < 1):
        parser.error("--runs and --size must be 1 or more")
    names = args.only.split(",") if args.only else list(SCENARIOS)
    RESULTS.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results: list[dict[str, Any]] = []
    for name in names:
        try:
            # The statement attribution of e2e and drain goes beside the py-spy profile.
            profile = None if args.no_profile or name not in ("e2e", "drain") else RESULTS
            res = (run_scenario(name, args.size, profile_dir=profile, runs=args.runs)
                   if args.runs else run_scenario(name, args.size, profile_dir=profile))
        except NotBuiltError as exc:
            print(f"bench {name}: not built yet: {exc}", file=sys.stderr)
            res = {"scenario": name, "error": f"not built yet: {exc}"}
        except Exception as exc:  # noqa: BLE001 - one broken scenario must not hide the others' figures
            print(f"bench {name} failed: {exc!r}", file=sys.stderr)
            res = {"scenario": name, "error": f"failed: {exc}"}
        results.append(res)
        print(json.dumps(res), flush=True)
    total = round(time.monotonic() - started, 1)
    if args.only and (RESULTS / "latest.json").exists():
        # A partial run replaces its scenarios and keeps the others' last figures.
        previous = json.loads((RESULTS / "latest.json").read_text())
        fresh = {r["scenario"] for r in results}
        results = [r if r["scenario"] not in fresh else next(
            n for n in results if n["scenario"] == r["scenario"])
            for r in previous.get("results", [])] + [
            r for r in results if r["scenario"] not in
            {p["scenario"] for p in previous.get("results", [])}]
        total = previous.get("total_seconds", total)
    doc = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "total_seconds": total, "results": results}
    (RESULTS / "latest.json").write_text(json.dumps(doc, indent=2) + "\n")
    refresh_benchmarks_md(doc)
    print(f"wrote {RESULTS / 'latest.json'} and BENCHMARKS.md", file=sys.stderr)
    return 0 if all("error" not in r or "not built" in r["error"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
