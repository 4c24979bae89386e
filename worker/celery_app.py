"""The Celery app. Torch-free: the API imports it to send shard tasks.

Shard tasks go to one queue per model (`queue_for`). Tasks are acknowledged only after their
results are committed (`acks_late`), each worker thread takes one message at a time, and the
broker's visibility timeout is set alike everywhere Celery reads it.
"""

from __future__ import annotations

import hashlib
import re

from celery import Celery

from conveyor.settings import Settings
from ledger.transitions import Send

RUN_SHARD = "conveyor.run_shard"
QUEUE_PREFIX = "conveyor.model."
AFFINITY_SEP = ".w."  # a worker's own queue for a model: <model queue>.w.<worker name>


def queue_for(model: str) -> str:
    """The queue of shards for `model` (a served name or a path)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("_") or "model"
    if len(safe) > 80:
        safe = safe[:60] + "-" + hashlib.blake2b(model.encode(), digest_size=6).hexdigest()
    return QUEUE_PREFIX + safe


def worker_queue(model_queue: str, worker: str) -> str:
    """The queue only `worker` consumes, for the shards routed to it by prefix affinity."""
    return f"{model_queue}{AFFINITY_SEP}{worker}"


def queue_owner(queue: str) -> str | None:
    """The worker a per-worker queue belongs to; None for a shared model queue."""
    _, sep, worker = queue.partition(AFFINITY_SEP)
    return worker if sep else None


def make_celery(settings: Settings) -> Celery:
    app = Celery("conveyor", broker=settings.broker_url, include=["worker.tasks"])
    # the Redis transport reads the visibility timeout from its transport options (kombu's
    # SQLAlchemy transport, the embedded broker, hands its options to create_engine instead)
    redis = settings.broker_url.startswith(("redis://", "rediss://", "unix://"))
    visibility = {"visibility_timeout": settings.visibility_timeout} if redis else {}
    app.conf.update(
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        # take a message only when a thread is free to start it: a delivered shard is a
        # running shard, which is what lets the reconciler tell a dead worker's messages apart
        worker_disable_prefetch=True,
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


def send_shards(app: Celery, sends: list[Send]) -> None:
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
