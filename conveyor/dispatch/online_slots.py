"""How many online sequences each project has in flight, so that one project cannot fill the
engines with online work (which goes ahead of every batch): counted in the API's process, or in
Redis when several API processes share the work.
"""

from __future__ import annotations

import threading
from typing import Protocol

from conveyor.dispatch.async_redis import LazyAsyncRedis

SLOTS_PREFIX = "conveyor.online.slots."

# INCRBY that undoes itself past the limit; the TTL bounds what an API process that died
# while holding slots can leak
_TAKE = """
local held = redis.call('INCRBY', KEYS[1], ARGV[1])
if held > tonumber(ARGV[2]) then
    redis.call('DECRBY', KEYS[1], ARGV[1])
    return 0
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""
# a key that expired meanwhile must not come back negative (it would allow more than the limit)
_GIVE = """
if redis.call('DECRBY', KEYS[1], ARGV[1]) <= 0 then redis.call('DEL', KEYS[1]) end
return 1
"""


class OnlineSlots(Protocol):
    async def take(self, project: str, count: int, limit: int, ttl: int) -> bool: ...

    async def give_back(self, project: str, count: int) -> None: ...


class LocalSlots:
    """The count of one process (the embedded service, or an API without Redis)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: dict[str, int] = {}

    async def take(self, project: str, count: int, limit: int, ttl: int) -> bool:
        with self.lock:
            held = self.held.get(project, 0)
            if held + count > limit:
                return False
            self.held[project] = held + count
            return True

    async def give_back(self, project: str, count: int) -> None:
        with self.lock:
            left = self.held.get(project, 0) - count
            if left > 0:
                self.held[project] = left
            else:
                self.held.pop(project, None)


class RedisSlots(LazyAsyncRedis):
    """The count shared by every API process, in one Redis key per project."""

    async def take(self, project: str, count: int, limit: int, ttl: int) -> bool:
        keys = [SLOTS_PREFIX + project]
        return bool(await self._redis().eval(_TAKE, 1, *keys, count, limit, ttl))

    async def give_back(self, project: str, count: int) -> None:
        await self._redis().eval(_GIVE, 1, SLOTS_PREFIX + project, count)
