"""The API under load (locust, loopback): 50 clients poll a running 10,000-request batch and
list batches and files until it completes. No request fails and the batch completes; the
latency goal is measured by `bench/load.py` (README), not asserted here."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
from services import Stack, batch_lines, write_jsonl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from load import run_load  # noqa: E402


def test_fifty_clients_poll_a_10k_batch_without_errors(stack: Stack, tmp_path: Path) -> None:
    # the echo engine at a model's pace (0.25 s per step of up to 256 requests): the batch runs
    # about 10 s, past the clients' 5 s ramp-up
    stack.env.update(
        CONVEYOR_SHARD_SIZE="64", CONVEYOR_AUTH="required", CONVEYOR_ECHO_STEP_SECONDS="0.25"
    )
    api = stack.start_api()
    stack.start_worker("w1", "echo", served="")
    key = stack_key(stack)
    auth = {"Authorization": f"Bearer {key}"}
    path = write_jsonl(tmp_path / "in.jsonl", batch_lines(10_000, model="echo"))
    with open(path, "rb") as f:
        file_id = httpx.post(
            f"{api}/v1/files", files={"file": f}, data={"purpose": "batch"}, headers=auth,
            timeout=120,
        ).json()["id"]  # fmt: skip
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    batch_id = httpx.post(f"{api}/v1/batches", json=body, headers=auth, timeout=120).json()["id"]

    result = run_load(api, batch_id, users=50, max_seconds=300, api_key=key)
    print(f"load: {result}")
    assert result.failures == 0, result
    assert result.status_requests > 50, result  # every client polled
    batch = httpx.get(f"{api}/v1/batches/{batch_id}", headers=auth).json()
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 10_000, "completed": 10_000, "failed": 0}


def stack_key(stack: Stack) -> str:
    import subprocess

    made = subprocess.run(
        [sys.executable, "-m", "conveyor", "keys", "create", "--name", "load"],
        env=stack.env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return made.stdout.strip().splitlines()[-1]
