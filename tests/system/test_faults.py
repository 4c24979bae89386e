"""Faults in the middle of a batch: a worker told to stop (SIGTERM), Redis restarted with its
data gone, PostgreSQL restarted. Each time the batch completes and every custom_id has exactly
one result."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import sqlalchemy as sa

from conveyor.settings import normalize_database_url
from conveyor.testing import (
    LocalPostgres,
    LocalRedis,
    Stack,
    batch_lines,
    stack_env,
    submit_batch,
    write_jsonl,
)
from conveyor.testing.databases import migrate
from conveyor.testing.servers import throwaway


def get(api: str, batch_id: str) -> dict:
    for _ in range(100):  # the API may be restarting its connections
        try:
            return httpx.get(f"{api}/v1/batches/{batch_id}", timeout=10).json()
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError("the API did not answer")


def wait_until(api: str, batch_id: str, done: int, timeout: float = 120) -> dict:
    """The batch once at least `done` requests have results (or it ended)."""
    deadline = time.time() + timeout
    while True:
        batch = get(api, batch_id)
        counts = batch["request_counts"]
        if counts["completed"] + counts["failed"] >= done or batch["status"] != "in_progress":
            return batch
        assert time.time() < deadline, batch
        time.sleep(0.1)


def assert_exactly_once(api: str, batch: dict, lines: list[dict], database_url: str) -> None:
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {
        "total": len(lines),
        "completed": len(lines),
        "failed": 0,
        "reused": 0,
    }
    out = httpx.get(f"{api}/v1/files/{batch['output_file_id']}/content", timeout=60).text
    ids = [json.loads(x)["custom_id"] for x in out.splitlines()]
    assert sorted(ids) == sorted(x["custom_id"] for x in lines)  # each exactly once
    engine = sa.create_engine(normalize_database_url(database_url))
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT count(*) FROM results WHERE batch_id = :b"), {"b": batch["id"]}
        ).scalar_one()
    engine.dispose()
    assert rows == len(lines)


def trickling_batch(n: int = 160) -> list[dict]:
    lines = batch_lines(n)
    for i, line in enumerate(lines):  # short ones finish early, long ones are still running
        line["body"]["max_tokens"] = 4 + 40 * (i % 16)
    return lines


def start_mid_batch(stack: Stack, model: Path, tmp_path: Path) -> tuple[str, str, list, dict]:
    """An API and a worker running a batch that has some results and is far from done:
    (api, batch id, its lines, its request counts then)."""
    api = stack.start_api()
    stack.start_worker("w1", model, "--concurrency", "4")
    lines = trickling_batch()
    batch_id = submit_batch(api, write_jsonl(tmp_path / "in.jsonl", lines))
    counts = wait_until(api, batch_id, 8)["request_counts"]
    assert counts["completed"] < len(lines)
    return api, batch_id, lines, counts


def test_worker_sigterm_hands_back_what_is_unfinished(
    stack: Stack, chat_model: Path, tmp_path: Path, database_url: str
) -> None:
    # three long shards that cannot finish within the 1 s the worker gets after SIGTERM
    stack.env.update(CONVEYOR_SHUTDOWN_TIMEOUT="1", CONVEYOR_SHARD_SIZE="64")
    api, batch_id, lines, at_signal = start_mid_batch(stack, chat_model, tmp_path)

    started = time.time()
    stack.kill("w1", signal.SIGTERM)
    took = time.time() - started
    assert stack.workers["w1"].returncode == 0, stack.log("w1")  # a clean exit, not a crash
    assert took < 20, took  # 1 s to finish, then the hand-back
    log = stack.log("w1")
    assert "handing back its unfinished requests" in log, log[-3000:]
    left = get(api, batch_id)
    assert left["status"] == "in_progress"
    assert left["request_counts"]["completed"] >= at_signal["completed"]  # what finished stays

    stack.start_worker("w2", chat_model)
    batch = wait_done(api, batch_id)
    assert_exactly_once(api, batch, lines, database_url)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[LocalRedis]:
    (tmp_path / "redis").mkdir()
    server = LocalRedis(tmp_path / "redis")
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def private_postgres() -> Iterator[LocalPostgres]:
    with throwaway(LocalPostgres, "conveyor-pg-") as server:
        migrate(server.url)
        yield server


def test_redis_restarted_with_its_data_gone(
    private_redis: LocalRedis, database_url: str, chat_model: Path, tmp_path: Path
) -> None:
    stack = Stack(env=stack_env(database_url, private_redis.url, tmp_path), root=tmp_path)
    try:
        api, batch_id, lines, _ = start_mid_batch(stack, chat_model, tmp_path)

        client = redis.Redis.from_url(private_redis.url)
        client.set("conveyor-test-sentinel", 1)
        private_redis.kill()  # every queued message is gone with it
        time.sleep(1.0)
        private_redis.start()
        assert client.get("conveyor-test-sentinel") is None  # a server with none of the data

        batch = wait_done(api, batch_id)
        assert_exactly_once(api, batch, lines, database_url)
    finally:
        stack.stop()


def test_postgres_restarted_mid_batch(
    private_postgres: LocalPostgres, redis_url: str, chat_model: Path, tmp_path: Path
) -> None:
    url = private_postgres.url
    stack = Stack(env=stack_env(url, redis_url, tmp_path), root=tmp_path)
    try:
        api, batch_id, lines, _ = start_mid_batch(stack, chat_model, tmp_path)

        private_postgres.stop("fast")  # connections drop; results pile up in the writer
        down = httpx.get(f"{api}/v1/batches/{batch_id}", timeout=30)
        assert down.status_code == 503, down.text  # said plainly, not a 500
        time.sleep(2.0)
        private_postgres.start()

        batch = wait_done(api, batch_id)
        assert_exactly_once(api, batch, lines, url)
        assert "could not commit" in stack.log("w1")  # the writer did retry
    finally:
        stack.stop()


def wait_done(api: str, batch_id: str, timeout: float = 300) -> dict:
    deadline = time.time() + timeout
    while (batch := get(api, batch_id))["status"] not in ("completed", "failed", "expired"):
        assert time.time() < deadline, batch
        time.sleep(0.3)
    return batch
