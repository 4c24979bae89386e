"""The online routes' view of which models are served: read from the ledger, kept a moment
for a model found served, read again at once for one that is not."""

from __future__ import annotations

import time

from conveyor.api.served_models import ServedModels
from conveyor.ledger.db import Ledger
from conveyor.ledger.workers import announce, withdraw
from conveyor.settings import normalize_database_url


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def start(ledger: Ledger, name: str, model: str) -> None:
    with ledger.session() as session:
        announce(session, name, [model], [f"q.{model}"], time.time(), {})


def test_a_served_model_is_read_once_a_second_and_a_new_one_at_once(database_url: str):
    ledger, clock = Ledger(normalize_database_url(database_url)), Clock()
    served = ServedModels(ledger, heartbeat_timeout=30, ttl=1.0, clock=clock)
    assert served.lookup("a") == (set(), set()) and served.reads == 1
    start(ledger, "w1", "a")
    assert served.lookup("a") == ({"a"}, set()) and served.reads == 2  # not served: read again
    for _ in range(50):
        assert served.lookup("a") == ({"a"}, set())
        assert served.lookup(None)[0] == {"a"}  # the one model served
    assert served.reads == 2
    assert served.remembered("a") == ({"a"}, set()) and served.remembered("b") is None
    start(ledger, "w2", "b")
    assert served.lookup("b")[0] == {"a", "b"} and served.reads == 3  # started meanwhile
    with ledger.session() as session:
        withdraw(session, "w1")
    assert served.lookup("a")[0] == {"a", "b"}  # within the second: as before
    clock.now += 1.0
    assert served.lookup("a") == ({"b"}, {"a"}) and served.reads == 4
    ledger.dispose()
