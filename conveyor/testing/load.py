"""Many clients polling a running batch, as locust drives them (headless, loopback only):
the load scenario that `bench/load.py` measures and a test runs with API keys. The clients are
`locustfile.py` beside this module."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
STATUS_ROUTE = "GET /v1/batches/{id}"


@dataclass
class LoadResult:
    users: int
    seconds: float
    requests: int
    failures: int
    status_requests: int
    status_p50_ms: float
    status_p99_ms: float
    all_p99_ms: float
    requests_per_s: float


def run_load(
    api: str,
    batch_id: str,
    users: int,
    max_seconds: int,
    api_key: str | None = None,
    spawn_rate: float = 10.0,
) -> LoadResult:
    """Run locust against `api` until the batch finishes (or `max_seconds`).

    Users start `spawn_rate` per second, as clients arrive in practice (all at once, their
    first requests land in the same millisecond: a burst no deployment sees that measures
    only the queue it makes); statistics count from the moment all of them are running."""
    with tempfile.TemporaryDirectory(prefix="conveyor-load-") as tmp:
        prefix = Path(tmp) / "load"
        env = dict(os.environ)
        if api_key:
            env["CONVEYOR_API_KEY"] = api_key
        options = {
            "--users": users,
            "--spawn-rate": spawn_rate,
            "--host": api,
            "--batch-id": batch_id,
            "--run-time": f"{max_seconds}s",
            "--csv": prefix,
            "--exit-code-on-error": 0,
            "--loglevel": "WARNING",
        }
        argv = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless"]
        argv += [str(part) for pair in options.items() for part in pair]
        argv += ["--only-summary", "--reset-stats"]  # count once all users are running
        started = time.monotonic()
        done = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=max_seconds + 60
        )
        seconds = time.monotonic() - started
        if done.returncode != 0:
            raise RuntimeError(f"locust failed ({done.returncode}):\n{done.stderr[-3000:]}")
        with open(f"{prefix}_stats.csv") as f:
            rows = {r["Name"]: r for r in csv.DictReader(f)}
    status, total = rows[STATUS_ROUTE], rows["Aggregated"]
    return LoadResult(
        users=users,
        seconds=round(seconds, 1),
        requests=int(total["Request Count"]),
        failures=int(total["Failure Count"]),
        status_requests=int(status["Request Count"]),
        status_p50_ms=float(status["50%"]),
        status_p99_ms=float(status["99%"]),
        all_p99_ms=float(total["99%"]),
        requests_per_s=round(float(total["Requests/s"]), 1),
    )
