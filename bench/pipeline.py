"""Our own overhead through the whole service pipeline, with the null engine.

Starts the API (`conveyor serve`) and one echo worker (`conveyor worker --model echo`, which
answers every request at once) on a fresh PostgreSQL database and a spare Redis database, then
runs one chat-completions batch through them the way a client would: upload the JSONL, create
the batch (validation + insert + enqueue), poll until it is completed, download the output
file, and check that every custom_id came back exactly once. Since the engine costs nothing,
everything measured is the service's own overhead: HTTP, validation, the ledger, the broker,
the worker's shard tasks and the result writer.

As a baseline, the same request rows are then inserted straight into a scratch table shaped
like `requests`, once with SQLAlchemy executemany and once with psycopg's COPY FROM STDIN: the
speed of the database itself for the rows we store.

    python bench/pipeline.py                       # full run: 20,000 requests
    python bench/pipeline.py --quick               # smoke run: 2,000 requests
    python bench/pipeline.py --shard-size 512 --concurrency 8 --keep
    python bench/pipeline.py --private-redis       # a throwaway redis-server of its own

PostgreSQL comes from DATABASE_URL (default postgresql://postgres@127.0.0.1:5432/test): a
database conveyor_bench_<hex> is created on that server and dropped at the end (--keep keeps
it, and the logs). Redis comes from REDIS_URL (default redis://127.0.0.1:6379/), using the
database index --redis-db (default 12), which is flushed first and last. The test suite flushes
and reconciles random Redis databases 1-15 of the same server; a test that lands on the bench's
database while it runs can drop shard messages (the batch then waits for the reconciler, tens
of seconds). The report warns when a shard had to be re-sent; --private-redis avoids it.

CPU seconds per phase are read from /proc for the API and worker processes, the Postgres
backends serving the bench database (sampled every 0.2 s) and this client.

The last line printed is one JSON object with the headline numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import psycopg
import redis
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import table  # noqa: E402

from conveyor.settings import normalize_database_url  # noqa: E402
from ledger.db import make_engine  # noqa: E402

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/"
GOAL_RPS = 2000.0
ENDPOINT = "/v1/chat/completions"
SYSTEM_PROMPTS = [
    "You are terse.",
    "You are a helpful assistant.",
    "Answer in one word.",
    "You are a pirate; answer like one.",
    "Reply in French.",
]
COLUMNS = ("batch_id", "shard_index", "line", "custom_id", "raw", "attempts")
TERMINAL = {"completed", "failed", "expired", "cancelled"}

# ---------------------------------------------------------------------------------------------
# small helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_database(url: str, name: str) -> str:
    """`url` (any postgres scheme) pointing at database `name`, as a plain postgresql:// URL."""
    parts = urlsplit(url)
    scheme = parts.scheme.split("+", 1)[0]  # postgresql+psycopg:// (SQLAlchemy's form) too
    scheme = "postgresql" if scheme in ("postgres", "postgresql") else scheme
    return urlunsplit(parts._replace(scheme=scheme, path=f"/{name}"))


def redis_with_db(url: str, db: int) -> str:
    return urlunsplit(urlsplit(url)._replace(path=f"/{db}"))


