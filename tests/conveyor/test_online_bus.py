"""The Redis bus of online requests, on a real Redis: answers come in order, an answer slower
than the connection's socket timeout still comes, and a client that goes away while its answer
is awaited costs no Redis connection."""

from __future__ import annotations

import asyncio
import threading
import time

import anyio
import pytest
import redis
import redis.asyncio.connection

from conveyor.dispatch.online import OnlineMessage, RedisBus, pop_wait


def message() -> OnlineMessage:
    return OnlineMessage("completion", {"model": "m", "prompt": "p"}, time.time() + 60)


def test_answers_come_in_order_until_the_last(redis_url: str):
    bus, sent = RedisBus(redis_url), message()
    answers = [{"chunks": [i], "last": False} for i in range(3)] + [{"status": 200, "last": True}]
    bus.answer([(sent.request_id, a) for a in answers])

    async def read() -> list[dict]:
        return [a async for a in bus.answers(sent)]

    assert asyncio.run(read()) == answers


def test_an_answer_slower_than_the_socket_timeout_still_comes(redis_url: str):
    # a socket timeout of 0.5 s from the URL: one BLPOP told to block for longer would fail
    # its read with redis.TimeoutError, as every wait past redis-py's default of 5 s did
    bus, sent = RedisBus(f"{redis_url}?socket_timeout=0.5"), message()
    last = {"status": 200, "last": True}
    pusher = threading.Timer(1.5, bus.answer, args=([(sent.request_id, last)],))

    async def read() -> list[dict]:
        return [a async for a in bus.answers(sent)]

    pusher.start()
    try:
        assert asyncio.run(read()) == [last]
    finally:
        pusher.cancel()
    assert bus.take(["conveyor.online.nothing-here"], timeout=1.0) is None  # no TimeoutError


def test_pops_block_for_less_than_a_connections_socket_timeout(redis_url: str):
    bus = RedisBus(redis_url)
    for client in (bus.client, bus._redis()):
        read_timeout = client.connection_pool.make_connection().socket_timeout
        assert 0 < pop_wait(client, 600.0) < read_timeout
        assert pop_wait(client, 0.0) > 0  # 0 would block for ever


def test_waits_cancelled_by_clients_going_away_keep_their_connections(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
):
    bus = RedisBus(redis_url)
    server = redis.Redis.from_url(redis_url)
    opened = []  # this process's new connections (the server's count has other tests' too)
    connect = redis.asyncio.connection.Connection._connect

    async def counted(self) -> None:
        opened.append(self)
        await connect(self)

    monkeypatch.setattr(redis.asyncio.connection.Connection, "_connect", counted)

    def connections_made() -> int:
        return len(opened)

    async def read(sent: OnlineMessage) -> None:
        async for _ in bus.answers(sent):
            pass

    async def drop(n: int) -> None:
        for _ in range(n):
            async with anyio.create_task_group() as streams:  # as Starlette runs a stream
                streams.start_soon(read, message())
                await asyncio.sleep(0.02)  # its BLPOP is in flight; no answer comes
                streams.cancel_scope.cancel()  # the client is gone
            await asyncio.sleep(0.01)  # the wait it left ends and gives its connection back

    async def run() -> int:
        await drop(2)  # the pool's first connections
        before = connections_made()
        await drop(20)
        return connections_made() - before

    assert asyncio.run(run()) <= 1  # closed on cancel, each would have needed a new one
    assert not any(server.scan_iter(match="conveyor.online.reply.*"))  # nothing left behind
    server.close()
