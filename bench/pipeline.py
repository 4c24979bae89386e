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

PostgreSQL comes from DATABASE_URL (default postgresql://postgres@127.0.0.1:5432/test; a
throwaway server when nothing answers there): a database conveyor_bench_<hex> is created on
that server and dropped at the end (--keep keeps it, and the logs). Redis comes from REDIS_URL
(default redis://127.0.0.1:6379/), using the database index --redis-db (default 12), which is
flushed first and last. The test suite flushes
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
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psycopg
import sqlalchemy as sa
from machine import CpuMeter, git_state, loadavg, process_cpu_seconds, rate
from report import print_result, table

from conveyor.ledger.db import make_engine
from conveyor.ledger.states import TERMINAL
from conveyor.settings import normalize_database_url
from conveyor.testing import LocalRedis, Stack, service_env, write_jsonl
from conveyor.testing.batches import chat_request
from conveyor.testing.databases import (
    flush_redis,
    migrate,
    redis_database,
    scratch_database,
    with_database,
)
from conveyor.testing.servers import postgres_server, redis_server, throwaway

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
WORKER = "bench-echo"

# ---------------------------------------------------------------------------------------------
# the deployment: a database, a Redis db, the API and one echo worker


@dataclass
class Deployment:
    stack: Stack
    server_url: str  # plain postgresql:// URL of the server's maintenance database
    db_url: str  # plain postgresql:// URL of the bench database

    @property
    def db_name(self) -> str:
        return urlsplit(self.db_url).path.lstrip("/")


@contextmanager
def deployment(args: argparse.Namespace) -> Iterator[Deployment]:
    """A fresh migrated database and an emptied Redis database (of a throwaway redis-server
    with --private-redis), and a stack on them whose processes are stopped at exit; the
    database and the logs are removed at exit unless --keep."""
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    with ExitStack() as on_exit:
        on_exit.callback(clean_up, root, args.keep)
        server = on_exit.enter_context(postgres_server())
        if args.private_redis:
            redis_url = on_exit.enter_context(throwaway(LocalRedis, "conveyor-redis-")).url
        else:
            redis_url = on_exit.enter_context(redis_server())
        redis_url = redis_database(redis_url, args.redis_db)
        on_exit.callback(flush_quietly, redis_url)
        db_url = on_exit.enter_context(scratch_database(server, "conveyor_bench_", keep=args.keep))
        if args.keep:
            on_exit.callback(print, f"\nkept database {db_url} and logs under {root}")
        print(
            f"database {urlsplit(db_url).path[1:]} on {urlsplit(server).netloc}, redis {redis_url}"
        )
        print(f"logs under {root}\n")
        migrate(db_url)
        env = service_env(normalize_database_url(db_url), redis_url, root)
        env.update(
            CONVEYOR_SHARD_SIZE=str(args.shard_size),
            CONVEYOR_MAX_BATCH_LINES=str(max(50_000, args.num_requests)),
        )
        stack = Stack(env=env, root=root)
        on_exit.callback(stack.stop)
        on_exit.enter_context(logs_on_failure(stack))
        server_url = with_database(server, urlsplit(server).path.lstrip("/") or "postgres")
        yield Deployment(stack, server_url, db_url)


def clean_up(root: Path, keep: bool) -> None:
    if not keep:
        shutil.rmtree(root, ignore_errors=True)


def flush_quietly(redis_url: str) -> None:
    with contextlib.suppress(Exception):
        flush_redis(redis_url)


@contextmanager
def logs_on_failure(stack: Stack) -> Iterator[None]:
    """On an error (not an interrupt), the last lines of the API's and the worker's logs."""
    try:
        yield
    except Exception:
        for name in ("api", WORKER):
            if stack.log(name):
                print(f"\n---- last lines of the {name} log ({stack.root / (name + '.log')}) ----")
                print(stack.log_tail(name))
        raise


class PostgresBackends:
    """CPU seconds of the Postgres backends serving one database.

    Backends come and go (the pools close overflow connections), so a thread samples them
    every `interval` seconds and keeps each one's last reading: a backend that exits loses at
    most its last `interval` of CPU from the count.
    """

    def __init__(self, server_url: str, db_name: str, interval: float = 0.2) -> None:
        self.db_name, self.interval = db_name, interval
        self.latest: dict[int, float] = {}
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.conn = psycopg.connect(server_url, autocommit=True)
        self.thread = threading.Thread(target=self._loop, daemon=True, name="bench-cpu")
        self.thread.start()

    def _poll(self) -> None:
        with self.lock:
            try:
                query = "SELECT pid FROM pg_stat_activity WHERE datname = %s"
                pids = [pid for (pid,) in self.conn.execute(query, (self.db_name,))]
            except psycopg.Error:
                return
            for pid in pids:
                cpu = process_cpu_seconds(pid)
                if cpu is not None:
                    self.latest[pid] = cpu

    def _loop(self) -> None:
        while not self.stopped.wait(self.interval):
            self._poll()

    def cpu_seconds(self) -> float:
        self._poll()
        with self.lock:
            return sum(self.latest.values())

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(5)
        with self.lock:
            self.conn.close()


def cpu_meter(d: Deployment, backends: PostgresBackends) -> CpuMeter:
    """CPU seconds spent by the API, the worker, the bench database's Postgres backends and
    this client between successive marks."""

    def process(name: str):
        pid = d.stack.named[name].pid
        return lambda: process_cpu_seconds(pid) or 0.0

    return CpuMeter(
        {
            "api": process("api"),
            "worker": process(WORKER),
            "postgres": backends.cpu_seconds,
            "client": time.process_time,
        }
    )


# ---------------------------------------------------------------------------------------------
# workload


def write_workload(path: Path, n: int, seed: int) -> int:
    """A chat-completions batch file of `n` short requests; returns its size in bytes."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota"]
    lines = (
        chat_request(
            f"req-{i}",
            "echo",
            rng.choice(SYSTEM_PROMPTS),
            f"question {i}: " + " ".join(rng.choices(words, k=6)),
            max_tokens=16,
        )
        for i in range(n)
    )
    return write_jsonl(path, lines).stat().st_size


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
    args: argparse.Namespace,
    cpu: CpuMeter,
) -> PipelineResult:
    """Upload, create, poll until completed and download, each phase timed and marked."""
    client = httpx.Client(base_url=stack.api_url, timeout=httpx.Timeout(600.0, connect=10.0))
    try:
        t0 = time.perf_counter()
        file_id = upload(client, input_path)
        upload_s = time.perf_counter() - t0
        cpu.mark("upload")

        t0 = time.perf_counter()
        batch = create(client, file_id)
        create_s = time.perf_counter() - t0
        create_returned_at = time.time()
        cpu.mark("create")

        t0 = time.perf_counter()
        batch, polls = poll_until_done(client, stack, batch, args)
        processing_s = time.perf_counter() - t0
        completed_seen_at = time.time()
        cpu.mark("processing")
        check_completed(batch, args.num_requests)

        t0 = time.perf_counter()
        size = download(client, batch["output_file_id"], output_path)
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


def upload(client: httpx.Client, input_path: Path) -> str:
    with open(input_path, "rb") as f:
        r = client.post(
            "/v1/files",
            files={"file": (input_path.name, f, "application/jsonl")},
            data={"purpose": "batch"},
        )
    r.raise_for_status()
    return r.json()["id"]


def create(client: httpx.Client, file_id: str) -> dict:
    r = client.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": ENDPOINT, "completion_window": "24h"},
    )
    r.raise_for_status()
    batch = r.json()
    if batch["status"] == "failed":
        raise RuntimeError(f"the batch failed validation: {batch.get('errors')}")
    return batch


def poll_until_done(
    client: httpx.Client, stack: Stack, batch: dict, args: argparse.Namespace
) -> tuple[dict, int]:
    """The batch once it is finished, and how many polls that took."""
    polls = 0
    deadline = time.monotonic() + args.timeout
    while batch["status"] not in TERMINAL:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"batch {batch['id']} not done after {args.timeout}s: {batch['request_counts']}"
            )
        for name, proc in stack.named.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{stack.log_tail(name)}")
        time.sleep(args.poll_interval)
        r = client.get(f"/v1/batches/{batch['id']}")
        r.raise_for_status()
        batch = r.json()
        polls += 1
    return batch, polls


def check_completed(batch: dict, n: int) -> None:
    if batch["status"] != "completed":
        raise RuntimeError(f"batch ended {batch['status']}: {batch}")
    counts = batch["request_counts"]
    if counts["completed"] != n or counts["failed"]:
        raise RuntimeError(f"unexpected request counts {counts}")
    if batch.get("error_file_id"):
        raise RuntimeError("the batch has an error file; expected none")


def download(client: httpx.Client, file_id: str, output_path: Path) -> int:
    """Stream a file to `output_path`; returns its size."""
    size = 0
    with (
        client.stream("GET", f"/v1/files/{file_id}/content") as resp,
        open(output_path, "wb") as out,
    ):
        resp.raise_for_status()
        for chunk in resp.iter_bytes(1 << 20):
            out.write(chunk)
            size += len(chunk)
    return size


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
    engine = make_engine(normalize_database_url(db_url))  # the ledger's own engine settings
    try:
        create_scratch(engine, batch_id, len(rows))
        sa_times = time_executemany(engine, rows, repeats, chunk)
        copy_times = time_copy(engine, db_url, rows, repeats)
        drop_scratch(engine, batch_id, len(rows))
    finally:
        engine.dispose()
    return {
        "sa_s": min(sa_times),
        "sa_s_all": sa_times,
        "copy_s": min(copy_times),
        "copy_s_all": copy_times,
    }


def create_scratch(engine: sa.Engine, batch_id: str, n: int) -> None:
    """The scratch table, and the batch its rows belong to."""
    ddl = [  # its columns' defaults too (those the ledger fills, as engine_failures), but an id
        # of its own rather than drawn from requests' sequence
        f"CREATE TABLE {SCRATCH} "
        "(LIKE requests INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)",
        f"ALTER TABLE {SCRATCH} ALTER COLUMN id DROP DEFAULT",
        f"ALTER TABLE {SCRATCH} ALTER COLUMN id ADD GENERATED BY DEFAULT AS IDENTITY",
        f"ALTER TABLE {SCRATCH} ADD FOREIGN KEY (batch_id) REFERENCES batches (id) "
        "ON DELETE CASCADE",
    ]
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO batches (id, input_file_id, endpoint, completion_window, "
                "status, total, created_at) VALUES (:id, 'file-bench', :e, '24h', "
                "'completed', :n, :t)"
            ),
            {"id": batch_id, "e": ENDPOINT, "n": n, "t": int(time.time())},
        )
        for stmt in ddl:
            conn.execute(sa.text(stmt))


def truncate_scratch(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(f"TRUNCATE {SCRATCH} RESTART IDENTITY"))


def time_executemany(engine: sa.Engine, rows: list[tuple], repeats: int, chunk: int) -> list:
    scratch = sa.Table(SCRATCH, sa.MetaData(), autoload_with=engine)
    dicts = [dict(zip(COLUMNS, r, strict=True)) for r in rows]
    times = []
    for _ in range(repeats):
        truncate_scratch(engine)
        t0 = time.perf_counter()
        with engine.begin() as conn:
            for start in range(0, len(dicts), chunk):
                conn.execute(sa.insert(scratch), dicts[start : start + chunk])
        times.append(time.perf_counter() - t0)
    return times


def time_copy(engine: sa.Engine, db_url: str, rows: list[tuple], repeats: int) -> list:
    times = []
    copy_sql = f"COPY {SCRATCH} ({', '.join(COLUMNS)}) FROM STDIN"
    for _ in range(repeats):
        truncate_scratch(engine)
        with psycopg.connect(db_url) as pconn:
            t0 = time.perf_counter()
            with pconn.cursor() as cur, cur.copy(copy_sql) as copy:
                for row in rows:
                    copy.write_row(row)
            pconn.commit()
            times.append(time.perf_counter() - t0)
    return times


def drop_scratch(engine: sa.Engine, batch_id: str, n: int) -> None:
    """Check that COPY stored every row, then drop the table and its batch."""
    with engine.begin() as conn:
        stored = conn.execute(sa.text(f"SELECT count(*) FROM {SCRATCH}")).scalar_one()
        if stored != n:
            raise AssertionError(f"COPY stored {stored} rows, expected {n}")
        conn.execute(sa.text(f"DROP TABLE {SCRATCH}"))
        conn.execute(sa.text("DELETE FROM batches WHERE id = :id"), {"id": batch_id})


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


def _raise_on_signal(signum, _frame) -> None:
    raise SystemExit(128 + signum)  # run the `finally` clean-up on SIGTERM / SIGHUP too


@dataclass
class Measured:
    """What one bench run measured."""

    input_bytes: int
    startup_s: float
    res: PipelineResult
    cpu: CpuMeter
    timeline: Timeline
    tasks: list[float]
    base: dict | None


def measure(args: argparse.Namespace, d: Deployment) -> Measured:
    """Write the workload, start the stack, run the batch through it and check the output,
    then (with the stack stopped) the database baseline."""
    stack, root, n = d.stack, d.stack.root, args.num_requests
    input_path = root / "input.jsonl"
    input_bytes = write_workload(input_path, n, args.seed)

    t0 = time.perf_counter()
    stack.start_api()
    stack.start_worker(WORKER, "echo", "--concurrency", str(args.concurrency), served="")
    startup_s = time.perf_counter() - t0

    backends = PostgresBackends(d.server_url, d.db_name)
    try:
        cpu = cpu_meter(d, backends)
        res = run_pipeline(stack, input_path, root / "output.jsonl", args, cpu)
    finally:
        backends.close()
    verify_output(root / "output.jsonl", n)
    timeline = Timeline.read(d.db_url, res.batch_id)
    tasks = shard_task_seconds(stack.log(WORKER))
    stack.stop()

    base = None
    if not args.skip_baseline:
        rows = request_rows(input_path, "batch_bench_baseline", args.shard_size)
        base = db_baseline(d.db_url, rows, args.db_repeats, chunk=2000)
    return Measured(input_bytes, startup_s, res, cpu, timeline, tasks, base)


CPU_COLUMNS = ("api", "worker", "postgres", "client")


def print_phases(n: int, m: Measured) -> None:
    res = m.res
    print(
        f"input {m.input_bytes / 1e6:.1f} MB, output {res.output_bytes / 1e6:.1f} MB; stack up "
        f"in {m.startup_s:.1f}s; {n:,} unique custom_ids came back\n"
    )
    rows = []
    for phase, seconds in (
        ("upload", res.upload_s),
        ("create (validate+insert+enqueue)", res.create_s),
        ("processing until completed", res.processing_s),
        ("download", res.download_s),
        ("end to end", res.total_s),
    ):
        spent = m.cpu.phases.get(phase.split()[0])
        if spent is None:  # the end-to-end row sums the phases
            spent = {c: sum(p.get(c, 0.0) for p in m.cpu.phases.values()) for c in CPU_COLUMNS}
        rows.append(
            (
                phase,
                f"{seconds:.3f}",
                f"{rate(n, seconds):,.0f}",
                f"{seconds * 1e6 / n:,.0f}",
                *(f"{spent.get(c, 0.0):.2f}" for c in CPU_COLUMNS),
            )
        )
    table(rows, ("phase", "seconds", "req/s", "us/req", *(f"cpu {c} s" for c in CPU_COLUMNS)))


def print_inside(args: argparse.Namespace, m: Measured) -> None:
    """When the work happened inside the processing phase, from the ledger and the worker."""
    res, timeline, tasks = m.res, m.timeline, m.tasks
    work_s = timeline.last_result - timeline.first_start
    print(
        f"\ninside processing (from the ledger): first shard started "
        f"{timeline.first_start - res.create_returned_at:+.3f}s after create returned; shards "
        f"ran {timeline.first_start:.3f}->{timeline.last_result:.3f} = {work_s:.3f}s "
        f"({rate(args.num_requests, work_s):,.0f} req/s); last result to completed seen "
        f"{res.completed_seen_at - timeline.last_result:.3f}s (poll every "
        f"{args.poll_interval}s, {res.polls} polls)"
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


def print_baseline(args: argparse.Namespace, base: dict, total_rps: float) -> tuple:
    """The raw database speed for the same rows; returns its two rates."""
    n = args.num_requests
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
    return sa_rps, copy_rps


def report(args: argparse.Namespace, m: Measured, load_before: float | None, code) -> dict:
    """Print the report; returns the headline numbers."""
    n, res, timeline, tasks = args.num_requests, m.res, m.timeline, m.tasks
    total_rps = rate(n, res.total_s)
    print_phases(n, m)
    print_inside(args, m)
    goal_met = total_rps >= GOAL_RPS
    print(
        f"\ngoal >= {GOAL_RPS:,.0f} requests/s end to end: "
        f"{'MET' if goal_met else 'NOT MET'} ({total_rps:,.0f} requests/s, "
        f"{res.total_s * 1000 / n:.3f} ms of overhead per request)"
    )
    sa_rps = copy_rps = None
    if m.base is not None:
        sa_rps, copy_rps = print_baseline(args, m.base, total_rps)
    work_s = timeline.last_result - timeline.first_start
    return {
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
        "overhead_ms_per_request": round(res.total_s * 1000 / n, 4),
        "shard_phase_s": round(work_s, 4),
        "shard_phase_req_s": round(rate(n, work_s), 1),
        "queue_delay_s": round(timeline.first_start - res.create_returned_at, 4),
        "finalize_tail_s": round(res.completed_seen_at - timeline.last_result, 4),
        "max_enqueues_per_shard": timeline.max_enqueues,
        "private_redis": args.private_redis,
        "shard_task_mean_ms": round(statistics.mean(tasks) * 1e3, 2) if tasks else None,
        "cpu_s": {
            phase: {k: round(v, 3) for k, v in spent.items()}
            for phase, spent in m.cpu.phases.items()
        },
        "sa_executemany_rows_s": round(sa_rps, 1) if sa_rps else None,
        "copy_rows_s": round(copy_rps, 1) if copy_rps else None,
        "e2e_over_copy": round(total_rps / copy_rps, 4) if copy_rps else None,
        "goal_req_s": GOAL_RPS,
        "goal_met": goal_met,
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on_signal)
    load_before, code = loadavg(), git_state()
    print(
        f"pipeline bench: {args.num_requests:,} requests, shard size {args.shard_size}, worker "
        f"concurrency {args.concurrency}, {os.cpu_count()} CPUs, load average {load_before}, "
        f"code {code}"
    )
    with deployment(args) as d:
        measured = measure(args, d)
    result = report(args, measured, load_before, code)
    print_result(result)
    return result


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
