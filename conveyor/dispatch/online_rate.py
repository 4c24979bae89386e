"""How fast each project may start online requests: nginx's `limit_req`, a bucket of `burst`
requests that refills at `rate` a second. Online requests go ahead of every batch in the
engine, so a client that opens requests in a loop (and hangs up) would otherwise take the
engine from the batches as fast as it can connect.

Counted in the API's process, or in Redis when several API processes share the work.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

from conveyor.dispatch.async_redis import LazyAsyncRedis

RATE_PREFIX = "conveyor.online.rate."

# One bucket per project, in Redis's own clock (the API processes' clocks may differ). Returns
# the seconds until a request may start, as text (Redis truncates a Lua number to an integer);
# "0" when this one starts and has taken its token.
_TAKE = """
local now = redis.call('TIME')
now = tonumber(now[1]) + tonumber(now[2]) / 1000000
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1]) or burst
local at = tonumber(state[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = (1 - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('EXPIRE', KEYS[1], math.ceil(burst / rate) + 1)
return tostring(wait)
"""


class OnlineRate(Protocol):
    async def take(self, project: str, rate: float, burst: int) -> float:
        """0 when `project` may start a request now (it is counted), else the seconds until
        it may."""
        ...


class LocalRate:
    """The buckets of one process (the embedded service, or an API without Redis)."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.buckets: dict[str, tuple[float, float]] = {}  # project -> (tokens, at)

    async def take(self, project: str, rate: float, burst: int) -> float:
        with self.lock:
            now = self.clock()
            tokens, at = self.buckets.get(project, (float(burst), now))
            tokens = min(float(burst), tokens + max(0.0, now - at) * rate)
            if tokens >= 1:
                self.buckets[project] = (tokens - 1, now)
                return 0.0
            self.buckets[project] = (tokens, now)
            return (1 - tokens) / rate


class RedisRate(LazyAsyncRedis):
    """The buckets shared by every API process, one Redis hash per project."""

    async def take(self, project: str, rate: float, burst: int) -> float:
        wait = await self._redis().eval(_TAKE, 1, RATE_PREFIX + project, repr(rate), burst)
        return float(wait)
