"""What the benchmarks read about the machine they run on (Linux /proc, no torch): CPU seconds
of processes and of the whole machine, the load average, the malloc in use and the code
measured. On a shared machine other processes steal cores and wreck the timings: `CpuMeter`
says how much."""

from __future__ import annotations

import math
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTENDED_CORES = 0.15  # other processes' average use above which timings are unreliable


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) used so far by process `pid`; None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def other_processes_cpu_seconds() -> float | None:
    """CPU seconds the whole machine has been busy (not idle, not waiting on I/O), less this
    process's own (Linux /proc/stat); None where that cannot be read."""
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    own = os.times()
    return (sum(vals) - vals[3] - vals[4]) / hz - (own.user + own.system)


class CpuMeter:
    """CPU seconds spent by named sources between successive marks, and the wall time.

    A source is a function returning the CPU seconds it has used so far (None when it cannot
    tell); by default the one source is `others`, every process on the machine but this one.
    """

    def __init__(self, sources: dict[str, Callable[[], float | None]] | None = None) -> None:
        self.sources = sources or {"others": other_processes_cpu_seconds}
        self.phases: dict[str, dict[str, float]] = {}
        self.walls: dict[str, float] = {}
        self.last, self.last_wall = self._sample(), time.perf_counter()

    def _sample(self) -> dict[str, float | None]:
        return {name: read() for name, read in self.sources.items()}

    def mark(self, phase: str) -> dict[str, float]:
        """The CPU seconds of each source since the last mark (NaN where unknown)."""
        now, wall = self._sample(), time.perf_counter()
        spent = {}
        for name, value in now.items():
            before = self.last.get(name)
            spent[name] = math.nan if value is None or before is None else value - before
        self.phases[phase], self.walls[phase] = spent, wall - self.last_wall
        self.last, self.last_wall = now, wall
        return spent

    def cores(self, phase: str, source: str = "others") -> float:
        """A source's average use of the machine in `phase`, in cores."""
        spent = self.phases[phase][source]
        return spent if math.isnan(spent) else max(0.0, spent) / max(self.walls[phase], 1e-9)

    def contention(self, phase: str) -> tuple[float, str]:
        """Mark the end of `phase`: the other processes' cores in it, and a line saying so."""
        self.mark(phase)
        cores = self.cores(phase)
        if math.isnan(cores):
            return cores, "other processes: unknown"
        warn = "  << CONTENDED, timings unreliable" if cores > CONTENDED_CORES else ""
        return cores, f"other processes used {cores:.2f} cores on average{warn}"


def loadavg() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def allocator() -> str:
    """Which malloc serves torch's CPU tensors; it matters, since large per-step temporaries
    are mmapped and page-faulted afresh by glibc but kept for reuse by a tuned jemalloc."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "unknown"
    for name in ("jemalloc", "tcmalloc", "mimalloc"):
        if name in maps:
            conf = os.environ.get("MALLOC_CONF") or os.environ.get("TCMALLOC_RELEASE_RATE") or ""
            return f"{name} {conf}".strip()
    return "glibc malloc"


def git_state() -> str | None:
    """The commit measured, with `+dirty` when the working tree has changes."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return None
    return (commit + ("+dirty" if dirty else "")) or None


def rate(n: float, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


NOTABLE_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_isa() -> str:
    """The CPU's notable vector extensions (lscpu's flags), e.g. `avx2 avx512f avx512_bf16`."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])  # fmt: skip
    return " ".join(f for f in NOTABLE_FLAGS if f in flags) or "none of " + ",".join(NOTABLE_FLAGS)
