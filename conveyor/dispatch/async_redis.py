"""An asyncio Redis client made on first use, so that it belongs to the event loop that uses it
(the API's, which does not exist yet when the app is built)."""

from __future__ import annotations

import redis.asyncio


class LazyAsyncRedis:
    def __init__(self, url: str) -> None:
        self.url = url
        self._client: redis.asyncio.Redis | None = None

    def _redis(self) -> redis.asyncio.Redis:
        if self._client is None:
            self._client = redis.asyncio.Redis.from_url(self.url)
        return self._client
