"""Concurrency, cancellation and crash safety of the job service, on real Postgres and Redis."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx
import redis
import sqlalchemy as sa

from conveyor.settings import normalize_database_url
from conveyor.testing import Stack, batch_lines, download, wait_for, write_jsonl
from tests.system.test_service import submit

T = TypeVar("T")


def ledger(stack: Stack) -> sa.Engine:
    return sa.create_engine(normalize_database_url(stack.env["DATABASE_URL"]))


def result_count(stack: Stack, batch_id: str) -> int:
    engine = ledger(stack)
    try:
        with engine.connect() as conn:
            return conn.execute(
                sa.text("SELECT count(*) FROM results WHERE batch_id = :b"), {"b": batch_id}
            ).scalar_one()
    finally:
        engine.dispose()


def worker_stats(stack: Stack, name: str) -> dict:
    engine = ledger(stack)
    try:
        with engine.connect() as conn:
            raw = conn.execute(
                sa.text("SELECT stats FROM workers WHERE id = :w"), {"w": name}
            ).scalar_one_or_none()
    finally:
        engine.dispose()
    if raw is None:
        return {}
    return raw if isinstance(raw, dict) else json.loads(raw)


def running_shards(stack: Stack, batch_id: str, worker: str, unfinished: bool = False) -> int:
    """Shards `worker` holds as running; with `unfinished`, only those with a request that has no
    result yet (a shard whose last results are written but which is not closed has no work left)."""
    query = (
        "SELECT count(*) FROM shards s WHERE s.batch_id = :b AND s.worker = :w "
        "AND s.status = 'running'"
    )
    if unfinished:
        query += (
            " AND EXISTS (SELECT 1 FROM requests r LEFT JOIN results x ON x.request_id = r.id"
            " WHERE r.batch_id = s.batch_id AND r.shard_index = s.index AND x.seq IS NULL)"
        )
    engine = ledger(stack)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text(query), {"b": batch_id, "w": worker}).scalar_one()
    finally:
        engine.dispose()


def settled(read: Callable[[], T], interval: float = 0.5) -> T:
    """What `read` returns once two reads `interval` seconds apart agree."""
    last, now = None, read()
    while now != last:
        time.sleep(interval)
        last, now = now, read()
    return now


def wait_results(stack: Stack, batch_id: str, at_least: int, timeout: float = 120) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        n = result_count(stack, batch_id)
        if n >= at_least:
            return n
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} has fewer than {at_least} results after {timeout}s")


def assert_each_once(api: str, batch: dict, lines: list[dict]) -> list[dict]:
    outputs = download(api, batch["output_file_id"]) + download(api, batch["error_file_id"])
    counts = Counter(line["custom_id"] for line in outputs)
    assert counts == Counter(line["custom_id"] for line in lines), "every custom_id exactly once"
    return outputs


def test_two_batches_share_one_engine(stack: Stack, chat_model: Path, tmp_path: Path):
    api = stack.start_api()
    a_lines = batch_lines(16, system="System prompt A: be brief.", prefix="a", max_tokens=64)
    b_lines = batch_lines(16, system="System prompt B: be verbose.", prefix="b", max_tokens=64)
    # every line runs its full length (a random model can emit EOS at once): a batch whose
    # lines all ended in a few steps could finish before the other's shards were claimed
    for line in a_lines + b_lines:
        line["body"]["ignore_eos"] = True
    a = submit(api, write_jsonl(tmp_path / "a.jsonl", a_lines))
    b = submit(api, write_jsonl(tmp_path / "b.jsonl", b_lines))
    stack.start_worker("w1", chat_model, "--concurrency", "4")  # both wait in its queue
    pair = sorted([a["id"], b["id"]])
    mixed_steps = 0
    deadline = time.time() + 120
    while time.time() < deadline and not mixed_steps:
        for x, y, n in worker_stats(stack, "w1").get("co_scheduled", []):
            if [x, y] == pair:
                mixed_steps = n
        time.sleep(0.2)
    assert mixed_steps > 0, "no engine step held requests of both batches"
    for batch, lines in ((a, a_lines), (b, b_lines)):
        done = wait_for(api, batch["id"])
        assert done["status"] == "completed"
        assert_each_once(api, done, lines)


def test_cancel_mid_run(stack: Stack, chat_model: Path, tmp_path: Path):
    api = stack.start_api()
    stack.start_worker("w1", chat_model, "--concurrency", "2")
    lines = batch_lines(160, max_tokens=48)
    batch = submit(api, write_jsonl(tmp_path / "in.jsonl", lines))
    wait_results(stack, batch["id"], 4)
    cancelled = httpx.post(f"{api}/v1/batches/{batch['id']}/cancel").json()
    assert cancelled["status"] in ("cancelling", "cancelled")
    assert cancelled["cancelling_at"] is not None
    done = wait_for(api, batch["id"], timeout=60)
    assert done["status"] == "cancelled"
    counts = done["request_counts"]
    assert counts["total"] == 160
    assert counts["completed"] + counts["failed"] == 160
    assert 4 <= counts["completed"] < 160
    outputs = assert_each_once(api, done, lines)
    skipped = [o for o in outputs if o["error"] and o["error"]["code"] == "batch_cancelled"]
    assert len(skipped) == counts["failed"] > 0
    # no further work: the result count and the engine's generated tokens stay put
    n = result_count(stack, batch["id"])
    time.sleep(2.5)  # the worker publishes its stats every second
    before = worker_stats(stack, "w1").get("generation_tokens")
    time.sleep(3)
    assert result_count(stack, batch["id"]) == n
    after = worker_stats(stack, "w1")
    assert after.get("generation_tokens") == before and after.get("in_flight") == 0
    # cancelling twice is harmless; a finished batch cannot be cancelled again
    again = httpx.post(f"{api}/v1/batches/{batch['id']}/cancel").json()
    assert again["status"] == "cancelled"


def test_worker_sigkill_mid_batch(stack: Stack, chat_model: Path, tmp_path: Path):
    api = stack.start_api()
    stack.start_worker("w1", chat_model, "--concurrency", "4")
    # every line runs its full length (a random model can emit EOS early): 4 rounds of 4 shards
    # x 96 steps, so 3 are left when the first round's results appear
    lines = batch_lines(120, max_tokens=96)
    for line in lines:
        line["body"]["ignore_eos"] = True
    batch = submit(api, write_jsonl(tmp_path / "in.jsonl", lines))
    wait_results(stack, batch["id"], 10)
    deadline = time.time() + 60
    while running_shards(stack, batch["id"], "w1", unfinished=True) == 0:  # mid-shard
        assert time.time() < deadline, "w1 ran no shard for 60 s"
        time.sleep(0.05)
    stack.kill("w1")
    # what it had claimed and not finished: a shard whose results were all written when it died
    # has nothing to run again (the batch may complete before the reconciler would resend it).
    # A COMMIT the server had received when the process died still lands just after: read once
    # two reads half a second apart agree
    running, partial = settled(
        lambda: (running_shards(stack, batch["id"], "w1", True), result_count(stack, batch["id"]))
    )
    assert running > 0, "w1 died between shards; kill it mid-shard"
    assert partial < 120, "the batch finished before the kill; make it longer"
    stack.start_worker("w2", chat_model, "--concurrency", "4")
    done = wait_for(api, batch["id"], timeout=240)
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 120, "completed": 120, "failed": 0, "reused": 0}
    assert_each_once(api, done, lines)
    engine = ledger(stack)
    with engine.connect() as conn:
        workers = dict(
            conn.execute(
                sa.text("SELECT worker, count(*) FROM results WHERE batch_id = :b GROUP BY worker"),
                {"b": batch["id"]},
            ).all()
        )
        retried = conn.execute(
            sa.text("SELECT count(*) FROM shards WHERE batch_id = :b AND attempts > 1"),
            {"b": batch["id"]},
        ).scalar_one()
    engine.dispose()
    assert set(workers) == {"w1", "w2"} and workers["w1"] == partial
    assert retried >= running  # shards w1 was running when it died ran again on w2


def test_redis_emptied_mid_batch(stack: Stack, chat_model: Path, tmp_path: Path):
    api = stack.start_api()
    stack.start_worker("w1", chat_model, "--concurrency", "2")
    lines = batch_lines(120, max_tokens=24)
    batch = submit(api, write_jsonl(tmp_path / "in.jsonl", lines))
    wait_results(stack, batch["id"], 5)
    client = redis.Redis.from_url(stack.env["REDIS_URL"])
    queued = sum(
        client.llen(k)
        for k in client.scan_iter(match="conveyor.model.*")
        if client.type(k) == b"list"
    )
    assert queued > 0, "nothing was waiting in Redis; make the batch longer"
    client.flushdb()  # all the service's keys (its own database: tests run side by side)
    client.close()
    done = wait_for(api, batch["id"], timeout=240)
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 120, "completed": 120, "failed": 0, "reused": 0}
    assert_each_once(api, done, lines)


def test_unserved_model_waits_then_expires(stack: Stack, chat_model: Path, tmp_path: Path):
    api = stack.start_api()
    stack.start_worker("w1", chat_model)  # serves "tiny", not "nobody"
    lines = batch_lines(5, model="nobody")
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    with open(path, "rb") as f:
        file_id = httpx.post(f"{api}/v1/files", files={"file": f}, data={"purpose": "batch"}).json()
    batch = httpx.post(
        f"{api}/v1/batches",
        json={
            "input_file_id": file_id["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "4s",
        },
    ).json()
    assert batch["status"] == "in_progress" and batch["model"] == "nobody"
    time.sleep(2)
    assert httpx.get(f"{api}/v1/batches/{batch['id']}").json()["status"] == "in_progress"
    done = wait_for(api, batch["id"], timeout=30)
    assert done["status"] == "expired" and done["expired_at"] >= batch["expires_at"]
    assert done["request_counts"] == {"total": 5, "completed": 0, "failed": 5, "reused": 0}
    outputs = assert_each_once(api, done, lines)
    assert {o["error"]["code"] for o in outputs} == {"batch_expired"}


def test_visibility_timeout_is_set_everywhere_celery_reads_it():
    from conveyor.dispatch.celery_app import make_celery
    from conveyor.settings import Settings

    conf = make_celery(Settings(redis_url="redis://127.0.0.1:6379/0", visibility_timeout=321)).conf
    assert conf.broker_transport_options["visibility_timeout"] == 321
    assert conf.result_backend_transport_options["visibility_timeout"] == 321
    assert conf.visibility_timeout == 321
    assert conf.task_acks_late and conf.worker_prefetch_multiplier == 1
    assert conf.worker_disable_prefetch
