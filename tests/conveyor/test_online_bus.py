"""The Redis bus of online requests, on a real Redis: answers come in order, and a client that
goes away while its answer is awaited costs no Redis connection."""

from __future__ import annotations

import asyncio
import time

import anyio
import pytest
import redis
import redis.asyncio.connection

from conveyor.dispatch.online import OnlineMessage, RedisBus


def message() -> OnlineMessage:
    return OnlineMessage("completion", {"model": "m", "prompt": "p"}, time.time() + 60)


def test_answers_come_in_order_until_the_last(redis_url: str):
    bus, sent = RedisBus(redis_url), message()
    answers = [{"chunks": [i], "last": False} for i in range(3)] + [{"status": 200, "last": True}]
    bus.answer([(sent.request_id, a) for a in answers])

    async def read() -> list[dict]:
        return [a async for a in bus.answers(sent)]

    assert asyncio.run(read()) == answers


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
