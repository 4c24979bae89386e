"""Structured logs: with CONVEYOR_LOG_FORMAT=json every log line of the API and of a worker is
one JSON object, and the lines about a batch's work carry its batch id (and shard id)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from conveyor.testing import Stack, batch_lines, submit_batch, wait_for, write_jsonl


def json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))  # a line that starts like JSON must be JSON
    return out


def test_json_logs_carry_batch_and_shard_ids(
    stack: Stack, chat_model: Path, tmp_path: Path
) -> None:
    stack.env["CONVEYOR_LOG_FORMAT"] = "json"
    api = stack.start_api()
    stack.start_worker("w1", chat_model)
    batch_id = submit_batch(api, write_jsonl(tmp_path / "in.jsonl", batch_lines(20)))
    batch = wait_for(api, batch_id, timeout=120)
    assert batch["status"] == "completed"
    file_id = batch["input_file_id"]
    time.sleep(0.5)  # let the last lines reach the files

    for name in ("api", "w1"):
        lines = json_lines(stack.log(name))
        assert len(lines) > 5, stack.log(name)[-2000:]
        for line in lines:
            assert {"ts", "level", "logger", "message"} <= set(line), line
        # no log line is left as plain text (Celery's start-up banner aside, which is printed)
        texts = [x for x in stack.log(name).splitlines() if x.strip() and not x.startswith("{")]
        assert not any(" INFO " in x or " WARNING " in x for x in texts), texts

    api_lines = json_lines(stack.log("api"))
    created = [x for x in api_lines if "created from" in x["message"]]
    assert created and created[0]["batch_id"] == batch_id and created[0]["file_id"] == file_id
    polls = [x for x in api_lines if x["logger"] == "uvicorn.access" and batch_id in x["message"]]
    assert polls and all(x["batch_id"] == batch_id for x in polls)

    worker_lines = json_lines(stack.log("w1"))
    shard_lines = [x for x in worker_lines if "requests to run" in x["message"]]
    assert len(shard_lines) == 3  # 20 requests in shards of 8
    assert all(x["batch_id"] == batch_id and isinstance(x["shard_id"], int) for x in shard_lines)
    task_lines = [x for x in worker_lines if "conveyor.run_shard" in x["message"]]
    assert task_lines and all("shard_id" in x for x in task_lines)
