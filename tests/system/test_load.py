"""The API under load (locust, loopback): 50 clients poll a running 10,000-request batch and
list batches and files until it completes. No request fails and the batch completes; the
latency goal is measured by `bench/load.py` (README), not asserted here."""

from __future__ import annotations

from pathlib import Path

import httpx

from conveyor.testing import Stack, batch_lines, create_key, submit_batch, write_jsonl
from conveyor.testing.load import run_load


def test_fifty_clients_poll_a_10k_batch_without_errors(stack: Stack, tmp_path: Path) -> None:
    # the echo engine at a model's pace (0.25 s per step of up to 256 requests): the batch runs
    # about 10 s, past the clients' 5 s ramp-up
    stack.env.update(
        CONVEYOR_SHARD_SIZE="64", CONVEYOR_AUTH="required", CONVEYOR_ECHO_STEP_SECONDS="0.25"
    )
    api = stack.start_api()
    stack.start_worker("w1", "echo", served="")
    key = create_key(stack.env, "load")
    path = write_jsonl(tmp_path / "in.jsonl", batch_lines(10_000, model="echo"))
    batch_id = submit_batch(api, path, headers=key.headers)

    result = run_load(api, batch_id, users=50, max_seconds=300, api_key=key.secret)
    print(f"load: {result}")
    assert result.failures == 0, result
    assert result.status_requests > 50, result  # every client polled
    batch = httpx.get(f"{api}/v1/batches/{batch_id}", headers=key.headers).json()
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {
        "total": 10_000,
        "completed": 10_000,
        "failed": 0,
        "reused": 0,
    }
