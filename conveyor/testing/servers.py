"""The PostgreSQL and Redis servers a test run or a benchmark uses.

Each comes from its environment variable (DATABASE_URL / REDIS_URL), else the default local
port when something answers there; else a throwaway server is started from the local binaries
(initdb and pg_ctl, redis-server), and when those are missing too `ServerMissing` says what to
install.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

import sqlalchemy as sa

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


class ServerMissing(RuntimeError):
    """Neither a running server nor the binaries to start one."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(host: str, port: int, timeout: float = 1) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def find_binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)
    return candidates[0] if candidates else None


class LocalPostgres:
    """A throwaway PostgreSQL server from the local binaries, in `root`, with a database
    `test`."""

    def __init__(self, root: Path) -> None:
        initdb, pg_ctl = find_binary("initdb"), find_binary("pg_ctl")
        if not (initdb and pg_ctl):
            raise ServerMissing(
                "PostgreSQL is not reachable at 127.0.0.1:5432 and DATABASE_URL is not set; "
                "install PostgreSQL (initdb and pg_ctl on PATH) or point DATABASE_URL at one"
            )
        self.root, self.pg_ctl = root, pg_ctl
        self.data, self.port = root / "pg", free_port()
        self.as_user: list[str] = []
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root: use its system account
            runuser = shutil.which("runuser")
            if not runuser:
                raise ServerMissing(
                    "PostgreSQL cannot run as root and runuser is missing; set DATABASE_URL"
                )
            self.as_user = [runuser, "-u", "postgres", "--"]
            shutil.chown(root, "postgres")
        subprocess.run(
            [*self.as_user, initdb, "-D", str(self.data), "-U", "postgres", "--auth=trust"],
            check=True,
            capture_output=True,
        )
        self.start()
        engine = sa.create_engine(
            f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres",
            isolation_level="AUTOCOMMIT",
        )
        with engine.connect() as conn:
            conn.execute(sa.text("CREATE DATABASE test"))
        engine.dispose()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/test"

    def _ctl(self, *args: str) -> None:
        subprocess.run([*self.as_user, self.pg_ctl, "-D", str(self.data), *args],
                       check=True, capture_output=True)  # fmt: skip

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -h 127.0.0.1"
        self._ctl("-o", options, "-l", str(self.root / "pg.log"), "-w", "start")

    def stop(self, mode: str = "immediate") -> None:
        self._ctl("-m", mode, "-w", "stop")

    close = stop


class LocalRedis:
    """A throwaway Redis server that keeps nothing on disk; restarting it loses all data."""

    def __init__(self, root: Path) -> None:
        self.binary = find_binary("redis-server")
        if not self.binary:
            raise ServerMissing(
                "Redis is not reachable at 127.0.0.1:6379 and REDIS_URL is not set; "
                "install redis-server or point REDIS_URL at one"
            )
        self.root, self.port = root, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, timeout: float = 10) -> None:
        self.proc = subprocess.Popen(
            [self.binary or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(self.root)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: Ctrl-C on a bench does not reach it
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if answers("127.0.0.1", self.port, timeout=0.5):
                return
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"redis-server did not answer on port {self.port} in {timeout}s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    close = kill


class LocalServer(Protocol):
    url: str

    def close(self) -> None: ...


@contextmanager
def throwaway(start: Callable[[Path], LocalServer], prefix: str) -> Iterator[LocalServer]:
    """A local server in a temporary folder of its own (not under pytest's tree, which only
    root may enter), closed and removed at exit."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        server = start(root)
        try:
            yield server
        finally:
            server.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def _server(
    variable: str, default: str, start: Callable[[Path], LocalServer], prefix: str
) -> Iterator[str]:
    url = os.environ.get(variable)
    if url:
        yield url
        return
    if answers("127.0.0.1", urlsplit(default).port or 0):
        yield default
        return
    with throwaway(start, prefix) as server:
        yield server.url


def postgres_server() -> AbstractContextManager[str]:
    """The URL of a PostgreSQL server: DATABASE_URL, the local default or a throwaway one."""
    return _server("DATABASE_URL", DEFAULT_DATABASE_URL, LocalPostgres, "conveyor-pg-")


def redis_server() -> AbstractContextManager[str]:
    """The URL of a Redis server: REDIS_URL, the local default or a throwaway one."""
    return _server("REDIS_URL", DEFAULT_REDIS_URL, LocalRedis, "conveyor-redis-")
