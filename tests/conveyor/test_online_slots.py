"""A project's online sequences in flight (`OnlineSlots`): in one process, and in Redis (a real
server) for several API processes, where a hold that a dead process never gave back lapses on
its own, while the project's other requests go on."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from conveyor.dispatch.online_slots import LocalSlots, RedisSlots


def slots_of(kind: str, redis_url: str):
    return LocalSlots() if kind == "local" else RedisSlots(redis_url)


def fresh(name: str) -> str:
    """A project name no earlier run left holds under in the shared test database."""
    return f"{name}-{uuid.uuid4().hex}"


@pytest.mark.parametrize("kind", ["local", "redis"])
def test_holds_count_to_the_limit_and_give_back_frees_them(kind, redis_url):
    async def run() -> None:
        slots = slots_of(kind, redis_url)
        p, other = fresh("p"), fresh("other")
        a = await slots.take(p, 3, 4, 60)
        assert a is not None
        assert await slots.take(p, 2, 4, 60) is None  # 5 > 4
        b = await slots.take(p, 1, 4, 60)
        assert b is not None and b != a
        assert await slots.take(other, 4, 4, 60) is not None  # per project
        await slots.give_back(p, a)
        c = await slots.take(p, 3, 4, 60)
        assert c is not None
        await slots.give_back(p, a)  # twice: nothing more
        assert await slots.take(p, 1, 4, 60) is None

    asyncio.run(run())


def test_a_hold_never_given_back_lapses_while_the_project_goes_on(redis_url):
    """An API process that died holding 3 of a project's 4: the project's other requests keep
    taking and giving back one at a time; the dead hold lapses `ttl` after it was taken."""

    async def run() -> float:
        slots = RedisSlots(redis_url)
        p = fresh("p")
        assert await slots.take(p, 3, 4, 2) is not None  # never given back
        taken = time.monotonic()
        while await slots.take(p, 2, 4, 2) is None:
            one = await slots.take(p, 1, 4, 2)
            assert one is not None
            await slots.give_back(p, one)
            assert time.monotonic() - taken < 5, "the dead hold did not lapse"
            await asyncio.sleep(0.1)
        return time.monotonic() - taken

    assert asyncio.run(run()) >= 1  # not at once: it lasted about its ttl
