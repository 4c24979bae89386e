"""`waiting_in`: the task ids waiting in some queues of the broker, Redis or the embedded SQLite
one, on real servers; what a stopping worker reads from its own queues to hand them back."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.dispatch.broker import waiting_in
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
    assert waiting_in(url, [own]) == {"shard-1-1", "shard-2-3"}
    assert waiting_in(url, [own, shared]) == {"shard-1-1", "shard-2-3", "shard-4-1"}
    assert waiting_in(url, []) == set()
    assert waiting_in(url, [worker_queue(shared, "nobody")]) == set()
