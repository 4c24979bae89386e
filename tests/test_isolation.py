"""Hostile input and faulty engines stall nobody, on real API and worker processes.

Lines that no tokenizer or database can take are refused at the door; behind it, a request
the engine cannot take or whose result cannot be stored fails alone, a worker whose engine
dies withdraws at once and hands its shards back, and a shard that keeps killing its worker
is quarantined. Other projects' batches complete meanwhile.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import httpx
import sqlalchemy as sa
from services import Stack, batch_lines, download, submit_batch, wait_for, write_jsonl

from conveyor.settings import normalize_database_url
from worker.runtime import ENGINE_FAILED_EXIT

FAULTY_WORKER = str(Path(__file__).with_name("faulty_worker.py"))


def faulty(*faults: str) -> list[str]:
    """A launcher for `Stack.start_worker`: the real worker over an engine with `faults`."""
    return [FAULTY_WORKER, *faults, "--"]


def query(stack: Stack, sql: str, **params) -> list:
    engine = sa.create_engine(normalize_database_url(stack.env["DATABASE_URL"]))
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text(sql), params).all())
    finally:
        engine.dispose()


def every_line(api: str, batch: dict, headers: dict | None = None) -> list[dict]:
    """The batch's output and error lines; every custom_id of the input exactly once."""
    return download(api, batch["output_file_id"], headers) + download(
        api, batch["error_file_id"], headers
    )


def assert_each_once(lines: list[dict], wanted: list[dict]) -> dict[str, dict]:
    assert Counter(x["custom_id"] for x in lines) == Counter(x["custom_id"] for x in wanted)
    return {x["custom_id"]: x for x in lines}


# ---- the engine loop dies ---------------------------------------------------------------------


def test_a_worker_whose_engine_fails_withdraws_hands_back_and_exits(
    stack: Stack, tmp_path: Path
) -> None:
    stack.env["CONVEYOR_ECHO_STEP_SECONDS"] = "0.05"  # 4 requests a step: a batch of 10 steps
    api = stack.start_api()
    w1 = stack.start_worker(
        "w1", "echo", "--max-num-seqs", "4", launcher=faulty("--fail-after-steps", "6")
    )
    lines = batch_lines(40)
    batch_id = submit_batch(api, write_jsonl(tmp_path / "in.jsonl", lines))

    assert w1.wait(60) == ENGINE_FAILED_EXIT, stack.log("w1")[-3000:]
    # it stopped announcing itself and left no shard running, without any timeout passing
    assert query(stack, "SELECT id FROM workers") == []
    assert httpx.get(f"{api}/v1/models", timeout=10).json()["data"] == []
    assert query(stack, "SELECT id FROM shards WHERE status = 'running'") == []
    done_before = query(stack, "SELECT count(*) FROM results")[0][0]
    assert 0 < done_before < len(lines)  # what the engine finished was committed
    log = stack.log("w1")
    assert "the engine failed" in log and "handing back what is unfinished" in log

    started = time.time()
    stack.start_worker("w2", "echo")
    batch = wait_for(api, batch_id, timeout=120)
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
    assert_each_once(every_line(api, batch), lines)
    assert time.time() - started < 60
    by_worker = dict(query(stack, "SELECT worker, count(*) FROM results GROUP BY worker"))
    assert by_worker == {"w1": done_before, "w2": 40 - done_before}
