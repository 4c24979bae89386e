"""Reuse lookups at the scale of a large suite (`python bench/reuse.py --lookups`): checking
100,000 lines against the ledger for earlier results should take seconds, not minutes, on
SQLite and on PostgreSQL alike.

Fills a freshly migrated ledger with `--lines` (100,000) completed results of one project and
model fingerprint, each with its request key, then times the worker's lookup
(`ledger.reuse.find_reusable`) for `--lines` keys that all have a result and for as many that
have none, two ways:
  - by shard, as the worker looks them up: one call per shard of `SHARD_SIZE` keys (the
    default CONVEYOR_SHARD_SIZE), each in its own read session, one after another;
  - in one call with every key (the lookup queries them in chunks of `LOOKUP_CHUNK`).
Goal: each under 10 s. It also reads the query plan of one chunk (EXPLAIN) and says whether
the lookup uses the index `ix_results_reuse`.

SQLite: a ledger file in a temporary folder. PostgreSQL: a scratch database on the server of
DATABASE_URL (default 127.0.0.1:5432), dropped at the end. The lookups run on the table as
filled, before any ANALYZE (autovacuum has not come by yet, or is off): the planner's worst
case, where a query the statistics would rescue goes wrong; `--analyze` gathers them first.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import date
from pathlib import Path

from machine import cpu_isa, git_state, loadavg
from report import table
from sqlalchemy import insert, text

from conveyor.ledger.db import Ledger
from conveyor.ledger.migrate import upgrade
from conveyor.ledger.models import REUSE_INDEX, BatchRow, RequestRow, ResultRow
from conveyor.ledger.reuse import LOOKUP_CHUNK, find_reusable, lookup_plan
from conveyor.settings import Settings, normalize_database_url
from conveyor.testing import databases, servers

GOAL_S = 10.0
PROJECT, FINGERPRINT = "nightly", "fp-" + "0" * 32
BATCH = "batch_reuse_lookup"
FILL_CHUNK = 5000
SHARD_SIZE = Settings.model_fields["shard_size"].default  # keys per lookup, as the worker's


def key(i: int, salt: str = "") -> str:
    """A request key as `request_outcome.reuse_key` makes them (32 hex digits)."""
    return hashlib.blake2b(f"{salt}line-{i}".encode(), digest_size=16).hexdigest()


def result_line(i: int) -> str:
    message = {"role": "assistant", "content": f"answer {i} " * 8}
    body = {
        "id": f"chatcmpl-{i}",
        "object": "chat.completion",
        "model": "suite",
        "choices": [{"index": 0, "finish_reason": "stop", "message": message}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 16, "total_tokens": 56},
    }
    response = {"status_code": 200, "request_id": f"req_{i}", "body": body}
    line = {"id": f"batch_req_{i}", "custom_id": f"task-{i}", "response": response, "error": None}
    return json.dumps(line, separators=(",", ":"))


def fill(ledger: Ledger, lines: int) -> float:
    """`lines` completed, keyed results of one batch of PROJECT under FINGERPRINT; seconds."""
    started = time.perf_counter()
    with ledger.session() as session:
        session.add(
            BatchRow(id=BATCH, project=PROJECT, input_file_id="file-suite", model="suite",
                     endpoint="/v1/chat/completions", completion_window="24h",
                     status="completed", created_at=0, total=lines)
        )  # fmt: skip
    for start in range(0, lines, FILL_CHUNK):
        ids = range(start + 1, min(start + FILL_CHUNK, lines) + 1)
        with ledger.session() as session:
            session.execute(insert(RequestRow), [request_row(i) for i in ids])
            session.execute(insert(ResultRow), [result_row(i) for i in ids])
    return time.perf_counter() - started


def request_row(i: int) -> dict:
    return {"id": i, "batch_id": BATCH, "shard_index": i // 32, "line": i,
            "custom_id": f"task-{i}", "raw": "{}"}  # fmt: skip


def result_row(i: int) -> dict:
    return {"request_id": i, "batch_id": BATCH, "line_id": f"batch_req_{i}", "ok": True,
            "output": result_line(i), "prompt_tokens": 40, "completion_tokens": 16,
            "cached_tokens": 0, "worker": "w1", "created_at": time.time(),
            "fingerprint": FINGERPRINT, "request_key": key(i)}  # fmt: skip


def by_shard(ledger: Ledger, keys: list[str], shard_size: int) -> int:
    """The worker's way: one lookup per shard, each in its own read session."""
    found = 0
    for start in range(0, len(keys), shard_size):
        with ledger.reads() as session:
            shard = keys[start : start + shard_size]
            found += len(find_reusable(session, PROJECT, FINGERPRINT, shard))
    return found


