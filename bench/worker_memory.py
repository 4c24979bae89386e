"""A worker's memory over a long run: batch after batch of chat requests whose prompts vary in
length, through the production layout (API, Celery worker, PostgreSQL, Redis) with the tiny
model on this machine's CPU; the worker's resident memory after each batch.

    python bench/worker_memory.py                       # batches of 2,000 until level, at most 40
    python bench/worker_memory.py --batches 12 --level-window 0   # exactly 12 batches

A worker serves for days: what it holds must stop growing once it has met the shapes its work
can have. The run stops once the worker is level: it grew by less than `--level-mb` over the
last `--level-window` batches (how many batches that takes depends on the CPU: its kernels and
the row counts there are to meet). The headlines: the batch after which it was level and its
memory there (or that it never levelled in `--batches`), and the growth over the second half of
the run, in MB a batch (the first half fills the KV cache's pages and builds kernels). Starts
its own API and worker on a fresh PostgreSQL database (DATABASE_URL, default the local server)
and a throwaway redis-server. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from machine import cpu_isa, git_state
from report import print_result, table

from conveyor.demo_model import write_tiny_model
from conveyor.engine.config import positive_int
from conveyor.testing import resident_kib, service_deployment, submit_batch, wait_for, write_jsonl
from conveyor.testing.batches import chat_request

WORDS = ["the", "engine", "keeps", "key", "and", "value", "blocks", "of", "a", "batch"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=positive_int, default=40, help="the most batches to run")
    ap.add_argument(
        "--level-window",
        type=int,
        default=4,
        help="stop once the worker grew by less than --level-mb over this many batches (0: never)",
    )
    ap.add_argument("--level-mb", type=float, default=2.0)
    ap.add_argument("--requests", type=positive_int, default=2000, help="requests a batch")
    ap.add_argument("--max-words", type=int, default=120, help="longest user message, in words")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def batch_file(path: Path, args: argparse.Namespace, rng: random.Random, batch: int) -> Path:
    """`args.requests` chat lines, each user message a random number of words: the steps' row
    counts differ from batch to batch as they would in real work."""
    lines = []
    for i in range(args.requests):
        words = " ".join(rng.choices(WORDS, k=rng.randint(1, args.max_words)))
        lines.append(
            chat_request(f"b{batch}-{i}", "tiny", "Answer briefly.", words, args.max_tokens)
        )
    return write_jsonl(path, lines)


def resident_mb(pid: int) -> float:
    return resident_kib(pid) / 1024


def level_since(resident: list[float], window: int, most_mb: float) -> int | None:
    """Read after each batch: the batch (0-based) after which the worker is level, if the last
    `window` batches grew it by less than `most_mb` in all (earlier windows were read before);
    else None."""
    first = len(resident) - 1 - window
    if window < 1 or first < 0 or resident[-1] - resident[first] >= most_mb:
        return None
    return first


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    # a deployment's shard size and visibility timeout, not the tests' small shards
    shards = {"CONVEYOR_SHARD_SIZE": "64", "CONVEYOR_VISIBILITY_TIMEOUT": "600"}
    rows, resident, level = [], [], None
    with service_deployment("memory", **shards) as stack:
        api = stack.start_api()
        worker = stack.start_worker("w1", write_tiny_model(stack.root / "model", "llama"))
        start = resident_mb(worker.pid)
        for batch in range(args.batches):
            path = batch_file(stack.root / f"in-{batch}.jsonl", args, rng, batch)
            started = time.monotonic()
            done = wait_for(api, submit_batch(api, path), timeout=3600)
            if done["request_counts"]["completed"] != args.requests:
                raise RuntimeError(f"batch {batch} ended {done['status']}: {done}")
            resident.append(resident_mb(worker.pid))
            rows.append((batch, f"{time.monotonic() - started:.1f}", f"{resident[-1]:,.0f}"))
            if (level := level_since(resident, args.level_window, args.level_mb)) is not None:
                break
    table(rows, ("batch", "seconds", "worker MB"))
    half = len(resident) // 2
    late = (resident[-1] - resident[half - 1]) / (len(resident) - half) if half else 0.0
    report = {
        "bench": "worker_memory",
        "batches": len(resident),
        "level_after_batch": level,
        "level_mb": None if level is None else round(resident[level], 1),
        "requests_per_batch": args.requests,
        "max_words": args.max_words,
        "worker_mb_at_start": round(start, 1),
        "worker_mb_after_each": [round(mb, 1) for mb in resident],
        "growth_mb_per_batch_second_half": round(late, 2),
        "cpu_isa": cpu_isa(),
        "code": git_state(),
    }
    print(
        f"worker: {start:,.0f} MB ready, {resident[-1]:,.0f} MB after {len(resident)} batches; "
        f"{late:+.1f} MB a batch over the second half"
    )
    if level is not None:
        print(
            f"level after batch {level} at {resident[level]:,.0f} MB: "
            f"{resident[-1] - resident[level]:+.1f} MB over the {args.level_window} batches after"
        )
    elif args.level_window:
        print(f"NOT level: still growing after {len(resident)} batches")
    print_result(report)
    return report


if __name__ == "__main__":
    main()
