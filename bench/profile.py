"""Summarise py-spy's raw (collapsed) stacks of the e2e run into milliseconds per job."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from bench.procs import Phase

__all__ = ["summarize_profiles"]

# Leaf frames where a thread waits rather than works (py-spy may still count them active).
_IDLE = ("select (selectors.py)", "wait (threading.py)", "sleep (asyncio/tasks.py)")
_OURS = ("calmq/", "producers/", "relay/", "processors/")
_FRAME = re.compile(r"^(?P<func>[^ ]+) \((?P<file>[^:]+)(?::\d+)?\)$")


def _short(frame: str) -> str:
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    path = m.group("file")
    for marker in ("site-packages/", "/work/main/", "lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{m.group('func')} ({path})"


def _read(path: Path) -> tuple[Counter[str], Counter[str], int]:
    leaf: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    if not path.exists():
        return leaf, inclusive, 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = [_short(f) for f in stack.split(";") if f and not f.startswith("process ")
                  and not f.startswith("thread ")]
        if not frames or any(frames[-1].endswith(i) for i in _IDLE):
            continue
        total += n
        leaf[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    return leaf, inclusive, total


def summarize_profiles(paths: dict[str, Path], jobs: int, phase: Phase, out: Path) -> None:
    """Write a markdown summary: per process, the heaviest frames as a share of its samples
    and as CPU ms per job (that share of the process's CPU per job measured from /proc).

    Samples are wall-clock: on a busy machine a thread waiting for a core still counts, so
    only the shares are read from py-spy; the milliseconds come from /proc."""
    lines = ["# e2e profile (py-spy record --gil, 100 Hz)", "",
             f"{jobs} jobs end to end, in a pass of their own after the measured one: "
             "py-spy stops each process to sample it, so these CPU figures run higher than "
             "the measured ones in latest.json. CPU per job from /proc for the same window: "
             + ", ".join(f"{n} {phase.cpu.get(n, 0) * 1000 / max(jobs, 1):.2f} ms"
                         for n in sorted(phase.cpu)), "",
             "Per process: the share of its samples in a frame, times the process's CPU per "
             "job, gives the CPU ms per job column.", ""]
    for name, path in sorted(paths.items()):
        leaf, inclusive, total = _read(path)
        cpu_ms = phase.cpu.get(name, 0.0) * 1000 / max(jobs, 1)
        lines += [f"## {name}: {cpu_ms:.2f} CPU ms per job, {total} samples", ""]
        if not total:
            lines += ["(no samples: py-spy could not attach, or it needs ptrace permission)", ""]
            continue
        lines += ["| self share | ≈ CPU ms/job | function |", "|---:|---:|---|"]
        lines += [f"| {n / total:.1%} | {cpu_ms * n / total:.3f} | `{f}` |"
                  for f, n in leaf.most_common(12)]
        # Inclusive time of calmq's own functions, minus the loops every sample passes through.
        ours = [(f, n) for f, n in inclusive.most_common()
                if any(f"({o}" in f for o in _OURS) and n < 0.9 * total][:20]
        lines += ["", "| inclusive share | ≈ CPU ms/job | calmq function |", "|---:|---:|---|"]
        lines += [f"| {n / total:.1%} | {cpu_ms * n / total:.3f} | `{f}` |" for f, n in ours]
        lines.append("")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
