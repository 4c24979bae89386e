"""Database engine and sessions for the ledger."""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import psycopg
from sqlalchemy import Engine, create_engine, event, exc
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)
T = TypeVar("T")

# the database is away, restarting or busy (PostgreSQL's serialization failures and
# deadlocks are operational errors, SQLite's "database is locked" too)
_TRANSIENT = (
    exc.OperationalError,
    exc.InterfaceError,
    exc.DisconnectionError,
    exc.TimeoutError,  # no pooled connection came free
    psycopg.OperationalError,
    psycopg.InterfaceError,
    sqlite3.OperationalError,
    ConnectionError,
)


def is_transient(err: BaseException) -> bool:
    """Whether `err` says the database could not be reached or asked for a retry, so the same
    statements may succeed later, rather than that what they wrote is wrong."""
    if isinstance(err, exc.DBAPIError) and err.connection_invalidated:
        return True
    return isinstance(err, _TRANSIENT) or isinstance(getattr(err, "orig", None), _TRANSIENT)


def until_reached(ledger: Ledger, work: Callable[[Session], T], what: str) -> T:
    """`work` run in a transaction of `ledger`, again and again with backoff (0.2 s, doubling
    to 5 s) while the database cannot be reached; an error that is not about reaching it is
    raised at once, for the caller to surface."""
    delay = 0.2
    while True:
        try:
            with ledger.session() as session:
                return work(session)
        except Exception as err:
            if not is_transient(err):
                raise
            log.warning("could not commit %s (%s); retrying in %.1fs", what, type(err).__name__,
                        delay)  # fmt: skip
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def make_engine(url: str, pre_ping: bool = True) -> Engine:
    if url.startswith("sqlite"):
        path = url.split(":///", 1)[1] if ":///" in url else ""
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record) -> None:  # noqa: ANN001
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=pre_ping, pool_size=40, max_overflow=10)


class Ledger:
    """Owns the engine and hands out sessions; one per process."""

    def __init__(self, url: str, pre_ping: bool = True) -> None:
        self.url = url
        self.engine = make_engine(url, pre_ping)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.read_sessions = sessionmaker(
            self.engine.execution_options(isolation_level="AUTOCOMMIT")
        )

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A transaction: committed when the block ends, rolled back if it raises."""
        with self.sessions() as session, session.begin():
            yield session

    @contextmanager
    def reads(self) -> Iterator[Session]:
        """A session for reads that need no transaction around them: on an autocommit
        connection each statement sees the latest committed state, with no BEGIN and COMMIT
        round trips to the server."""
        with self.read_sessions() as session:
            yield session

    def dispose(self) -> None:
        self.engine.dispose()