def in_one_call(ledger: Ledger, keys: list[str], _shard_size: int) -> int:
    with ledger.reads() as session:
        return len(find_reusable(session, PROJECT, FINGERPRINT, keys))


Lookup = Callable[[Ledger, list[str], int], int]


def timed(lookup: Lookup, ledger: Ledger, keys: list[str], shard_size: int) -> tuple[float, int]:
    started = time.perf_counter()
    found = lookup(ledger, keys, shard_size)
    return time.perf_counter() - started, found


@contextmanager
def ledger_on(backend: str) -> Iterator[Ledger]:
    """A freshly migrated, empty ledger on `backend`, gone at exit."""
    with ExitStack() as stack:
        if backend == "sqlite":
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="conveyor-lookup-"))
            url = f"sqlite:///{Path(folder) / 'ledger.db'}"
        else:
            server = stack.enter_context(servers.postgres_server())
            plain = stack.enter_context(databases.scratch_database(server, "conveyor_bench_"))
            url = normalize_database_url(plain)
        upgrade(url)
        ledger = Ledger(url)
        stack.callback(ledger.dispose)
        yield ledger


def measure(backend: str, args: argparse.Namespace) -> dict:
    hits = [key(i) for i in range(1, args.lines + 1)]
    misses = [key(i, salt="edited-") for i in range(1, args.lines + 1)]
    with ledger_on(backend) as ledger:
        fill_s = fill(ledger, args.lines)
        if args.analyze:
            with ledger.session() as session:
                session.execute(text("ANALYZE"))
        with ledger.reads() as session:
            plan = lookup_plan(session, FINGERPRINT, hits[:LOOKUP_CHUNK])
        report: dict = {"fill_s": round(fill_s, 2), "uses_index": REUSE_INDEX in plan}
        for name, lookup in (("by_shard", by_shard), ("one_call", in_one_call)):
            for kind, keys, expected in (("hits", hits, len(hits)), ("misses", misses, 0)):
                seconds, found = timed(lookup, ledger, keys, SHARD_SIZE)
                assert found == expected, f"{backend} {name} {kind}: {found} found"
                report[f"{name}_{kind}_s"] = round(seconds, 3)
    shown = "\n".join(line[:117] + "..." if len(line) > 120 else line for line in plan.splitlines())
    print(f"\n{backend}: the plan of a lookup of {LOOKUP_CHUNK} keys:\n{shown}")
    return report


def run_lookups(args: argparse.Namespace) -> dict:
    """The lookups of `args.lines` keys on `args.backend` ("both": SQLite and PostgreSQL),
    printed; the record, timings in seconds."""
    backends = ("sqlite", "postgresql") if args.backend == "both" else (args.backend,)
    measured = {backend: measure(backend, args) for backend in backends}
    columns = ("by_shard_hits_s", "by_shard_misses_s", "one_call_hits_s", "one_call_misses_s")
    slowest = {backend: max(m[c] for c in columns) for backend, m in measured.items()}
    rows = [(b, m["fill_s"], *(m[c] for c in columns), m["uses_index"])
            for b, m in measured.items()]  # fmt: skip
    print(f"\n{args.lines:,} keys looked up (seconds; goal: each under {GOAL_S:.0f} s)")
    header = ("ledger", "fill", "by shard: hits", "misses", "one call: hits", "misses", "index")
    table(rows, header)
    return {
        "bench": "reuse",
        "measured": "lookups",
        "lines": args.lines,
        "shard_size": SHARD_SIZE,
        "lookup_chunk": LOOKUP_CHUNK,
        "analyzed": args.analyze,
        **{f"lookup_{backend}_s": seconds for backend, seconds in slowest.items()},
        **measured,
        "goal_met": max(slowest.values()) < GOAL_S
        and all(m["uses_index"] for m in measured.values()),
        "loadavg": loadavg(),
        "cpu_isa": cpu_isa(),
        "date": date.today().isoformat(),
        "code": git_state(),
    }
