"""Fixtures for tests that need PostgreSQL, Redis, the API and worker processes.

PostgreSQL and Redis come from DATABASE_URL / REDIS_URL, else the default local ports; when
neither answers, a throwaway server is started from the local binaries (initdb/pg_ctl,
redis-server), and when those are missing too the test fails saying what to install. Each test
gets its own freshly migrated database (cloned from a template) and an empty Redis database.
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import redis
import sqlalchemy as sa

from conveyor.demo_model import write_tiny_model
from conveyor.settings import normalize_database_url

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
REDIS_TEST_DBS = range(1, 16)  # a random one per test, so parallel runs rarely meet


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def _find_binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)
    return candidates[0] if candidates else None


class LocalPostgres:
    """A throwaway PostgreSQL server from the local binaries, in `root`."""

    def __init__(self, root: Path) -> None:
        initdb, pg_ctl = _find_binary("initdb"), _find_binary("pg_ctl")
        if not (initdb and pg_ctl):
            pytest.fail(
                "PostgreSQL is not reachable at 127.0.0.1:5432 and DATABASE_URL is not set; "
                "install PostgreSQL (initdb and pg_ctl on PATH) or point DATABASE_URL at one"
            )
        self.root, self.pg_ctl = root, pg_ctl
        self.data, self.port = root / "pg", free_port()
        self.as_user: list[str] = []
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root: use its system account
            runuser = shutil.which("runuser")
            if not runuser:
                pytest.fail(
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


class LocalRedis:
    """A throwaway Redis server that keeps nothing on disk; restarting it loses all data."""

    def __init__(self, root: Path) -> None:
        self.binary = _find_binary("redis-server")
        if not self.binary:
            pytest.fail(
                "Redis is not reachable at 127.0.0.1:6379 and REDIS_URL is not set; "
                "install redis-server or point REDIS_URL at one"
            )
        self.root, self.port = root, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(self.root)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for _ in range(100):
            if _answers("127.0.0.1", self.port):
                return
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    url = os.environ.get("DATABASE_URL")
    if url:
        yield url
        return
    if _answers("127.0.0.1", 5432):
        yield DEFAULT_DATABASE_URL
        return
    root = Path(tempfile.mkdtemp(prefix="conveyor-pg-"))
    server = LocalPostgres(root)
    try:
        yield server.url
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    if _answers("127.0.0.1", 6379):
        yield DEFAULT_REDIS_URL
        return
    root = Path(tempfile.mkdtemp(prefix="conveyor-redis-"))
    server = LocalRedis(root)
    try:
        yield server.url
    finally:
        server.kill()
        shutil.rmtree(root, ignore_errors=True)


def _with_database(url: str, name: str) -> str:
    parts = urlsplit(normalize_database_url(url))
    return urlunsplit(parts._replace(path=f"/{name}"))


@pytest.fixture(scope="session")
def template_database(postgres_server: str) -> Iterator[str]:
    """A database migrated once; each test's database is a copy of it."""
    from ledger.migrate import upgrade

    admin = sa.create_engine(normalize_database_url(postgres_server), isolation_level="AUTOCOMMIT")
    name = f"conveyor_tpl_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = _with_database(postgres_server, name)
    upgrade(url)
    sa.create_engine(url).dispose()
    try:
        yield name
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def database_url(postgres_server: str, template_database: str) -> Iterator[str]:
    admin = sa.create_engine(normalize_database_url(postgres_server), isolation_level="AUTOCOMMIT")
    name = f"conveyor_t_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"'))
    try:
        yield _with_database(postgres_server, name)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def redis_url(redis_server: str) -> str:
    parts = urlsplit(redis_server)
    url = urlunsplit(parts._replace(path=f"/{random.choice(REDIS_TEST_DBS)}"))
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    return url


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> Path:
    """A tiny random-weight Llama with a ChatML tokenizer, served as `tiny` in service tests."""
    return write_tiny_model(tmp_path_factory.mktemp("service-model") / "tiny", "llama")


