"""How fast a project may start online requests: a bucket of `burst` requests refilled at
`rate` a second, per project, in one process and in Redis."""

from __future__ import annotations

import asyncio
import time

import pytest

from conveyor.dispatch.online_rate import LocalRate, RedisRate
from conveyor.settings import Settings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_one_request_per_interval_per_project():
    clock = Clock()
    rate = LocalRate(clock)

    def take(project: str = "p") -> float:
        return asyncio.run(rate.take(project, 2.0, 3))

    assert [take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert take() == pytest.approx(0.5)  # empty: the next token comes in 1/rate
    assert take("q") == 0.0  # another project has its own bucket
    clock.now += 0.25
    assert take() == pytest.approx(0.25)  # half a token so far
    clock.now += 0.25
    assert take() == 0.0
    assert take() == pytest.approx(0.5)
    clock.now += 60  # refills up to the burst, no further
    assert [take() for _ in range(4)][-2:] == [0.0, pytest.approx(0.5)]


def test_redis_buckets_are_shared_and_refill_in_redis_time(redis_url: str):
    async def scenario() -> list[float]:
        a, b = RedisRate(redis_url), RedisRate(redis_url)  # two API processes
        seen = [await a.take("p", 5.0, 2), await b.take("p", 5.0, 2), await a.take("p", 5.0, 2)]
        seen.append(await b.take("q", 5.0, 2))
        await asyncio.sleep(0.25)  # more than one token's 0.2 s
        seen.append(await b.take("p", 5.0, 2))
        return seen

    first, second, over, other, later = asyncio.run(scenario())
    assert first == second == 0.0
    assert 0.15 < over <= 0.2
    assert other == 0.0 and later == 0.0


def test_the_burst_defaults_to_the_rate_rounded_up():
    assert Settings(online_rate_limit=2.5).online_rate_burst == 3
    assert Settings(online_rate_limit=0.2).online_rate_burst == 1
    assert Settings(online_rate_limit=2, online_burst=10).online_rate_burst == 10
    for bad in (dict(online_rate_limit=-1), dict(online_rate_limit=float("nan")),
                dict(online_burst=-2)):  # fmt: skip
        with pytest.raises(ValueError, match="CONVEYOR_ONLINE_"):
            Settings(**bad)


def test_local_buckets_refill_with_the_clock():
    rate = LocalRate()
    assert asyncio.run(rate.take("p", 20.0, 1)) == 0.0
    assert asyncio.run(rate.take("p", 20.0, 1)) > 0
    time.sleep(0.06)
    assert asyncio.run(rate.take("p", 20.0, 1)) == 0.0
