"""The API under load: 50 clients poll a running 10,000-request batch and list batches and
files (locust, headless, loopback only) until the batch completes. Reports failures and the
latency of the status poll; the goal is p99 < 50 ms on this machine.

    python bench/load.py                     # 50 clients, 10,000 requests, the echo engine
    python bench/load.py --users 20 --requests 2000

The echo worker stands in for a model on a GPU: each engine step waits --echo-step-seconds
(default 0.25) without using the CPU and answers up to 256 requests, so the 10,000-request
batch runs about 10 s, through the clients' ramp-up (--spawn-rate per second) and beyond.

Starts its own API and worker on a fresh PostgreSQL database (DATABASE_URL, default the local
server) and a throwaway redis-server. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
LOCUSTFILE = ROOT / "bench" / "locustfile.py"
STATUS_ROUTE = "GET /v1/batches/{id}"
GOAL_P99_MS = 50.0


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
        env = dict(os.environ, CONVEYOR_LOAD_BATCH=batch_id)
        if api_key:
            env["CONVEYOR_API_KEY"] = api_key
        started = time.monotonic()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "locust",
                "-f",
                str(LOCUSTFILE),
                "--headless",
                "--users",
                str(users),
                "--spawn-rate",
                str(spawn_rate),
                "--host",
                api,
                "--run-time",
                f"{max_seconds}s",
                "--csv",
                str(prefix),
                "--only-summary",
                "--reset-stats",  # count from the moment all users are running
                "--exit-code-on-error",
                "0",
                "--loglevel",
                "WARNING",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=max_seconds + 60,
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


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=50)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-seconds", type=int, default=600)
    ap.add_argument("--spawn-rate", type=float, default=10.0, help="clients started per second")
    ap.add_argument(
        "--echo-step-seconds",
        type=float,
        default=0.25,
        help="the echo engine's wait per step (CONVEYOR_ECHO_STEP_SECONDS); 0: answer at once",
    )
    ap.add_argument(
        "--model",
        default="echo",
        help="what the worker serves: echo (the null engine, the default: the engine runs on "
        "other hardware in a deployment, so only the service's own work shares this machine "
        "with the API) or tiny (a tiny random Llama on this machine's CPU)",
    )
    args = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT / "tests"))
    import uuid

    import sqlalchemy as sa
    from services import LocalRedis, Stack, batch_lines, stack_env, write_jsonl

    from conveyor.demo_model import write_tiny_model
    from conveyor.settings import normalize_database_url
    from ledger.migrate import upgrade

    server = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
    name = f"conveyor_load_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(normalize_database_url(server), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    db_url = normalize_database_url(server).rsplit("/", 1)[0] + f"/{name}"
    with tempfile.TemporaryDirectory(prefix="conveyor-load-") as tmp:
        root = Path(tmp)
        redis_server = LocalRedis(root)
        stack = Stack(env=stack_env(db_url, redis_server.url, root), root=root)
        stack.env["CONVEYOR_SHARD_SIZE"] = "64"
        # the deployment's heartbeat and reconciler timing, not the tests' quick one: a
        # reconciler round every second would load the API far more than a deployment's does
        for quick in (
            "CONVEYOR_HEARTBEAT_INTERVAL",
            "CONVEYOR_HEARTBEAT_TIMEOUT",
            "CONVEYOR_RECONCILE_INTERVAL",
        ):
            stack.env.pop(quick)
        stack.env["CONVEYOR_ECHO_STEP_SECONDS"] = str(args.echo_step_seconds)
        try:
            upgrade(db_url)
            api = stack.start_api()
            api_pid = stack.procs[-1].pid
            if args.model == "tiny":
                stack.start_worker("w1", write_tiny_model(root / "model", "llama"))
                served = "tiny"
            else:
                stack.start_worker("w1", "echo", served="")
                served = "echo"
            lines = batch_lines(args.requests, model=served, max_tokens=args.max_tokens)
            path = write_jsonl(root / "in.jsonl", lines)
            with open(path, "rb") as f:
                file_id = httpx.post(
                    f"{api}/v1/files", files={"file": f}, data={"purpose": "batch"}, timeout=120
                ).json()["id"]
            body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
            batch_id = httpx.post(f"{api}/v1/batches", json=body, timeout=120).json()["id"]
            cpu_before, started = process_cpu_seconds(api_pid), time.monotonic()
            result = run_load(
                api, batch_id, args.users, args.max_seconds, spawn_rate=args.spawn_rate
            )
            api_cores = (process_cpu_seconds(api_pid) - cpu_before) / (time.monotonic() - started)
            batch = httpx.get(f"{api}/v1/batches/{batch_id}").json()
        finally:
            stack.stop()
            redis_server.kill()
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            admin.dispose()
    report = asdict(result) | {
        "batch_status": batch["status"],
        "batch_requests": args.requests,
        "goal_p99_ms": GOAL_P99_MS,
        "p99_vs_goal": round(result.status_p99_ms / GOAL_P99_MS, 2),
        "api_cpu_cores": round(api_cores, 2),
    }
    print(
        f"{args.users} clients for {result.seconds} s while a {args.requests:,}-request batch "
        f"ran ({batch['status']}): {result.requests:,} requests, {result.failures} failures"
    )
    print(
        f"status poll: p50 {result.status_p50_ms:.0f} ms, p99 {result.status_p99_ms:.0f} ms "
        f"(goal < {GOAL_P99_MS:.0f} ms); all routes p99 {result.all_p99_ms:.0f} ms; the API "
        f"used {api_cores:.2f} cores on average"
    )
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
