"""The reconciler: drives every unfinished batch from the ledger alone.

It expires batches past their completion window, finishes cancelled ones whose workers are
gone, finalizes batches whose requests all have results, notes running batches whose model no
live worker serves (and clears the note when one does), and re-sends every shard of an
in-progress batch that no broker message and no live worker carries (the broker restarted
empty, a send failed, a worker died). Workers run it at start and periodically; so does the
API. Re-sending is safe: a shard skips requests that already have results.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from dataclasses import dataclass

import redis
from celery import Celery

from conveyor.dispatch.broker import live_task_ids
from conveyor.dispatch.celery_app import send_shards
from conveyor.dispatch.queues import is_redis_url, queue_for
from conveyor.dispatch.routing import Router
from conveyor.ledger.batch_lifecycle import advance, batches_with_status, fail_unserved
from conveyor.ledger.db import Ledger
from conveyor.ledger.serving import note_serving, unserved_for
from conveyor.ledger.shard_lifecycle import mark_enqueued, shards_to_enqueue
from conveyor.ledger.states import BatchStatus
from conveyor.ledger.workers import workers_by_queue
from conveyor.settings import Settings

log = logging.getLogger(__name__)


@dataclass
class ReconcileReport:
    finalized: int = 0
    resent: int = 0


def reconcile(ledger: Ledger, app: Celery, settings: Settings) -> ReconcileReport:
    with _lock(settings) as held:
        if not held:
            return ReconcileReport()
        return _reconcile(ledger, app, settings)


def _reconcile(ledger: Ledger, app: Celery, settings: Settings) -> ReconcileReport:
    report = ReconcileReport()
    with ledger.session() as session:
        open_batches = batches_with_status(session, BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING)
    for batch_id in open_batches:
        with ledger.session() as session:
            if advance(session, batch_id, settings.heartbeat_timeout):
                report.finalized += 1
    with ledger.session() as session:
        workers = workers_by_queue(session, settings.heartbeat_timeout)
        note_serving(session, lambda model: queue_for(model) in workers)
    if settings.unserved_timeout:
        with ledger.session() as session:
            overdue = unserved_for(session, settings.unserved_timeout)
        for batch_id in overdue:
            with ledger.session() as session:
                if fail_unserved(session, batch_id, settings.unserved_timeout):
                    log.warning("batch %s failed: no live worker served its model", batch_id)
                    report.finalized += 1
    grace = max(5.0, settings.heartbeat_timeout)
    names = {w for names in workers.values() for w in names}

    @functools.cache
    def live() -> set[str] | None:  # read the broker once, and only if a shard is in doubt
        return live_task_ids(settings.broker_url, names, delivered_within=grace)

    sends = []
    with ledger.session() as session:
        for batch_id in batches_with_status(session, BatchStatus.IN_PROGRESS):
            lost = shards_to_enqueue(session, batch_id, live, grace, settings.heartbeat_timeout)
            sends += mark_enqueued(session, lost)
        sends = Router(workers, settings.broker_url, settings.affinity_backlog).route(sends)
    if sends:
        log.info("re-sending %d shard(s) that no broker message carries", len(sends))
        send_shards(app, sends)
        report.resent = len(sends)
    return report


LOCK_KEY = "conveyor:reconciler"
ROUND_LIMIT = 120.0  # seconds a round holds the lock at most


@contextlib.contextmanager
def _lock(settings: Settings):
    """One reconciler at a time across processes (a Redis lock; SQLite serializes anyway).
    The lock lives `heartbeat_timeout` seconds and its holder renews it while it works, so
    that a holder that dies mid-round (a worker killed) keeps the others from reconciling no
    longer than its shards wait anyway; a lock that outlived its holder by minutes held up
    every re-send for as long."""
    if not is_redis_url(settings.broker_url):
        yield True
        return
    client = redis.Redis.from_url(settings.broker_url)
    ttl = settings.heartbeat_timeout
    # renewed from another thread: the token is the lock's, not a thread's
    lock = client.lock(LOCK_KEY, timeout=ttl, blocking=False, thread_local=False)
    try:
        held = lock.acquire()
        if not held:
            yield False
            return
        renewal = _Renewal(lock, ttl)
        renewal.start()
        try:
            yield True
        finally:
            renewal.stop()
            with contextlib.suppress(redis.RedisError):
                lock.release()
    finally:
        client.close()


class _Renewal(threading.Thread):
    """Renews a held lock to `ttl` seconds three times a `ttl` until stopped, for `ROUND_LIMIT`
    seconds at most: a round stuck that long (a hung call in a live process) lets the lock
    expire rather than hold up every other reconciler for good."""

    def __init__(self, lock: redis.lock.Lock, ttl: float) -> None:
        super().__init__(name="conveyor-reconciler-lock", daemon=True)
        self.lock, self.ttl = lock, ttl
        self.stopped = threading.Event()

    def run(self) -> None:
        until = time.monotonic() + ROUND_LIMIT
        while not self.stopped.wait(self.ttl / 3):
            if time.monotonic() > until:
                log.warning(
                    "a reconcile round passed %.0f s; its lock is left to expire", ROUND_LIMIT
                )
                return
            try:
                self.lock.extend(self.ttl, replace_ttl=True)
            except redis.RedisError:  # lost (expired, or Redis down): the round ends unguarded
                log.warning("the reconciler's lock could not be renewed", exc_info=True)
                return

    def stop(self) -> None:
        self.stopped.set()
        self.join()


class ReconcilerLoop(threading.Thread):
    """Runs `reconcile` now and every `settings.reconcile_interval` seconds until stopped."""

    def __init__(self, ledger: Ledger, app: Celery, settings: Settings) -> None:
        super().__init__(name="conveyor-reconciler", daemon=True)
        self.ledger, self.app, self.settings = ledger, app, settings
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                reconcile(self.ledger, self.app, self.settings)
            except Exception:  # the database or broker is down: try again next round
                log.exception(
                    "reconcile failed; retrying in %.0fs", self.settings.reconcile_interval
                )
            self.stopped.wait(self.settings.reconcile_interval)

    def stop(self) -> None:
        self.stopped.set()
