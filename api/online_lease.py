"""An online request's hold on the service while its client waits: its project's sequences in
flight, and its work in a worker, which is cancelled when the client goes away first.

Whatever way the wait ends (the answer, a timeout, an error, the client gone), `close` gives
the project's sequences back, and cancels the work unless its last answer came.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from conveyor.api.online_limits import too_many_in_flight
from conveyor.dispatch.online import OnlineBus, OnlineMessage
from conveyor.settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")
SLOTS_TTL_MARGIN = 60  # seconds a project's count outlives its longest request, in Redis


@dataclass
class OnlineLease:
    bus: OnlineBus
    project: str
    hold: str | None  # the project's hold on its sequences (`OnlineSlots`); None: no limit
    queue: str = ""
    message: OnlineMessage | None = None
    answered: bool = False  # its last answer came: nothing to cancel
    taken: bool = False  # an answer came: a worker runs it
    closed: bool = False

    @classmethod
    async def take(
        cls, bus: OnlineBus, settings: Settings, project: str, sequences: int
    ) -> OnlineLease:
        """The project's hold on `sequences` more; 429 when that is past its limit."""
        limit = settings.max_online_sequences
        if not limit:
            return cls(bus, project, None)
        ttl = int(settings.online_timeout) + SLOTS_TTL_MARGIN
        hold = await bus.slots.take(project, sequences, limit, ttl)
        if hold is None:
            raise too_many_in_flight(limit)
        return cls(bus, project, hold)

    def sent(self, queue: str, message: OnlineMessage) -> None:
        self.queue, self.message = queue, message

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True):  # it runs as the client's request is cancelled
            try:
                if self.message is not None and not self.answered:
                    await self.bus.cancel(self.queue, self.message, self.taken)
            except Exception:
                log.warning("could not cancel online request %s", self.message, exc_info=True)
            try:
                if self.hold is not None:
                    await self.bus.slots.give_back(self.project, self.hold)
            except Exception:
                log.warning("could not give back %s's online sequences", self.project)


class LeasedStream(StreamingResponse):
    """A streamed answer that closes its lease however the stream ends: Starlette cancels the
    stream when the client disconnects, perhaps before the body's generator ever ran."""

    def __init__(self, events: Any, lease: OnlineLease) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.lease = lease

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.lease.close()


async def until_disconnected(request: Request) -> None:
    """Returns when the client has gone (its body has been read: the next message that comes
    is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, work: Awaitable[T]) -> T | Response:
    """`work`'s result, or, if the client disconnects first, `work` cancelled and an empty
    499 (nginx's "client closed request"; nobody reads it)."""
    waiting = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not waiting.done():
            waiting.cancel()
    if waiting.done() and not waiting.cancelled():
        return waiting.result()
    return Response(status_code=499)
