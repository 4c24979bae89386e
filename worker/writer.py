"""The result writer: one thread that commits results to the ledger in batches.

The engine never waits on the database. Results queue up here and are inserted many per
transaction; a shard's pending results count down only after their rows are committed, which
is what lets a shard task acknowledge its message safely. The transaction that commits a
shard's last result also closes the shard (and completes its batch if it was the last one), so
a shard costs no transaction of its own at the end. When the database is unreachable the
writer keeps the pending rows and retries with backoff, so a database restart loses nothing.

Any other error is taken to be about the rows, and one row must not hold up the others: the
commit is split until the row that cannot be stored is alone, and that row is replaced by its
request's error line (`internal_error`), written so that it always stores.
"""

from __future__ import annotations

import enum
import json
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from conveyor.ledger.db import Ledger, until_reached
from conveyor.ledger.results import record_results, result_row
from conveyor.ledger.shard_lifecycle import close_shards
from conveyor.wire_format.errors import INTERNAL_ERROR
from conveyor.wire_format.result_lines import build_error_line
from conveyor.wire_format.text import unstorable

log = logging.getLogger(__name__)


class Closer(enum.Enum):
    """Who closes a running shard, settled under `PendingResults`' lock."""

    WRITER = "writer"  # the writer, in the commit of the shard's last results
    WRITER_NOW = "writer now"  # the writer is committing those results: too late to take over
    TASK = "task"  # the shard's task, which stopped early (`take_over`)


class PendingResults:
    """A running shard's results not yet committed.

    The writer closes the shard in the transaction that commits its last result, unless the
    shard's task took that over (`take_over`: it stopped early and closes the shard itself).
    Which of the two closes it is settled once, under the lock: a task that stops while the
    writer commits the last results (it saw the batch completed by that very commit) finds
    the shard finished, not stopped.
    """

    def __init__(self, shard_id: int, batch_id: str, n: int) -> None:
        self.shard_id, self.batch_id = shard_id, batch_id
        self.left = n
        self.closer = Closer.WRITER
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

    def take_over(self) -> bool:
        """The shard's task closes the shard itself; False when that is too late: the writer
        is committing the shard's last results and closes it."""
        with self.cond:
            if self.closer is Closer.WRITER_NOW:
                return False
            self.closer = Closer.TASK
            return True

    def close_with(self, n: int) -> bool:
        """Whether the writer closes the shard in the commit of these `n` results: they are
        its last, and its task has not taken the close over. A commit that fails is split and
        retried, so a later call with fewer rows hands the close back to a later commit."""
        with self.cond:
            if self.closer is Closer.TASK:
                return False
            self.closer = Closer.WRITER_NOW if self.left == n else Closer.WRITER
            return self.closer is Closer.WRITER_NOW


