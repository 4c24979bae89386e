"""The reconciler's lock, on a real Redis: one reconciler at a time, held past its life while its
holder works, and a holder killed mid-round keeps the others out for `heartbeat_timeout` at most
(the lock once lived 120 s, and a worker killed while reconciling held up every re-send that
long)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import redis

from conveyor.dispatch import reconciler
from conveyor.settings import Settings


def settings(redis_url: str, tmp_path: Path, ttl: float) -> Settings:
    return Settings(
        data_dir=tmp_path, database_url=None, redis_url=redis_url, heartbeat_timeout=ttl
    )


def test_the_holder_keeps_the_lock_past_its_life_while_it_works(redis_url, tmp_path):
    s = settings(redis_url, tmp_path, 0.6)
    with reconciler._lock(s) as held:
        assert held
        until = time.monotonic() + 2.0  # over three of the lock's lives
        while time.monotonic() < until:
            with reconciler._lock(s) as other:
                assert not other
            time.sleep(0.1)
    with reconciler._lock(s) as held:
        assert held  # released at the end of the round


def test_a_holder_killed_mid_round_keeps_the_others_out_for_its_ttl_at_most(redis_url, tmp_path):
    ttl = 3.0
    holder = (
        "import os, signal\n"
        "from conveyor.dispatch import reconciler\n"
        "from conveyor.settings import Settings\n"
        f"s = Settings(data_dir={str(tmp_path)!r}, database_url=None, redis_url={redis_url!r},"
        f" heartbeat_timeout={ttl})\n"
        "with reconciler._lock(s) as held:\n"
        "    assert held\n"
        "    print('held', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", holder], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -9 and "held" in proc.stdout, proc.stderr
    client = redis.Redis.from_url(redis_url)
    left = client.pttl(reconciler.LOCK_KEY) / 1000  # the dead holder's lock is still there
    client.close()
    assert 0 < left <= ttl
    waited = time.monotonic()
    s = settings(redis_url, tmp_path, ttl)
    while True:
        with reconciler._lock(s) as held:
            if held:
                break
        assert time.monotonic() - waited < left + 1.0, "the dead holder's lock outlived its ttl"
        time.sleep(0.05)


def test_a_round_stuck_past_the_limit_lets_its_lock_expire(redis_url, tmp_path, monkeypatch):
    monkeypatch.setattr(reconciler, "ROUND_LIMIT", 1.0)
    s = settings(redis_url, tmp_path, 0.6)
    with reconciler._lock(s) as held:  # a round that never ends, in a live process
        assert held
        started = time.monotonic()
        while True:
            with reconciler._lock(s) as other:
                if other:
                    break
            assert time.monotonic() - started < 1.0 + 0.6 + 1.0, "the stuck round kept its lock"
            time.sleep(0.05)
        assert time.monotonic() - started >= 1.0  # renewed up to the limit
