"""Which models the workers serve, as the online routes ask it: every online request needs its
model's queue, and reading the workers' rows for each one (a pooled connection's ping and a
query) cost the API's process and PostgreSQL more than the rest of the request did.

A model found served is taken as served for `ttl` seconds more. A worker that dies is known
gone only `heartbeat_timeout` seconds after its last beat, so for it this adds little; one that
stops cleanly is known gone at once, and a request sent within that second waits in the model's
queue (served if a worker comes, else a 504 at CONVEYOR_ONLINE_TIMEOUT) instead of a 503. A
model not found is looked up again every time: one that just started is served at once."""

from __future__ import annotations

import time
from collections.abc import Callable

from conveyor.ledger.db import Ledger
from conveyor.ledger.workers import served_models

TTL = 1.0  # seconds


class ServedModels:
    def __init__(
        self,
        ledger: Ledger,
        heartbeat_timeout: float,
        ttl: float = TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ledger, self.heartbeat_timeout = ledger, heartbeat_timeout
        self.ttl, self.clock = ttl, clock
        self.reads = 0  # of the ledger
        self._last: tuple[float, set[str], set[str]] | None = None

    def remembered(self, model: str | None) -> tuple[set[str], set[str]] | None:
        """What `lookup` answers from memory, without the ledger; None when it would read it
        (cheap: the routes ask here on the event loop before going to a thread)."""
        last = self._last
        if last is not None and self.clock() - last[0] < self.ttl:
            _, live, known = last
            if (model in live) if model is not None else live:
                return live, known
        return None

    def lookup(self, model: str | None) -> tuple[set[str], set[str]]:
        """(models of live workers, models of workers gone silent), fresh enough to send a
        request for `model` (None: the one model served) to its queue."""
        if (remembered := self.remembered(model)) is not None:
            return remembered
        with self.ledger.reads() as session:
            live, known = served_models(session, self.heartbeat_timeout)
        self.reads += 1
        self._last = (self.clock(), live, known)
        return live, known