def proc_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) used so far by process `pid`; None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loadavg() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def git_state() -> str | None:
    """The commit measured, with `+dirty` when the working tree has changes."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return None
    return (commit + ("+dirty" if dirty else "")) or None


def rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


# ---------------------------------------------------------------------------------------------
# the deployment: a database, a Redis db, the API and one echo worker


@dataclass
class Stack:
    server_url: str  # plain postgresql:// URL of the server's maintenance database
    admin_url: str  # the same, for SQLAlchemy
    db_name: str
    db_url: str  # plain postgresql:// URL of the bench database
    redis_url: str
    root: Path
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    api_url: str = ""
    db_created: bool = False

    # ---- database and broker ----------------------------------------------------------------
    def create_database(self) -> None:
        from ledger.migrate import upgrade

        admin = sa.create_engine(self.admin_url, isolation_level="AUTOCOMMIT")
        self.db_created = True  # from here on, clean-up drops it (IF EXISTS)
        try:
            with admin.connect() as conn:
                conn.execute(sa.text(f'CREATE DATABASE "{self.db_name}"'))
        finally:
            admin.dispose()
        upgrade(normalize_database_url(self.db_url))

    def drop_database(self) -> None:
        if not self.db_created:
            return
        admin = sa.create_engine(self.admin_url, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)'))
            self.db_created = False
        finally:
            admin.dispose()

    def flush_redis(self) -> None:
        client = redis.Redis.from_url(self.redis_url)
        try:
            client.flushdb()
        finally:
            client.close()

    # ---- processes --------------------------------------------------------------------------
    def spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 (lives as long as the process)
        proc = subprocess.Popen(
            [sys.executable, "-m", "conveyor", *args],
            env=self.env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: Ctrl-C here does not reach it
        )
        log.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def log_tail(self, name: str, lines: int = 40) -> str:
        return "\n".join(self.log(name).splitlines()[-lines:])

    def start_api(self, timeout: float = 60) -> None:
        port = free_port()
        proc = self.spawn("api", ["serve", "--host", "127.0.0.1", "--port", str(port)])
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the API exited with {proc.returncode}:\n{self.log_tail('api')}"
                )
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    self.api_url = url
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(
            f"the API did not answer /healthz in {timeout}s:\n{self.log_tail('api')}"
        )

    def start_worker(self, concurrency: int, timeout: float = 120) -> None:
        proc = self.spawn(
            "worker",
            [
                "worker",
                "--model",
                "echo",
                "--concurrency",
                str(concurrency),
                "--name",
                "bench-echo",
                "--loglevel",
                "INFO",
            ],
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the worker exited with {proc.returncode}:\n{self.log_tail('worker')}"
                )
            if "ready." in self.log("worker"):  # Celery's consumer is connected
                return
            time.sleep(0.1)
        raise RuntimeError(f"the worker was not ready in {timeout}s:\n{self.log_tail('worker')}")

    def stop(self) -> None:
        """SIGTERM every process group, then SIGKILL what is still there after 15 s."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        self.procs.clear()


