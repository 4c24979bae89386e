"""The Celery app. Torch-free: the API imports it to send shard tasks.

Shard tasks go to one queue per model (`queues.queue_for`). Tasks are acknowledged only after their
results are committed (`acks_late`), each worker thread takes one message at a time, and the
broker's visibility timeout is set alike everywhere Celery reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery import Celery
from kombu.transport import sqlalchemy as sqlalchemy_transport

from conveyor.dispatch.queues import EMBEDDED_SCHEME, QUEUE_PREFIX, is_redis_url
from conveyor.ledger.shard_lifecycle import ShardTask
from conveyor.settings import Settings

RUN_SHARD = "conveyor.run_shard"


class EmbeddedBroker(sqlalchemy_transport.Transport):
    """kombu's SQLAlchemy transport (the embedded SQLite broker), polling every 0.2 s instead
    of every second: a worker then takes a new shard sooner, and its consumer loop ends within
    a fraction of a second of Ctrl-C. (That transport hands its options to `create_engine`, so
    `polling_interval` cannot go there.)"""

    polling_interval = 0.2

    def drain_events(self, connection: Any, timeout: float | None = None) -> None:
        # Celery's consumer loop looks for a shutdown (SIGTERM's) between two calls, each
        # polling for up to 2 s: one poll's wait instead, so that the loop ends within a
        # fraction of a second where it took 2-4 s
        if timeout is not None:
            timeout = min(timeout, self.polling_interval)
        super().drain_events(connection, timeout=timeout)


def make_celery(settings: Settings, tasks: Sequence[str] = ()) -> Celery:
    """The app for `settings`' broker; a worker names the modules of its `tasks` (senders need
    none: they send by task name)."""
    broker = settings.broker_url
    embedded = broker.startswith(EMBEDDED_SCHEME)
    app = Celery("conveyor", broker=broker.removeprefix(EMBEDDED_SCHEME), include=list(tasks))
    if embedded:
        app.conf.broker_transport = EmbeddedBroker
    # the Redis transport reads the visibility timeout from its transport options (kombu's
    # SQLAlchemy transport, the embedded broker, hands its options to create_engine instead)
    redis = is_redis_url(settings.broker_url)
    visibility = {"visibility_timeout": settings.visibility_timeout} if redis else {}
    app.conf.update(
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        # take a message only when a thread is free to start it: a delivered shard is a
        # running shard, which is what lets the reconciler tell a dead worker's messages apart
        # (Celery has it for Redis alone, and warns that it ignores it on the embedded broker)
        worker_disable_prefetch=redis,
        worker_cancel_long_running_tasks_on_connection_loss=True,
        broker_connection_retry_on_startup=True,
        broker_transport_options=dict(visibility),
        result_backend_transport_options=dict(visibility),
        visibility_timeout=settings.visibility_timeout,
        task_default_queue=QUEUE_PREFIX + "default",
        worker_hijack_root_logger=False,
        task_serializer="json",
        accept_content=["json"],
    )
    return app


def send_shards(app: Celery, sends: list[ShardTask]) -> None:
    """Send shard tasks; one that fails to go out is left to the reconciler."""
    with app.producer_or_acquire() as producer:
        for send in sends:
            app.send_task(
                RUN_SHARD,
                args=[send.shard_id],
                task_id=send.task_id,
                queue=send.queue,
                producer=producer,
            )