@dataclass
class WriteItem:
    row: dict[str, Any]  # a `results` row
    shard: PendingResults
    custom_id: str | None = None  # the request's, for the error line that replaces an
    line: int | None = None  # unstorable row


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
        # a Queue, not a SimpleQueue: CPython's SimpleQueue.get(timeout=...) waits forever once
        # a signal interrupts it past its deadline (a SIGTERM to this thread after SIGSTOP and
        # SIGCONT), and then stop() never ends this thread
        self.items: queue.Queue[WriteItem] = queue.Queue()
        self.stopped = threading.Event()
        self.received = 0
        self.committed = 0  # rows settled: stored, or replaced by their error lines
        self.settled = threading.Condition()
        self.started_batches: set[str] = set()  # batches whose first result is recorded
        self.lag = 0.0  # seconds the last committed batch of rows waited
        self.on_lag = on_lag  # called with each committed row's wait, in seconds

    def put(self, item: WriteItem) -> None:
        with self.settled:
            self.received += 1
        self.items.put(item)

    def drain(self, timeout: float) -> bool:
        """Wait until every row put so far is committed; False if that takes over `timeout`
        seconds."""
        with self.settled:
            target = self.received
            return self.settled.wait_for(lambda: self.committed >= target, timeout)

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
        closing = [t for t, n in per_shard.items() if t.close_with(n)]

        def record_and_close(session: Session) -> None:
            self._record(session, batch)
            if closing:
                self._close(session, closing)

        try:
            self._until_reached(record_and_close, f"{len(batch)} results")
        except Exception as err:  # about the rows, not the database: store them apart
            log.warning(
                "could not commit %d results (%s: %s); committing them apart",
                len(batch),
                type(err).__name__,
                _one_line(err),
            )
            self._store_apart(batch, err)
            if closing:
                try:
                    self._until_reached(lambda session: self._close(session, closing), "shards")
                except Exception:  # the reconciler re-sends them; their runs close them
                    log.exception("could not close %d shard(s)", len(closing))
        self.started_batches.update(item.row["batch_id"] for item in batch)
        with self.settled:
            self.committed += len(batch)
            self.settled.notify_all()
        now = time.time()
        self.lag = now - min(item.row["created_at"] for item in batch)
        if self.on_lag is not None:
            for item in batch:
                self.on_lag(now - item.row["created_at"])
        for pending, n in per_shard.items():
            pending.committed(n)

    def _record(self, session: Session, items: list[WriteItem]) -> None:
        record_results(session, [item.row for item in items], self.started_batches)

    def _close(self, session: Session, shards: list[PendingResults]) -> None:
        close_shards(session, [(t.shard_id, t.batch_id) for t in shards], self.heartbeat_timeout)

    def _until_reached(self, work: Callable[[Session], None], what: str = "results") -> None:
        until_reached(self.ledger, work, what)

    def _store_apart(self, items: list[WriteItem], err: Exception) -> None:
        """Store `items`, which failed together with `err`, in halves until the rows that
        cannot be stored are alone; each of those is replaced by its error line."""
        if len(items) == 1:
            self._store_alone(items[0], err)
            return
        half = len(items) // 2
        for part in (items[:half], items[half:]):
            try:
                self._until_reached(
                    lambda session, part=part: self._record(session, part),
                    f"{len(part)} results",
                )
            except Exception as part_err:
                self._store_apart(part, part_err)

    def _store_alone(self, item: WriteItem, err: Exception) -> None:
        """`item`'s row failed alone with `err`: store its error line instead. If the ledger
        refuses even that, the fault is the database's, not the row's: wait and try the row
        again."""
        delay = 0.2
        while not self._store_error_line(item, err):
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
            try:
                self._until_reached(lambda session: self._record(session, [item]), "a result")
                return
            except Exception as again:
                err = again

    def _store_error_line(self, item: WriteItem, err: Exception) -> bool:
        """Whether `item` is settled: its error line stored, or its request gone."""
        row = error_row(item, err)
        try:
            self._until_reached(lambda session: record_results(session, [row]), "an error line")
        except (IntegrityError, psycopg.IntegrityError):  # its request was deleted: no result
            log.warning("request %s is gone; its result is dropped", row["request_id"])
            return True
        except Exception as refused:
            log.warning(
                "request %s: not even its error line could be stored (%s: %s); retrying",
                row["request_id"],
                type(refused).__name__,
                _one_line(refused),
            )
            return False
        log.error(
            "request %s: its result could not be stored (%s: %s); it has an error line instead",
            row["request_id"],
            type(err).__name__,
            _one_line(err),
        )
        return True


def error_row(item: WriteItem, err: Exception) -> dict[str, Any]:
    """The `results` row that stands for `item`'s when that cannot be stored: an error line,
    and in every other column a value the ledger made or can hold."""
    row = item.row
    custom_id = item.custom_id
    if custom_id is None:  # the row's own line says it
        try:
            custom_id = json.loads(row["output"]).get("custom_id")
        except Exception:
            custom_id = None
    line = build_error_line(
        custom_id,
        INTERNAL_ERROR,
        f"the result could not be stored: {type(err).__name__}: {_one_line(err)}",
        line=item.line,
        status_code=500,
    )
    worker = row.get("worker")
    return result_row(
        row["request_id"],
        row["batch_id"],
        line,
        worker=worker if worker is None or unstorable(worker) is None else None,
        created_at=row["created_at"],
    )


def _one_line(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
