"""How online requests (`POST /v1/completions` and the like, answered while the client waits)
reach a worker and come back: through Redis lists, or, when the worker runs in the API's own
process (the embedded `conveyor serve`), through in-process queues.

A request is one JSON message on its model's online list; a worker takes it, runs it at the
front of its engine's queue, and pushes its answer (one message, or a stream of chunk messages
and a last one) onto a list of the request's own, which expires if nobody reads it.

A client that goes away cancels its request: it leaves the online list if no worker took it
yet, else its id is published to every worker, and the one that runs it aborts it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import redis
import redis.asyncio

from conveyor.dispatch.online_rate import LocalRate, OnlineRate, RedisRate
from conveyor.dispatch.online_slots import LocalSlots, OnlineSlots, RedisSlots
from conveyor.dispatch.queues import is_redis_url

log = logging.getLogger(__name__)

ONLINE_PREFIX = "conveyor.online."
REPLY_PREFIX = "conveyor.online.reply."
REPLY_TTL = 900  # seconds an answer waits for its reader
CANCEL_CHANNEL = "conveyor.online.cancel"  # ids of requests whose clients went away
POP_WAIT = 30.0  # seconds one wait for an answer lasts at most (it is made again)
# seconds a read from Redis may take before its connection counts as lost; a blocking pop
# blocks for less (`pop_wait`)
SOCKET_TIMEOUT = 10.0
WAKE = b"{}"  # pushed to end a wait for answers whose reader went away


def online_queue(model_queue: str) -> str:
    """The list of a model's online requests (from its shard queue's name)."""
    return ONLINE_PREFIX + model_queue


@dataclass
class OnlineMessage:
    """An online request as it travels: `kind` is completion, chat, responses, tokenize,
    detokenize or tokenizer_info; `body` the client's JSON body; `deadline` the time past which
    nobody waits for the answer any more."""

    kind: str
    body: dict[str, Any]
    deadline: float
    project: str = ""
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def dumps(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def loads(cls, text: str | bytes) -> OnlineMessage:
        return cls(**json.loads(text))


class OnlineBus(Protocol):
    slots: OnlineSlots  # each project's online sequences in flight
    rate: OnlineRate  # how fast each project starts online requests

    async def send(self, queue_name: str, message: OnlineMessage) -> None: ...

    def answers(self, message: OnlineMessage) -> AsyncIterator[dict[str, Any]]: ...

    async def cancel(self, queue_name: str, message: OnlineMessage, taken: bool = False) -> None:
        """Stop `message`'s request: out of its queue if no worker took it yet, else aborted
        by the worker that runs it; `taken`: an answer came, so a worker has it."""

    def cancellations(self, stopped: threading.Event) -> Iterator[str]: ...

    def take(self, queue_names: list[str], timeout: float) -> OnlineMessage | None: ...

    def answer(self, answers: list[tuple[str, dict[str, Any]]]) -> None: ...

    def has_consumer(self, queue_name: str) -> bool | None: ...

    def consume(self, queue_names: Iterable[str]) -> None: ...


class AnswerTimeout(Exception):
    """No answer came before the request's deadline."""


