"""Closing a shard waits out a database that is away, and surfaces any other error: a bug
there must end the shard's run with its text in the log, never retry silently forever."""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import pytest
from sqlalchemy import exc

from conveyor.ledger import db
from conveyor.worker.runtime import WorkerRuntime


class FlakyLedger:
    """A ledger whose sessions fail with the given errors, one per session, then work."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.sessions = 0

    @contextlib.contextmanager
    def session(self):
        self.sessions += 1
        if self.errors:
            raise self.errors.pop(0)
        yield "session"


def runtime_with(ledger: FlakyLedger) -> SimpleNamespace:
    return SimpleNamespace(ledger=ledger, settings=SimpleNamespace(heartbeat_timeout=30.0))


def away() -> exc.OperationalError:
    return exc.OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused"))


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch):
    monkeypatch.setattr(db.time, "sleep", lambda _: None)


def test_a_database_that_is_away_is_waited_out(monkeypatch):
    closed = []
    monkeypatch.setattr(
        "conveyor.worker.runtime.close_shards", lambda s, shards, _: closed.append(shards)
    )
    ledger = FlakyLedger(away(), away())
    WorkerRuntime._finish_shard(runtime_with(ledger), 3, "b")
    assert ledger.sessions == 3 and closed == [[(3, "b")]]


def test_any_other_error_ends_the_run_with_its_text(monkeypatch, caplog):
    def planted(*_):
        raise ValueError("planted: shard 3 has no row")

    monkeypatch.setattr("conveyor.worker.runtime.close_shards", planted)
    ledger = FlakyLedger()
    with caplog.at_level(logging.ERROR), pytest.raises(ValueError, match="planted"):
        WorkerRuntime._finish_shard(runtime_with(ledger), 3, "b")
    assert ledger.sessions == 1  # not retried
    assert "shard 3 could not be closed" in caplog.text and "planted" in caplog.text


def test_until_reached_returns_what_the_work_returns():
    ledger = FlakyLedger(away())
    assert db.until_reached(ledger, lambda session: f"{session} done", "work") == "session done"
    assert ledger.sessions == 2
