"""How many online sequences each project has in flight, so that one project cannot fill the
engines with online work (which goes ahead of every batch): counted in the API's process, or in
Redis when several API processes share the work.
"""

from __future__ import annotations

import threading
import uuid
from typing import Protocol

from conveyor.dispatch.async_redis import LazyAsyncRedis

SLOTS_PREFIX = "conveyor.online.slots."

# Each hold is a member of the project's sorted set, "<count>:<id>", scored by when it lapses:
# a hold that an API process that died never gave back lapses alone, `ttl` after it was taken,
# however much the project's other requests come and go (one count for the project, renewed by
# every take, kept such a leak for as long as the project's traffic went on).
_TAKE = """
local now = tonumber(redis.call('TIME')[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = 0
for _, hold in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
    held = held + tonumber(string.match(hold, '^(%d+):'))
end
if held + tonumber(ARGV[1]) > tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""


class OnlineSlots(Protocol):
    async def take(self, project: str, count: int, limit: int, ttl: int) -> str | None:
        """A hold on `count` more of the project's sequences, for `ttl` seconds at most; None
        when that is past `limit`."""
        ...

    async def give_back(self, project: str, hold: str) -> None: ...


class LocalSlots:
    """The count of one process (the embedded service, or an API without Redis)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: dict[str, dict[str, int]] = {}  # project -> hold -> its count

    async def take(self, project: str, count: int, limit: int, ttl: int) -> str | None:
        with self.lock:
            holds = self.held.setdefault(project, {})
            if sum(holds.values()) + count > limit:
                return None
            hold = uuid.uuid4().hex
            holds[hold] = count
            return hold

    async def give_back(self, project: str, hold: str) -> None:
        with self.lock:
            holds = self.held.get(project, {})
            holds.pop(hold, None)
            if not holds:
                self.held.pop(project, None)


class RedisSlots(LazyAsyncRedis):
    """The holds shared by every API process, in one Redis sorted set per project."""

    async def take(self, project: str, count: int, limit: int, ttl: int) -> str | None:
        hold = f"{count}:{uuid.uuid4().hex}"  # the member _TAKE sums the counts of
        taken = await self._redis().eval(_TAKE, 1, SLOTS_PREFIX + project, count, limit, ttl, hold)
        return hold if taken else None

    async def give_back(self, project: str, hold: str) -> None:
        await self._redis().zrem(SLOTS_PREFIX + project, hold)
