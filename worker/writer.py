"""The result writer: one thread that commits results to the ledger in batches.

The engine never waits on the database. Results queue up here and are inserted many per
transaction; a shard's tally counts down only after its rows are committed, which is what lets
a shard task acknowledge its message safely. The transaction that commits a shard's last
result also closes the shard (and completes its batch if it was the last one), so a shard
costs no transaction of its own at the end. When the database is unreachable the writer keeps
the pending rows and retries with backoff, so a database restart loses nothing.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ledger import transitions as tr
from ledger.db import Ledger

log = logging.getLogger(__name__)


class ShardTally:
    """A running shard's results not yet committed.

    The writer closes the shard in the transaction that commits its last result, unless the
    shard's task took that over (`take_over`: it stopped early and closes the shard itself).
    """

    def __init__(self, shard_id: int, batch_id: str, n: int) -> None:
        self.shard_id, self.batch_id = shard_id, batch_id
        self.left = n
        self.writer_closes = True
        self.cond = threading.Condition()

    def committed(self, n: int) -> None:
        with self.cond:
            self.left -= n
            if self.left <= 0:  # only the last commit wakes the shard's thread
                self.cond.notify_all()

    def wait(self, timeout: float) -> bool:
        """True once every result is committed; False after `timeout` seconds."""
        with self.cond:
            return self.cond.wait_for(lambda: self.left <= 0, timeout)

    def take_over(self) -> None:
        with self.cond:
            self.writer_closes = False


@dataclass
class WriteItem:
    row: dict[str, Any]  # a `results` row
    shard: ShardTally


class ResultWriter(threading.Thread):
    def __init__(
        self,
        ledger: Ledger,
        heartbeat_timeout: float,
        max_rows: int = 1000,
        max_delay: float = 0.01,
        on_lag: Callable[[float], None] | None = None,
    ) -> None:
        super().__init__(name="conveyor-result-writer", daemon=True)
        self.ledger = ledger
        self.heartbeat_timeout = heartbeat_timeout  # for batches completed here
        self.max_rows, self.max_delay = max_rows, max_delay
        self.items: queue.SimpleQueue[WriteItem] = queue.SimpleQueue()
        self.stopped = threading.Event()
        self.committed = 0
        self.started_batches: set[str] = set()  # batches whose first result is recorded
        self.lag = 0.0  # seconds the last committed batch of rows waited
        self.on_lag = on_lag  # called with each committed row's wait, in seconds

    def put(self, item: WriteItem) -> None:
        self.items.put(item)

    def stop(self) -> None:
        self.stopped.set()

    def run(self) -> None:
        while not (self.stopped.is_set() and self.items.empty()):
            batch = self._collect()
            if batch:
                self._commit(batch)

    def _collect(self) -> list[WriteItem]:
        try:
            first = self.items.get(timeout=0.2)
        except queue.Empty:
            return []
        batch = [first]
        deadline = time.monotonic() + self.max_delay
        while len(batch) < self.max_rows:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                batch.append(self.items.get(timeout=remaining))
            except queue.Empty:
                break
        return batch

    def _commit(self, batch: list[WriteItem]) -> None:
        per_shard = Counter(item.shard for item in batch)
        # shards whose last results are these: closed in the same transaction
        closing = [t for t, n in per_shard.items() if t.writer_closes and t.left == n]
        delay = 0.2
        while True:
            try:
                with self.ledger.session() as session:
                    tr.record_results(session, [item.row for item in batch], self.started_batches)
                    if closing:
                        tr.close_shards(
                            session,
                            [(t.shard_id, t.batch_id) for t in closing],
                            self.heartbeat_timeout,
                        )
                break
            except Exception as err:
                log.warning(
                    "could not commit %d results (%s); retrying in %.1fs",
                    len(batch),
                    type(err).__name__,
                    delay,
                )
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        self.started_batches.update(item.row["batch_id"] for item in batch)
        self.committed += len(batch)
        now = time.time()
        self.lag = now - min(item.row["created_at"] for item in batch)
        if self.on_lag is not None:
            for item in batch:
                self.on_lag(now - item.row["created_at"])
        for tally, n in per_shard.items():
            tally.committed(n)
