"""Prefix-affinity routing: shards with the same prefix key go to the same live worker.

Each worker consumes the shared queue of its model and a queue of its own. A shard goes to the
own queue of the worker that rendezvous hashing of its prefix key picks among the live workers
of the model, so that worker's prefix cache serves every request with that prefix; when that
queue already holds `backlog` shards, or no worker is live, the shard goes to the shared queue,
where any idle worker takes it. When a worker dies, the reconciler drops its queue and re-sends
what was in it, and the hash moves its prefixes to the remaining workers.
"""

from __future__ import annotations

import hashlib
from collections import Counter

import redis

from conveyor.dispatch.queues import is_redis_url, worker_queue
from conveyor.ledger.shard_lifecycle import ShardTask

DEFAULT_BACKLOG = 16  # shards waiting in one worker's own queue before others get the overflow


def owner(prefix_key: str, workers: list[str]) -> str:
    """Rendezvous (highest random weight) hashing: stable as workers come and go."""
    return max(workers, key=lambda w: hashlib.blake2b(f"{prefix_key}|{w}".encode()).digest())


class Router:
    def __init__(
        self, workers: dict[str, list[str]], broker_url: str, backlog: int = DEFAULT_BACKLOG
    ) -> None:
        self.workers = workers
        self.backlog = backlog
        self.queued: Counter[str] = Counter()
        self.broker_url = broker_url
        self._measured: set[str] = set()

    def _waiting(self, queue: str) -> int:
        if queue not in self._measured:
            self._measured.add(queue)
            if is_redis_url(self.broker_url):
                client = redis.Redis.from_url(self.broker_url)
                try:
                    self.queued[queue] += int(client.llen(queue))
                finally:
                    client.close()
        return self.queued[queue]

    def route(self, sends: list[ShardTask]) -> list[ShardTask]:
        for send in sends:
            candidates = self.workers.get(send.queue)
            if not candidates:
                continue  # nobody serves it now: the shared queue keeps it
            target = worker_queue(send.queue, owner(send.prefix_key, sorted(candidates)))
            if self._waiting(target) < self.backlog:
                self.queued[target] += 1
                send.queue = target
        return sends