def start_private_redis(root: Path) -> tuple[str, subprocess.Popen]:
    """A throwaway redis-server on a free port (no persistence), for runs that must not share
    a Redis server with anything else."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("--private-redis needs redis-server on PATH")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return f"redis://127.0.0.1:{port}/", proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the private redis-server did not start")


class CpuMeter:
    """CPU seconds spent by the API, the worker, the bench database's Postgres backends and
    this client between successive marks.

    Postgres backends come and go (the pools close overflow connections), so a thread samples
    them every `interval` seconds and keeps each one's last reading: a backend that exits loses
    at most its last `interval` of CPU from the count.
    """

    def __init__(self, stack: Stack, interval: float = 0.2) -> None:
        self.stack = stack
        self.interval = interval
        self.pg_latest: dict[int, float] = {}
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.conn = psycopg.connect(stack.server_url, autocommit=True)
        self.last = self._sample()
        self.phases: dict[str, dict[str, float]] = {}
        self.thread = threading.Thread(target=self._loop, daemon=True, name="bench-cpu")
        self.thread.start()

    def _poll_postgres(self) -> None:
        with self.lock:
            try:
                pids = [
                    pid
                    for (pid,) in self.conn.execute(
                        "SELECT pid FROM pg_stat_activity WHERE datname = %s",
                        (self.stack.db_name,),
                    )
                ]
            except psycopg.Error:
                return
            for pid in pids:
                cpu = proc_cpu(pid)
                if cpu is not None:
                    self.pg_latest[pid] = cpu

    def _loop(self) -> None:
        while not self.stopped.wait(self.interval):
            self._poll_postgres()

    def _sample(self) -> dict[str, float]:
        self._poll_postgres()
        out = {name: proc_cpu(p.pid) or 0.0 for name, p in self.stack.procs.items()}
        with self.lock:
            out["postgres"] = sum(self.pg_latest.values())
        out["client"] = time.process_time()
        return out

    def mark(self, phase: str) -> None:
        now = self._sample()
        self.phases[phase] = {k: v - self.last.get(k, 0.0) for k, v in now.items()}
        self.last = now

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(5)
        with self.lock:
            self.conn.close()


# ---------------------------------------------------------------------------------------------
# workload


def write_workload(path: Path, n: int, seed: int) -> int:
    """A chat-completions batch file of `n` short requests; returns its size in bytes."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota"]
    with open(path, "w") as f:
        for i in range(n):
            line = {
                "custom_id": f"req-{i}",
                "method": "POST",
                "url": ENDPOINT,
                "body": {
                    "model": "echo",
                    "max_tokens": 16,
                    "temperature": 0,
                    "messages": [
                        {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
                        {
                            "role": "user",
                            "content": f"question {i}: " + " ".join(rng.choices(words, k=6)),
                        },
                    ],
                },
            }
            f.write(json.dumps(line) + "\n")
    return path.stat().st_size


def request_rows(path: Path, batch_id: str, shard_size: int) -> list[tuple]:
    """The `requests` rows intake stores for this file (in file order), as COLUMNS tuples."""
    rows = []
    with open(path, "rb") as f:
        for i, raw in enumerate(f):
            text = raw.decode().strip()
            custom_id = json.loads(text)["custom_id"]
            rows.append((batch_id, i // shard_size, i + 1, custom_id, text, 0))
    return rows


# ---------------------------------------------------------------------------------------------
# the pipeline run


@dataclass
class PipelineResult:
    upload_s: float
    create_s: float
    processing_s: float
    download_s: float
    batch_id: str
    output_bytes: int
    create_returned_at: float  # epoch seconds
    completed_seen_at: float
    polls: int

    @property
    def total_s(self) -> float:
        return self.upload_s + self.create_s + self.processing_s + self.download_s


def run_pipeline(
    stack: Stack,
    input_path: Path,
    output_path: Path,
    n: int,
    poll_interval: float,
    timeout: float,
    cpu: CpuMeter,
) -> PipelineResult:
    client = httpx.Client(base_url=stack.api_url, timeout=httpx.Timeout(600.0, connect=10.0))
    try:
        t0 = time.perf_counter()
        with open(input_path, "rb") as f:
            r = client.post(
                "/v1/files",
                files={"file": (input_path.name, f, "application/jsonl")},
                data={"purpose": "batch"},
            )
        r.raise_for_status()
        file_id = r.json()["id"]
        upload_s = time.perf_counter() - t0
        cpu.mark("upload")

        t0 = time.perf_counter()
        r = client.post(
            "/v1/batches",
            json={"input_file_id": file_id, "endpoint": ENDPOINT, "completion_window": "24h"},
        )
        r.raise_for_status()
        batch = r.json()
        create_s = time.perf_counter() - t0
        create_returned_at = time.time()
        cpu.mark("create")
        if batch["status"] == "failed":
            raise RuntimeError(f"the batch failed validation: {batch.get('errors')}")

        t0 = time.perf_counter()
        polls = 0
        deadline = time.monotonic() + timeout
        while batch["status"] not in TERMINAL:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"batch {batch['id']} not done after {timeout}s: {batch['request_counts']}"
                )
            for name, proc in stack.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {proc.returncode}:\n{stack.log_tail(name)}"
                    )
            time.sleep(poll_interval)
            r = client.get(f"/v1/batches/{batch['id']}")
            r.raise_for_status()
            batch = r.json()
            polls += 1
        processing_s = time.perf_counter() - t0
        completed_seen_at = time.time()
        cpu.mark("processing")
        if batch["status"] != "completed":
            raise RuntimeError(f"batch ended {batch['status']}: {batch}")
        counts = batch["request_counts"]
        if counts["completed"] != n or counts["failed"]:
            raise RuntimeError(f"unexpected request counts {counts}")
        if batch.get("error_file_id"):
            raise RuntimeError("the batch has an error file; expected none")

        t0 = time.perf_counter()
        size = 0
        with (
            client.stream("GET", f"/v1/files/{batch['output_file_id']}/content") as resp,
            open(output_path, "wb") as out,
        ):
            resp.raise_for_status()
            for chunk in resp.iter_bytes(1 << 20):
                out.write(chunk)
                size += len(chunk)
        download_s = time.perf_counter() - t0
        cpu.mark("download")
    finally:
        client.close()

    return PipelineResult(
        upload_s,
        create_s,
        processing_s,
        download_s,
        batch["id"],
        size,
        create_returned_at,
        completed_seen_at,
        polls,
    )


def verify_output(path: Path, n: int) -> None:
    ids = []
    with open(path, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            line = json.loads(raw)
            if line.get("error") or (line.get("response") or {}).get("status_code") != 200:
                raise AssertionError(f"a failed line in the output: {raw[:300]!r}")
            ids.append(line["custom_id"])
    unique = set(ids)
    expected = {f"req-{i}" for i in range(n)}
    if len(ids) != n:
        raise AssertionError(f"{len(ids)} output lines, expected {n}")
    if unique != expected:
        raise AssertionError(
            f"{len(unique)} unique custom_ids; missing {len(expected - unique)}, "
            f"unexpected {len(unique - expected)}"
        )


@dataclass
class Timeline:
    """When the work happened, from the ledger (epoch seconds)."""

    first_start: float
    last_start: float
    first_result: float
    last_result: float
    shards: int
    shard_attempts: int
    max_enqueues: int

    @classmethod
    def read(cls, db_url: str, batch_id: str) -> Timeline:
        engine = sa.create_engine(normalize_database_url(db_url))
        try:
            with engine.connect() as conn:
                req = conn.execute(
                    sa.text(
                        "SELECT min(started_at), max(started_at) FROM requests WHERE batch_id = :b"
                    ),
                    {"b": batch_id},
                ).one()
                res = conn.execute(
                    sa.text(
                        "SELECT min(created_at), max(created_at) FROM results WHERE batch_id = :b"
                    ),
                    {"b": batch_id},
                ).one()
                shards = conn.execute(
                    sa.text(
                        "SELECT count(*), coalesce(sum(attempts), 0), "
                        "coalesce(max(enqueue_count), 0) FROM shards WHERE batch_id = :b"
                    ),
                    {"b": batch_id},
                ).one()
        finally:
            engine.dispose()
        return cls(
            float(req[0]),
            float(req[1]),
            float(res[0]),
            float(res[1]),
            int(shards[0]),
            int(shards[1]),
            int(shards[2]),
        )


TASK_DONE = re.compile(r"Task conveyor\.run_shard\[[^\]]+\] succeeded in ([0-9.]+)s")


def shard_task_seconds(worker_log: str) -> list[float]:
    return [float(m.group(1)) for m in TASK_DONE.finditer(worker_log)]


# ---------------------------------------------------------------------------------------------
# the database baseline


SCRATCH = "bench_requests"


def db_baseline(db_url: str, rows: list[tuple], repeats: int, chunk: int) -> dict[str, float]:
    """Best-of-`repeats` seconds to insert `rows` into a table shaped like `requests` (same
    columns, constraints, indexes, foreign key): SQLAlchemy executemany in chunks of `chunk`
    rows in one transaction (what intake does), and psycopg COPY FROM STDIN."""
    batch_id = rows[0][0]
    ddl = [
        f"CREATE TABLE {SCRATCH} (LIKE requests INCLUDING CONSTRAINTS INCLUDING INDEXES)",
        f"ALTER TABLE {SCRATCH} ALTER COLUMN id ADD GENERATED BY DEFAULT AS IDENTITY",
        f"ALTER TABLE {SCRATCH} ADD FOREIGN KEY (batch_id) REFERENCES batches (id) "
        "ON DELETE CASCADE",
    ]
    engine = make_engine(normalize_database_url(db_url))  # the ledger's own engine settings
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO batches (id, input_file_id, endpoint, completion_window, "
                    "status, total, created_at) VALUES (:id, 'file-bench', :e, '24h', "
                    "'completed', :n, :t)"
                ),
                {"id": batch_id, "e": ENDPOINT, "n": len(rows), "t": int(time.time())},
            )
            for stmt in ddl:
                conn.execute(sa.text(stmt))
        scratch = sa.Table(SCRATCH, sa.MetaData(), autoload_with=engine)
        dicts = [dict(zip(COLUMNS, r, strict=True)) for r in rows]

        def truncate() -> None:
            with engine.begin() as conn:
                conn.execute(sa.text(f"TRUNCATE {SCRATCH} RESTART IDENTITY"))

        sa_times = []
        for _ in range(repeats):
            truncate()
            t0 = time.perf_counter()
            with engine.begin() as conn:
                for start in range(0, len(dicts), chunk):
                    conn.execute(sa.insert(scratch), dicts[start : start + chunk])
            sa_times.append(time.perf_counter() - t0)

        copy_times = []
        copy_sql = f"COPY {SCRATCH} ({', '.join(COLUMNS)}) FROM STDIN"
        for _ in range(repeats):
            truncate()
            with psycopg.connect(db_url) as pconn:
                t0 = time.perf_counter()
                with pconn.cursor() as cur, cur.copy(copy_sql) as copy:
                    for row in rows:
                        copy.write_row(row)
                pconn.commit()
                copy_times.append(time.perf_counter() - t0)

        with engine.begin() as conn:
            n = conn.execute(sa.text(f"SELECT count(*) FROM {SCRATCH}")).scalar_one()
            if n != len(rows):
                raise AssertionError(f"COPY stored {n} rows, expected {len(rows)}")
            conn.execute(sa.text(f"DROP TABLE {SCRATCH}"))
            conn.execute(sa.text("DELETE FROM batches WHERE id = :id"), {"id": batch_id})
    finally:
        engine.dispose()
    return {
        "sa_s": min(sa_times),
        "sa_s_all": sa_times,
        "copy_s": min(copy_times),
        "copy_s_all": copy_times,
    }


# ---------------------------------------------------------------------------------------------
# main


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=None, help="default 20000 (2000 --quick)")
    ap.add_argument("--quick", action="store_true", help="2,000 requests: a smoke run")
    ap.add_argument(
        "--shard-size", type=int, default=32, help="CONVEYOR_SHARD_SIZE: requests per shard task"
    )
    ap.add_argument(
        "--concurrency", type=int, default=8, help="the worker's shard tasks in flight (threads)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the database and the logs")
    ap.add_argument("--redis-db", type=int, default=12, help="Redis database index (flushed)")
    ap.add_argument(
        "--private-redis",
        action="store_true",
        help="start a throwaway redis-server instead of using REDIS_URL (no interference from "
        "test runs that flush or reconcile the same Redis database)",
    )
    ap.add_argument("--poll-interval", type=float, default=0.2, help="seconds between polls")
    ap.add_argument("--timeout", type=float, default=1800, help="give up on the batch after this")
    ap.add_argument("--db-repeats", type=int, default=3, help="baseline runs (best one counts)")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.num_requests is None:
        args.num_requests = 2000 if args.quick else 20000
    if args.num_requests < 1 or args.shard_size < 1 or args.concurrency < 1:
        ap.error("--num-requests, --shard-size and --concurrency must be positive")
    return args


