"""Summarise py-spy's raw (collapsed) stacks of the e2e run into milliseconds per job."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from bench.procs import Phase

__all__ = ["summarize_profiles"]

_RATE = 100  # samples per second, as passed to py-spy record
# Leaf frames where a thread waits rather than works (py-spy may still count them active).
_IDLE = ("select (selectors.py)", "wait (threading.py)", "sleep (", "_worker (concurrent/")
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
        if not frames or any(frames[-1].startswith(i) for i in _IDLE):
            continue
        total += n
        leaf[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    return leaf, inclusive, total


def summarize_profiles(paths: dict[str, Path], jobs: int, phase: Phase, out: Path) -> None:
    """Write a markdown summary: per process, active ms per job and the heaviest frames."""
    per_job = 1000 / max(jobs, 1) / _RATE  # ms per job of one sample
    lines = ["# e2e profile (py-spy record, active threads only, 100 Hz)", "",
             f"{jobs} jobs end to end. CPU per job measured by /proc for the same window: "
             + ", ".join(f"{n} {phase.cpu.get(n, 0) * 1000 / max(jobs, 1):.2f} ms"
                         for n in sorted(phase.cpu)), ""]
    for name, path in sorted(paths.items()):
        leaf, inclusive, total = _read(path)
        lines += [f"## {name}: {total * per_job:.2f} ms of active Python per job", "",
                  "| self ms/job | function |", "|---:|---|"]
        lines += [f"| {n * per_job:.3f} | `{f}` |" for f, n in leaf.most_common(12)]
        lines += ["", "| inclusive ms/job | function |", "|---:|---|"]
        lines += [f"| {n * per_job:.3f} | `{f}` |" for f, n in inclusive.most_common(25)]
        lines.append("")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