@dataclass
class Stack:
    """The processes of one test's deployment: an API and any number of workers."""

    env: dict[str, str]
    root: Path
    api_url: str = ""
    procs: list[subprocess.Popen] = field(default_factory=list)
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)

    def _spawn(
        self, name: str, args: list[str], launcher: list[str] | None = None
    ) -> subprocess.Popen:
        """Run `conveyor ARGS`, or `python LAUNCHER... ARGS` (a test's own entry point)."""
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 (lives as long as the process)
        proc = subprocess.Popen(
            [sys.executable, *(launcher or ["-m", "conveyor"]), *args],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start_api(self) -> str:
        port = free_port()
        proc = self._spawn("api", ["serve", "--host", "127.0.0.1", "--port", str(port)])
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the API exited with {proc.returncode}:\n{self.log('api')}")
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    self.api_url = url
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the API did not start:\n{self.log('api')}")

    def start_worker(
        self,
        name: str,
        model: str | Path,
        *extra: str,
        served: str = "tiny",
        wait: bool = True,
        launcher: list[str] | None = None,
    ) -> subprocess.Popen:
        args = ["worker", "--model", str(model), "--name", name, "--loglevel", "INFO", *extra]
        if served:
            args += ["--served-model-name", served]
        proc = self._spawn(name, args, launcher)
        self.workers[name] = proc
        if wait:
            self.wait_worker_ready(name)
        return proc

    def wait_worker_ready(self, name: str, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        proc = self.workers[name]
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"worker {name} exited with {proc.returncode}:\n{self.log(name)}"
                )
            if "ready." in self.log(name):  # Celery's consumer is connected
                return
            time.sleep(0.2)
        raise RuntimeError(f"worker {name} did not start:\n{self.log(name)}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.workers[name]
        os.killpg(proc.pid, sig)
        proc.wait(30)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def stack_env(database_url: str, redis_url: str, tmp_path: Path) -> dict[str, str]:
    """A deployment's environment: quick heartbeats and reconciler rounds, small shards."""
    env = dict(os.environ)
    env.update(
        DATABASE_URL=database_url,
        REDIS_URL=redis_url,
        CONVEYOR_DATA_DIR=str(tmp_path / "data"),
        CONVEYOR_HEARTBEAT_INTERVAL="0.5",
        CONVEYOR_HEARTBEAT_TIMEOUT="5",
        CONVEYOR_RECONCILE_INTERVAL="1",
        CONVEYOR_SHARD_SIZE="8",
        CONVEYOR_VISIBILITY_TIMEOUT="600",
        PYTHONUNBUFFERED="1",
    )
    return env


@pytest.fixture
def stack(database_url: str, redis_url: str, tmp_path: Path) -> Iterator[Stack]:
    s = Stack(env=stack_env(database_url, redis_url, tmp_path), root=tmp_path)
    try:
        yield s
    finally:
        s.stop()


def batch_lines(
    n: int,
    model: str = "tiny",
    system: str = "You are terse.",
    prefix: str = "q",
    max_tokens: int = 8,
) -> list[dict]:
    return [
        {
            "custom_id": f"{prefix}-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "max_tokens": max_tokens,
                "temperature": 0,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"question number {i} of {prefix}"},
                ],
            },
        }
        for i in range(n)
    ]


def submit_batch(
    api: str,
    path: Path,
    headers: dict[str, str] | None = None,
    endpoint: str = "/v1/chat/completions",
) -> str:
    """Upload a JSONL file and create a batch of it (chat completions unless `endpoint` says
    otherwise); returns the batch id."""
    with open(path, "rb") as f:
        upload = httpx.post(
            f"{api}/v1/files",
            files={"file": (path.name, f)},
            data={"purpose": "batch"},
            headers=headers,
            timeout=120,
        )
    upload.raise_for_status()
    body = {"input_file_id": upload.json()["id"], "endpoint": endpoint}
    created = httpx.post(f"{api}/v1/batches", json=body, headers=headers, timeout=120)
    created.raise_for_status()
    return created.json()["id"]


TERMINAL = ("completed", "failed", "expired", "cancelled")


def wait_for(
    api: str,
    batch_id: str,
    statuses=TERMINAL,
    timeout: float = 300,
    headers: dict[str, str] | None = None,
) -> dict:
    """The batch object once its status is one of `statuses`; fails after `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        batch = httpx.get(f"{api}/v1/batches/{batch_id}", headers=headers, timeout=30).json()
        if batch["status"] in statuses:
            return batch
        time.sleep(0.3)
    raise AssertionError(f"batch {batch_id} still {batch['status']} after {timeout}s: {batch}")


def download(api: str, file_id: str | None, headers: dict[str, str] | None = None) -> list[dict]:
    """The JSON lines of a file (none for no file)."""
    if file_id is None:
        return []
    r = httpx.get(f"{api}/v1/files/{file_id}/content", headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.text.splitlines() if line.strip()]


def write_jsonl(path: Path, lines: list) -> Path:
    with open(path, "w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path
