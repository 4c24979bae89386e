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
import time
from dataclasses import asdict

import httpx
from machine import process_cpu_seconds
from report import print_result

from conveyor.demo_model import write_tiny_model
from conveyor.testing import Stack, batch_lines, service_deployment, submit_batch, write_jsonl
from conveyor.testing.load import LoadResult, run_load

GOAL_P99_MS = 50.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    return ap.parse_args(argv)


def measure(stack: Stack, args: argparse.Namespace) -> tuple[LoadResult, float, dict]:
    """Start the API and a worker, submit the batch, run the clients until it is done: their
    result, the API's CPU cores while they ran, and the batch object at the end."""
    api = stack.start_api()
    api_pid = stack.named["api"].pid
    if args.model == "tiny":
        stack.start_worker("w1", write_tiny_model(stack.root / "model", "llama"))
        served = "tiny"
    else:
        stack.start_worker("w1", "echo", served="")
        served = "echo"
    lines = batch_lines(args.requests, model=served, max_tokens=args.max_tokens)
    batch_id = submit_batch(api, write_jsonl(stack.root / "in.jsonl", lines))
    cpu_before, started = process_cpu_seconds(api_pid), time.monotonic()
    result = run_load(api, batch_id, args.users, args.max_seconds, spawn_rate=args.spawn_rate)
    api_cores = (process_cpu_seconds(api_pid) - cpu_before) / (time.monotonic() - started)
    return result, api_cores, httpx.get(f"{api}/v1/batches/{batch_id}").json()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    # a deployment's heartbeat and reconciler timing, not the tests' quick one: a reconciler
    # round every second would load the API far more than a deployment's does
    shards = {"CONVEYOR_SHARD_SIZE": "64", "CONVEYOR_VISIBILITY_TIMEOUT": "600"}
    echo = {"CONVEYOR_ECHO_STEP_SECONDS": str(args.echo_step_seconds)}
    with service_deployment("load", **shards, **echo) as stack:
        result, api_cores, batch = measure(stack, args)
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
    print_result(report)
    return report


if __name__ == "__main__":
    main()
