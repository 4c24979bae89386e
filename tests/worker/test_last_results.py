"""A shard's run ends `done` when the commit of its last results completes the batch, even if
its heartbeat reads the batch's new status before the writer wakes it: that run finished its
shard, so it counts as an attempt, and nothing of it is aborted or closed a second time."""

from __future__ import annotations

import time

import sqlalchemy as sa

from conveyor.ledger.db import Ledger
from conveyor.ledger.models import BatchRow, ResultRow, ShardRow
from conveyor.ledger.shard_lifecycle import shard_heartbeat
from conveyor.settings import Settings
from conveyor.testing import batch_lines
from conveyor.worker import runtime as runtime_module
from conveyor.worker.echo import ECHO_MODEL, EchoEngine
from conveyor.worker.runtime import WorkerRuntime
from tests.ledger.test_ledger import make_batch


def test_a_run_whose_last_commit_completes_the_batch_is_done(
    database_url, redis_url, tmp_path, monkeypatch
):
    settings = Settings(
        data_dir=tmp_path, database_url=database_url, redis_url=redis_url, heartbeat_interval=0.05
    )
    runtime = WorkerRuntime(settings, EchoEngine(), [ECHO_MODEL], name="w1")
    ledger = Ledger(database_url)
    batch_id, [(shard_id, _, _)] = make_batch(ledger, batch_lines(4), shard_size=4)
    close = runtime.writer._close
    held = []

    def close_and_hold(session, shards) -> None:
        # the transaction that commits the last results closes the shard and completes the
        # batch; it holds the shard's row for a while, as a loaded database does, so that
        # the shard's heartbeat waits on it and then reads the batch completed
        close(session, shards)
        held.append(time.monotonic())
        time.sleep(10 * settings.heartbeat_interval)

    runtime.writer._close = close_and_hold
    heartbeats = []

    def heartbeat(session, shard) -> str | None:
        heartbeats.append(shard_heartbeat(session, shard))
        return heartbeats[-1]

    monkeypatch.setattr(runtime_module, "shard_heartbeat", heartbeat)
    runtime.service.start()
    runtime.writer.start()
    try:
        assert runtime.run_shard(shard_id) == "done"
    finally:
        runtime.service.stop()
        runtime.writer.stop()
        runtime.writer.join(10)
        runtime.ledger.dispose()
    assert held, "the writer never closed the shard"
    with ledger.session() as session:
        shard = session.get(ShardRow, shard_id)
        batch = session.get(BatchRow, batch_id)
        results = session.execute(
            sa.select(sa.func.count()).where(ResultRow.batch_id == batch_id)
        ).scalar_one()
        assert (shard.status, shard.attempts, shard.worker) == ("done", 1, "w1")
        assert batch.status == "completed" and results == 4
    # the heartbeat did run during the hold: it is what read the batch completed
    assert "completed" in heartbeats
    ledger.dispose()


def test_who_closes_a_shard_is_settled_once():
    from conveyor.worker.writer import PendingResults

    # the task stops before the last results reach the writer: the task closes the shard
    shard = PendingResults(1, "batch_x", 3)
    assert shard.take_over()
    assert not shard.close_with(3)
    # the writer commits the last results: too late for the task to take over
    shard = PendingResults(2, "batch_x", 3)
    shard.committed(1)
    assert not shard.close_with(1)  # not the last: the task may still take over
    assert shard.close_with(2)
    assert not shard.take_over()
    # that commit failed and is split: its first half closes nothing, so the task may
    shard.committed(0)
    assert not shard.close_with(1)
    assert shard.take_over()
    assert not shard.close_with(2)