class RedisBus:
    """The bus between processes: Redis lists."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = redis.Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT)
        self._async: redis.asyncio.Redis | None = None
        self.slots = RedisSlots(url)
        self.rate = RedisRate(url)

    def _redis(self) -> redis.asyncio.Redis:
        if self._async is None:  # made on the event loop that uses it
            self._async = redis.asyncio.Redis.from_url(self.url, socket_timeout=SOCKET_TIMEOUT)
        return self._async

    async def send(self, queue_name: str, message: OnlineMessage) -> None:
        await self._redis().lpush(queue_name, message.dumps())

    async def answers(self, message: OnlineMessage) -> AsyncIterator[dict[str, Any]]:
        client = self._redis()
        key = REPLY_PREFIX + message.request_id
        try:
            while True:
                left = message.deadline - time.time()
                if left <= 0:
                    raise AnswerTimeout
                got = await _pop_keeping_connection(client, key, pop_wait(client, left))
                if got is None:
                    continue
                answer = json.loads(got[1])
                yield answer
                if answer.get("last"):
                    return
        finally:
            # a wait its reader left (`_pop_keeping_connection`) ends at the push, then the list
            # goes; in one round trip, shielded from the cancellation of a reader that left (in
            # a cancelled anyio scope every await is cancelled, and the connection with it)
            with anyio.CancelScope(shield=True):
                async with client.pipeline(transaction=False) as pipe:
                    pipe.rpush(key, WAKE)
                    pipe.delete(key)
                    await pipe.execute()

    async def cancel(self, queue_name: str, message: OnlineMessage, taken: bool = False) -> None:
        client = self._redis()
        # LREM reads the whole list: not for a request a worker answered (a dropped stream)
        if taken or not await client.lrem(queue_name, 1, message.dumps()):  # a worker has it
            await client.publish(CANCEL_CHANNEL, message.request_id)

    def cancellations(self, stopped: threading.Event) -> Iterator[str]:
        """The ids of cancelled requests, as they come, until `stopped`; one missed while Redis
        was away runs on until its deadline."""
        while not stopped.is_set():
            try:
                with self.client.pubsub(ignore_subscribe_messages=True) as pubsub:
                    pubsub.subscribe(CANCEL_CHANNEL)
                    while not stopped.is_set():
                        got = pubsub.get_message(timeout=1.0)
                        if got is not None:
                            yield got["data"].decode()
            except redis.RedisError:
                log.warning("lost the cancellations' channel; subscribing again", exc_info=True)
                stopped.wait(1.0)

    def take(self, queue_names: list[str], timeout: float) -> OnlineMessage | None:
        got = self.client.brpop(queue_names, timeout=pop_wait(self.client, timeout))
        return None if got is None else OnlineMessage.loads(got[1])

    def answer(self, answers: list[tuple[str, dict[str, Any]]]) -> None:
        """Push (request id, answer) pairs, in order, in one round trip: a step's answers to
        every stream it advanced go together."""
        with self.client.pipeline(transaction=False) as pipe:
            for request_id, answer in answers:
                key = REPLY_PREFIX + request_id
                pipe.rpush(key, json.dumps(answer))
                pipe.expire(key, REPLY_TTL)
            pipe.execute()

    def has_consumer(self, queue_name: str) -> bool | None:
        return None  # the workers table says who serves what

    def consume(self, queue_names: Iterable[str]) -> None:
        """Nothing to say: a worker takes from Redis lists by name."""


def pop_wait(client: redis.Redis | redis.asyncio.Redis, wanted: float) -> float:
    """How long one blocking pop on `client` may block: `wanted`, at most `POP_WAIT`, and short
    of the client's socket timeout (`SOCKET_TIMEOUT`, or what its URL says). redis-py fails a
    read that outlasts the socket timeout with a TimeoutError however long the pop was told to
    block (redis/redis-py#2807); with its default of 5 s (redis-py 8) an answer that took longer
    to come (a long completion, a stream waiting for its first token on a busy worker) failed
    its request. Never 0, which blocks for ever; a fraction of a second needs Redis 6."""
    limit = client.connection_pool.connection_kwargs.get("socket_timeout")
    wait = min(wanted, POP_WAIT)
    if limit is not None:
        wait = min(wait, limit - min(1.0, limit / 2))
    return max(wait, 0.01)


async def _pop_keeping_connection(
    client: redis.asyncio.Redis, key: str, timeout: float
) -> tuple[bytes, bytes] | None:
    """BLPOP `key` for `timeout` seconds. When the caller is cancelled (its client went away),
    the BLPOP runs on until the `WAKE` its reader pushes as it leaves, so that its connection
    goes back to the pool: redis-py closes the connection of a command cancelled mid-way, and
    every dropped stream made the next request open a new one (a tenth of the API's time while
    50 clients dropped streams)."""
    pop = asyncio.ensure_future(client.blpop([key], timeout=timeout))
    try:
        return await asyncio.shield(pop)
    except asyncio.CancelledError:
        pop.add_done_callback(_forget)
        raise


def _forget(task: asyncio.Future[Any]) -> None:
    """Retrieve the end of a wait nobody awaits any more (its failure is nobody's to log)."""
    if not task.cancelled():
        task.exception()


class Replies:
    """One request's answers: put from a worker's thread, awaited on the API's event loop
    without holding a thread while waiting."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: deque[dict[str, Any]] = deque()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ready: asyncio.Event | None = None

    def put(self, answer: dict[str, Any]) -> None:
        with self.lock:
            self.items.append(answer)
            loop, ready = self.loop, self.ready
        if loop is not None and ready is not None:
            loop.call_soon_threadsafe(ready.set)

    async def get(self, timeout: float) -> dict[str, Any]:
        """The next answer; TimeoutError when none came within `timeout` seconds."""
        with self.lock:
            if self.ready is None:
                self.loop, self.ready = asyncio.get_running_loop(), asyncio.Event()
            ready = self.ready
        while True:
            with self.lock:
                if self.items:
                    return self.items.popleft()
                # a put after this clear sets it again: its set runs on this loop, later
                ready.clear()
            async with asyncio.timeout(timeout):
                await ready.wait()


class LocalBus:
    """The bus inside one process: for the embedded service, whose worker runs in the API's
    process and whose broker is no Redis."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[str, queue.Queue[OnlineMessage]] = {}
        self.replies: dict[str, Replies] = {}
        self.consumers: dict[str, int] = {}
        self.cancel_feeds: list[queue.Queue[str]] = []
        self.slots = LocalSlots()
        self.rate = LocalRate()

    def _queue(self, name: str) -> queue.Queue[OnlineMessage]:
        with self.lock:
            return self.requests.setdefault(name, queue.Queue())

    def _reply_queue(self, request_id: str) -> Replies:
        with self.lock:
            return self.replies.setdefault(request_id, Replies())

    def consume(self, queue_names: Iterable[str]) -> None:
        """A worker of this process takes from these queues."""
        with self.lock:
            for name in queue_names:
                self.consumers[name] = self.consumers.get(name, 0) + 1

    async def send(self, queue_name: str, message: OnlineMessage) -> None:
        self._reply_queue(message.request_id)
        self._queue(queue_name).put(message)

    async def answers(self, message: OnlineMessage) -> AsyncIterator[dict[str, Any]]:
        replies = self._reply_queue(message.request_id)
        try:
            while True:
                left = message.deadline - time.time()
                if left <= 0:
                    raise AnswerTimeout
                try:
                    answer = await replies.get(left)
                except TimeoutError:
                    continue
                yield answer
                if answer.get("last"):
                    return
        finally:
            with self.lock:
                self.replies.pop(message.request_id, None)

    async def cancel(self, queue_name: str, message: OnlineMessage, taken: bool = False) -> None:
        waiting = self._queue(queue_name)
        if not taken:
            with waiting.mutex:  # not taken yet: it leaves the queue
                try:
                    waiting.queue.remove(message)
                    return
                except ValueError:
                    pass
        with self.lock:
            feeds = list(self.cancel_feeds)
        for feed in feeds:
            feed.put(message.request_id)

    def cancellations(self, stopped: threading.Event) -> Iterator[str]:
        # a Queue, not a SimpleQueue, for its get with a timeout (worker/writer.py says why)
        feed: queue.Queue[str] = queue.Queue()
        with self.lock:
            self.cancel_feeds.append(feed)
        try:
            while not stopped.is_set():
                try:
                    request_id = feed.get(timeout=1.0)
                except queue.Empty:
                    continue
                yield request_id
        finally:
            with self.lock:
                self.cancel_feeds.remove(feed)

    def take(self, queue_names: list[str], timeout: float) -> OnlineMessage | None:
        deadline = time.monotonic() + timeout
        while True:
            for name in queue_names:
                try:
                    return self._queue(name).get_nowait()
                except queue.Empty:
                    pass
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def answer(self, answers: list[tuple[str, dict[str, Any]]]) -> None:
        for request_id, answer in answers:
            with self.lock:
                replies = self.replies.get(request_id)
            if replies is not None:  # else nobody waits for it any more
                replies.put(answer)

    def has_consumer(self, queue_name: str) -> bool | None:
        with self.lock:
            return self.consumers.get(queue_name, 0) > 0


_local = LocalBus()


def bus_for(broker_url: str) -> OnlineBus:
    """Redis's lists when the broker is Redis; else the in-process bus."""
    return RedisBus(broker_url) if is_redis_url(broker_url) else _local
