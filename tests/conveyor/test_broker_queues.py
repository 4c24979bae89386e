"""`take_waiting`: the messages waiting in some queues of the broker, Redis or the embedded
SQLite one (real servers), taken out with their task ids: what a stopping worker does with its
own queues to hand their shards back. `live_task_ids`, the reconciler's look, sees the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.dispatch.broker import live_task_ids, take_waiting
from conveyor.dispatch.celery_app import make_celery, send_shards
from conveyor.dispatch.queues import queue_for, worker_queue
from conveyor.ledger.shard_lifecycle import ShardTask
from conveyor.settings import Settings


@pytest.fixture(params=["embedded", "redis"])
def broker_settings(request: pytest.FixtureRequest, tmp_path: Path) -> Settings:
    if request.param == "redis":
        return Settings(redis_url=request.getfixturevalue("redis_url"), data_dir=tmp_path)
    return Settings(redis_url=None, data_dir=tmp_path)


def test_the_ids_waiting_in_some_queues_and_not_others(broker_settings: Settings):
    shared = queue_for("tiny")
    own, other = worker_queue(shared, "w1"), worker_queue(shared, "w2")
    app = make_celery(broker_settings)
    send_shards(
        app,
        [
            ShardTask(1, "shard-1-1", own, "p"),
            ShardTask(2, "shard-2-3", own, "p"),
            ShardTask(3, "shard-3-1", other, "p"),
            ShardTask(4, "shard-4-1", shared, "p"),
        ],
    )
    url = broker_settings.broker_url
    assert take_waiting(url, []) == set()
    assert take_waiting(url, [worker_queue(shared, "nobody")]) == set()
    assert take_waiting(url, [own]) == {"shard-1-1", "shard-2-3"}
    assert take_waiting(url, [own]) == set()  # taken: gone from the broker
    assert live_task_ids(url) == {"shard-3-1", "shard-4-1"}  # the other queues keep theirs
    assert take_waiting(url, [other, shared]) == {"shard-3-1", "shard-4-1"}
    assert live_task_ids(url) == set()
