"""The queues shard tasks go to: one shared queue per model, and one per worker for the shards
routed to it by prefix affinity."""

from __future__ import annotations

import hashlib
import re

QUEUE_PREFIX = "conveyor.model."
AFFINITY_SEP = ".w."  # a worker's own queue for a model: <model queue>.w.<worker name>
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
EMBEDDED_SCHEME = "sqla+"  # kombu's SQLAlchemy transport: the embedded SQLite broker


def is_redis_url(url: str) -> bool:
    """Whether the broker is Redis (which we can look into), not the embedded SQLite one."""
    return url.startswith(REDIS_SCHEMES)


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