def _raise_on_signal(signum, _frame) -> None:
    raise SystemExit(128 + signum)  # run the `finally` clean-up on SIGTERM / SIGHUP too


def main(argv=None) -> dict:
    args = parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on_signal)
    n = args.num_requests

    server_url = os.environ.get("DATABASE_URL") or DEFAULT_DATABASE_URL
    db_name = f"conveyor_bench_{uuid.uuid4().hex[:10]}"
    db_url = with_database(server_url, db_name)
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    private_redis = None
    if args.private_redis:
        redis_server, private_redis = start_private_redis(root)
    else:
        redis_server = os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL
    redis_url = redis_with_db(redis_server, args.redis_db)
    stack = Stack(
        server_url=with_database(server_url, urlsplit(server_url).path.lstrip("/") or "postgres"),
        admin_url=normalize_database_url(server_url),
        db_name=db_name,
        db_url=db_url,
        redis_url=redis_url,
        root=root,
    )
    stack.env = dict(os.environ)
    stack.env.update(
        DATABASE_URL=db_url,
        REDIS_URL=redis_url,
        CONVEYOR_DATA_DIR=str(root / "data"),
        CONVEYOR_SHARD_SIZE=str(args.shard_size),
        CONVEYOR_MAX_BATCH_LINES=str(max(50_000, n)),
        PYTHONUNBUFFERED="1",
    )
    load_before = loadavg()
    code = git_state()
    failed = True
    cpu: CpuMeter | None = None
    interrupted = False
    try:
        print(
            f"pipeline bench: {n:,} requests, shard size {args.shard_size}, worker concurrency "
            f"{args.concurrency}, {os.cpu_count()} CPUs, load average {load_before}, code {code}"
        )
        print(f"database {db_name} on {urlsplit(server_url).netloc}, redis {redis_url}")
        print(f"logs under {root}\n")
        stack.create_database()
        stack.flush_redis()
        input_path = root / "input.jsonl"
        input_bytes = write_workload(input_path, n, args.seed)

        t0 = time.perf_counter()
        stack.start_api()
        stack.start_worker(args.concurrency)
        startup_s = time.perf_counter() - t0

        cpu = CpuMeter(stack)
        res = run_pipeline(
            stack, input_path, root / "output.jsonl", n, args.poll_interval, args.timeout, cpu
        )
        cpu.close()
        verify_output(root / "output.jsonl", n)
        timeline = Timeline.read(db_url, res.batch_id)
        tasks = shard_task_seconds(stack.log("worker"))
        stack.stop()

        base = None
        if not args.skip_baseline:
            rows = request_rows(input_path, "batch_bench_baseline", args.shard_size)
            base = db_baseline(db_url, rows, args.db_repeats, chunk=2000)
        failed = False
    except (KeyboardInterrupt, SystemExit):
        interrupted = True
        raise
    finally:
        if cpu is not None:
            cpu.close()
        stack.stop()
        if failed and not interrupted:
            for name in ("api", "worker"):
                if stack.log(name):
                    print(f"\n---- last lines of the {name} log ({root / (name + '.log')}) ----")
                    print(stack.log_tail(name))
        with contextlib.suppress(Exception):
            stack.flush_redis()
        if private_redis is not None:
            private_redis.terminate()
            try:
                private_redis.wait(10)
            except subprocess.TimeoutExpired:
                private_redis.kill()
        if args.keep:
            print(f"\nkept database {db_url} and logs under {root}")
        else:
            try:
                stack.drop_database()
            except Exception as err:
                print(f"could not drop database {db_name}: {err}", file=sys.stderr)
            shutil.rmtree(root, ignore_errors=True)

    # ---- report ----------------------------------------------------------------------------
    total_rps = rate(n, res.total_s)
    overhead_ms = res.total_s * 1000 / n
    print(
        f"input {input_bytes / 1e6:.1f} MB, output {res.output_bytes / 1e6:.1f} MB; stack up in "
        f"{startup_s:.1f}s; {n:,} unique custom_ids came back\n"
    )

    cpu_cols = ("api", "worker", "postgres", "client")
    rows = []
    for phase, seconds in (
        ("upload", res.upload_s),
        ("create (validate+insert+enqueue)", res.create_s),
        ("processing until completed", res.processing_s),
        ("download", res.download_s),
        ("end to end", res.total_s),
    ):
        key = phase.split()[0]
        spent = cpu.phases.get(key)
        if spent is None:  # the end-to-end row sums the phases
            spent = {c: sum(p.get(c, 0.0) for p in cpu.phases.values()) for c in cpu_cols}
        rows.append(
            (
                phase,
                f"{seconds:.3f}",
                f"{rate(n, seconds):,.0f}",
                f"{seconds * 1e6 / n:,.0f}",
                *(f"{spent.get(c, 0.0):.2f}" for c in cpu_cols),
            )
        )
    table(
        rows,
        ("phase", "seconds", "req/s", "us/req", *(f"cpu {c} s" for c in cpu_cols)),
    )

    queue_delay = timeline.first_start - res.create_returned_at
    work_s = timeline.last_result - timeline.first_start
    tail_s = res.completed_seen_at - timeline.last_result
    print(
        f"\ninside processing (from the ledger): first shard started {queue_delay:+.3f}s after "
        f"create returned; shards ran {timeline.first_start:.3f}->{timeline.last_result:.3f} = "
        f"{work_s:.3f}s ({rate(n, work_s):,.0f} req/s); last result to completed seen "
        f"{tail_s:.3f}s (poll every {args.poll_interval}s, {res.polls} polls)"
    )
    print(
        f"{timeline.shards} shards, {timeline.shard_attempts} shard runs, "
        f"max enqueues per shard {timeline.max_enqueues}"
    )
    if timeline.max_enqueues > 1:
        print(
            "WARNING: shards were sent more than once: a shard message went missing and the "
            "reconciler re-sent it, which stalls the batch for tens of seconds. If other "
            "deployments or test runs share this Redis server (tests flush and reconcile random "
            "databases 1-15), rerun with --private-redis."
        )
    if tasks:
        tasks_sorted = sorted(tasks)
        p95 = tasks_sorted[min(len(tasks) - 1, int(0.95 * len(tasks)))]
        busy = sum(tasks) / (args.concurrency * work_s) if work_s > 0 else 0.0
        print(
            f"shard tasks: {len(tasks)} done, mean {statistics.mean(tasks) * 1e3:.1f} ms, "
            f"median {statistics.median(tasks) * 1e3:.1f} ms, p95 {p95 * 1e3:.1f} ms, max "
            f"{tasks_sorted[-1] * 1e3:.1f} ms; task threads busy ~{busy:.0%} of the shard phase"
        )

    goal_met = total_rps >= GOAL_RPS
    print(
        f"\ngoal >= {GOAL_RPS:,.0f} requests/s end to end: "
        f"{'MET' if goal_met else 'NOT MET'} ({total_rps:,.0f} requests/s, "
        f"{overhead_ms:.3f} ms of overhead per request)"
    )

    sa_rps = copy_rps = None
    if base is not None:
        sa_rps, copy_rps = rate(n, base["sa_s"]), rate(n, base["copy_s"])
        print(f"\nraw database speed for the same {n:,} rows (best of {args.db_repeats}):")
        table(
            [
                (
                    "SQLAlchemy executemany (2,000-row chunks)",
                    f"{base['sa_s']:.3f}",
                    f"{sa_rps:,.0f}",
                    " ".join(f"{t:.3f}" for t in base["sa_s_all"]),
                ),
                (
                    "psycopg COPY FROM STDIN",
                    f"{base['copy_s']:.3f}",
                    f"{copy_rps:,.0f}",
                    " ".join(f"{t:.3f}" for t in base["copy_s_all"]),
                ),
            ],
            ("insert into a scratch `requests`", "seconds", "rows/s", "all runs"),
        )
        print(
            f"end to end is {total_rps / copy_rps:.1%} of the COPY rate and "
            f"{total_rps / sa_rps:.1%} of the executemany rate"
        )

    result = {
        "bench": "pipeline",
        "quick": args.quick,
        "num_requests": n,
        "shard_size": args.shard_size,
        "concurrency": args.concurrency,
        "code": code,
        "cpus": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
        "upload_s": round(res.upload_s, 4),
        "create_s": round(res.create_s, 4),
        "processing_s": round(res.processing_s, 4),
        "download_s": round(res.download_s, 4),
        "total_s": round(res.total_s, 4),
        "e2e_req_s": round(total_rps, 1),
        "overhead_ms_per_request": round(overhead_ms, 4),
        "shard_phase_s": round(work_s, 4),
        "shard_phase_req_s": round(rate(n, work_s), 1),
        "queue_delay_s": round(queue_delay, 4),
        "finalize_tail_s": round(tail_s, 4),
        "max_enqueues_per_shard": timeline.max_enqueues,
        "private_redis": args.private_redis,
        "shard_task_mean_ms": round(statistics.mean(tasks) * 1e3, 2) if tasks else None,
        "cpu_s": {
            phase: {k: round(v, 3) for k, v in spent.items()} for phase, spent in cpu.phases.items()
        },
        "sa_executemany_rows_s": round(sa_rps, 1) if sa_rps else None,
        "copy_rows_s": round(copy_rps, 1) if copy_rps else None,
        "e2e_over_copy": round(total_rps / copy_rps, 4) if copy_rps else None,
        "goal_req_s": GOAL_RPS,
        "goal_met": goal_met,
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
