"""Peak RSS and CPU seconds of the processes a scenario runs, sampled with psutil.

CPU of a process includes its children (PostgreSQL's backends are children of the
postmaster, and their time is counted once they exit through ``children_*``), so the
database's work is charged to the scenario that caused it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import psutil  # type: ignore[import-untyped]

__all__ = ["LOADGEN", "Phase", "Sampler", "cpu_seconds"]


# The bench process itself (the in-process load generator): its own CPU only, since every
# process of the rig is its descendant.
LOADGEN = "loadgen"


def cpu_seconds(pid: int, *, descendants: bool = True) -> float:
    """User + system CPU seconds of ``pid`` and every descendant, living or reaped."""
    try:
        proc = psutil.Process(pid)
        t = proc.cpu_times()
        if not descendants:
            return float(t.user + t.system)
        total = float(t.user + t.system + t.children_user + t.children_system)
        for child in proc.children(recursive=True):
            try:
                c = child.cpu_times()
                total += c.user + c.system
            except psutil.Error:
                continue
        return total
    except psutil.Error:
        return 0.0


def _rss_mb(pid: int) -> float:
    try:
        return float(psutil.Process(pid).memory_info().rss) / 2**20
    except psutil.Error:
        return 0.0


@dataclass
class Phase:
    """What a set of processes used between ``start`` and ``stop``."""

    pids: dict[str, int]
    cpu_start: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    _t0: float = 0.0

    def start(self) -> Phase:
        self._t0 = time.monotonic()
        self.cpu_start = {n: cpu_seconds(p, descendants=n != LOADGEN)
                          for n, p in self.pids.items()}
        self.sample()
        return self

    def sample(self) -> None:
        for name, pid in self.pids.items():
            rss = _rss_mb(pid)
            if rss > self.peak_rss_mb.get(name, 0.0):
                self.peak_rss_mb[name] = rss

    def stop(self) -> Phase:
        self.sample()
        self.wall_s = time.monotonic() - self._t0
        self.cpu = {n: max(0.0, cpu_seconds(p, descendants=n != LOADGEN)
                               - self.cpu_start.get(n, 0.0))
                    for n, p in self.pids.items()}
        return self


class Sampler:
    """Samples RSS of every open phase every ``interval`` seconds on a daemon thread."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self._phases: list[Phase] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                phases = list(self._phases)
            for phase in phases:
                phase.sample()

    def phase(self, pids: dict[str, int]) -> Phase:
        phase = Phase(dict(pids)).start()
        with self._lock:
            self._phases.append(phase)
        return phase

    def end(self, phase: Phase) -> Phase:
        with self._lock:
            if phase in self._phases:
                self._phases.remove(phase)
        return phase.stop()

    def close(self) -> None:
        self._stop.set()
