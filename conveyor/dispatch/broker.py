"""What the broker holds: the task ids of every shard message waiting in a queue or delivered
to a worker and not yet acknowledged. The reconciler re-sends shards that are in neither."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Iterator

import redis
import sqlalchemy as sa

from conveyor.dispatch.queues import EMBEDDED_SCHEME, QUEUE_PREFIX, is_redis_url, queue_owner

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
    """Task ids held by the broker (Redis, or the embedded SQLite one); None for a broker we
    cannot look into.

    What waits in the own queue of a worker not in `live_workers` does not count: nobody will
    read it, so the reconciler re-sends those shards (the queue itself is left alone: a broker
    database shared by mistake must not lose another deployment's work). A delivered message
    counts only if it was delivered within `delivered_within` seconds: a worker starts what it
    takes at once (prefetch is off), so an older one whose shard never started was taken by a
    worker that died.
    """
    if broker_url.startswith(EMBEDDED_SCHEME):
        return _waiting_in_embedded_broker(broker_url, live_workers)
    if not is_redis_url(broker_url):
        return None
    client = redis.Redis.from_url(broker_url)
    try:
        ids: set[str] = set()
        for key in client.scan_iter(match=QUEUE_PREFIX + "*", count=1000):
            if client.type(key) != b"list":
                continue
            if _read(key.decode(errors="replace"), live_workers):
                ids.update(_task_ids(client.lrange(key, 0, -1)))
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


def _read(queue: str, live_workers: set[str] | None) -> bool:
    """Whether someone will read `queue`: not the own queue of a worker that is gone."""
    owner = queue_owner(queue)
    return owner is None or live_workers is None or owner in live_workers


def _task_ids(payloads: Iterable[bytes | str]) -> set[str]:
    return {tid for payload in payloads if (tid := _task_id(payload)) is not None}


def _waiting_in_embedded_broker(broker_url: str, live_workers: set[str] | None) -> set[str]:
    """Task ids of the messages waiting in kombu's SQLAlchemy broker (the embedded one). It
    never delivers a taken message again, acknowledged or not, so a taken one carries nothing:
    a worker starts what it takes at once, and a shard still queued long after its message was
    taken lost it with a worker that stopped."""
    with _embedded_broker(broker_url) as conn:
        rows = _embedded_messages(conn)
    return _task_ids(payload for _, queue, payload in rows if _read(queue, live_workers))


@contextlib.contextmanager
def _embedded_broker(broker_url: str) -> Iterator[sa.Connection]:
    """A connection to the embedded SQLite broker, in one transaction."""
    engine = sa.create_engine(broker_url.removeprefix(EMBEDDED_SCHEME))
    try:
        with engine.begin() as conn:
            yield conn
    finally:
        engine.dispose()


def _embedded_messages(conn: sa.Connection) -> list[tuple[int, str, str]]:
    """(id, queue, payload) of each message waiting in the embedded broker."""
    if not sa.inspect(conn).has_table("kombu_message"):
        return []
    rows = conn.execute(
        sa.text(
            "SELECT m.id, q.name, m.payload FROM kombu_message m "
            "JOIN kombu_queue q ON q.id = m.queue_id WHERE m.visible"
        )
    )
    return [(id_, queue, payload) for id_, queue, payload in rows]


def take_waiting(broker_url: str, queues: Iterable[str]) -> set[str]:
    """Take the messages waiting in `queues` out of the broker (Redis, or the embedded SQLite
    one; none from another broker) and return their task ids: for a worker emptying its own
    queues as it stops, which no one else reads."""
    names = list(queues)
    if not names:
        return set()
    if is_redis_url(broker_url):
        client = redis.Redis.from_url(broker_url)
        try:
            with client.pipeline(transaction=True) as pipe:
                for name in names:
                    pipe.lrange(name, 0, -1)
                    pipe.delete(name)
                replies = pipe.execute()
        finally:
            client.close()
        return _task_ids(payload for reply in replies[0::2] for payload in reply)
    if not broker_url.startswith(EMBEDDED_SCHEME):
        return set()
    with _embedded_broker(broker_url) as conn:
        messages = _embedded_messages(conn)
        taken = [(id_, payload) for id_, queue, payload in messages if queue in names]
        if taken:
            conn.execute(
                sa.text("DELETE FROM kombu_message WHERE id IN :ids").bindparams(
                    sa.bindparam("ids", expanding=True)
                ),
                {"ids": [id_ for id_, _ in taken]},
            )
    return _task_ids(payload for _, payload in taken)


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
