"""What the broker holds: the task ids of every shard message waiting in a queue or delivered
to a worker and not yet acknowledged. The reconciler re-sends shards that are in neither."""

from __future__ import annotations

import json
import time

import redis

from conveyor.dispatch.queues import QUEUE_PREFIX, is_redis_url, queue_owner

# kombu's Redis transport keeps delivered, unacknowledged messages in this hash, and the time
# of each delivery in this sorted set (both keyed by delivery tag)
UNACKED_KEY = "unacked"
UNACKED_INDEX_KEY = "unacked_index"


def _task_id(payload: bytes | str) -> str | None:
    try:
        message = json.loads(payload)
    except (ValueError, TypeError):
        return None
    if isinstance(message, list):  # unacked entries are [message, exchange, routing key]
        message = message[0] if message else {}
    headers = message.get("headers") if isinstance(message, dict) else None
    return headers.get("id") if isinstance(headers, dict) else None


def live_task_ids(
    broker_url: str, live_workers: set[str] | None = None, delivered_within: float | None = None
) -> set[str] | None:
    """Task ids held by a Redis broker; None for a broker we cannot look into.

    What waits in the own queue of a worker not in `live_workers` does not count: nobody will
    read it, so the reconciler re-sends those shards (the queue itself is left alone: a broker
    database shared by mistake must not lose another deployment's work). A delivered message
    counts only if it was delivered within `delivered_within` seconds: a worker starts what it
    takes at once (prefetch is off), so an older one whose shard never started was taken by a
    worker that died.
    """
    if not is_redis_url(broker_url):
        return None
    client = redis.Redis.from_url(broker_url)
    try:
        ids: set[str] = set()
        for key in client.scan_iter(match=QUEUE_PREFIX + "*", count=1000):
            if client.type(key) != b"list":
                continue
            owner = queue_owner(key.decode(errors="replace"))
            if owner is not None and live_workers is not None and owner not in live_workers:
                continue
            for payload in client.lrange(key, 0, -1):
                if (tid := _task_id(payload)) is not None:
                    ids.add(tid)
        cutoff = None if delivered_within is None else time.time() - delivered_within
        delivered_at = dict(client.zrange(UNACKED_INDEX_KEY, 0, -1, withscores=True))
        for tag, payload in client.hgetall(UNACKED_KEY).items():
            if cutoff is not None and delivered_at.get(tag, 0.0) < cutoff:
                continue
            if (tid := _task_id(payload)) is not None:
                ids.add(tid)
        return ids
    finally:
        client.close()


def ping(broker_url: str) -> None:
    """Raise if the broker cannot be reached."""
    if is_redis_url(broker_url):
        client = redis.Redis.from_url(broker_url, socket_connect_timeout=2, socket_timeout=2)
        try:
            client.ping()
        finally:
            client.close()
        return
    from kombu import Connection

    with Connection(broker_url, connect_timeout=2) as conn:
        conn.ensure_connection(max_retries=1)
