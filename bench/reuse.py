"""A nightly rerun with exact reuse: the same suite submitted again with `--reuse` should cost
a sliver of the first run, an edited suite only its edited lines, and other weights under the
same model name nothing reused at all.

Runs the production layout (the API and one worker on a fresh PostgreSQL database and a
throwaway redis-server, as bench/online_churn.py does) with a random ~56M-parameter Llama served
as `suite`, and submits `--lines` greedy chat lines (`--max-tokens` each) four times through the
API, as `conveyor submit --reuse` does:
  1. the first run (nothing to reuse yet);
  2. the same lines again: every line reused; goal: <= 5% of the first run's time;
  3. the suite with `--changed` of its lines edited: only those computed;
  4. the same lines with the worker replaced by one on other weights under the same name:
     none reused (the model fingerprint differs).

    python bench/reuse.py              # 2,000 lines of 64 tokens (a few minutes)
    python bench/reuse.py --quick      # 200 lines

With `--lookups`, instead, no service: the ledger's lookups of 100,000 keys, all found and
none found, on SQLite and PostgreSQL, against the goal of seconds, not minutes (each under
10 s; bench/reuse_lookup.py says how):

    python bench/reuse.py --lookups                     # 100,000 lines, both ledgers (~1 min)
    python bench/reuse.py --lookups --quick             # 10,000 lines
    python bench/reuse.py --lookups --backend sqlite --analyze

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import signal
import time
from datetime import date
from pathlib import Path

import httpx
from machine import cpu_isa, git_state, loadavg
from report import print_result
from reuse_lookup import run_lookups

from conveyor.demo_model import write_tiny_model
from conveyor.testing import (
    batch_lines,
    service_deployment,
    upload_file,
    wait_for,
    write_jsonl,
)

GOAL_RERUN_SHARE = 0.05
# the benchmarks' Llama (bench/random_llama.py's default shape), with the demo tokenizer
SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, help="default 2,000 (--lookups: 100,000)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--changed", type=float, default=0.05, help="share of lines edited")
    ap.add_argument("--quick", action="store_true", help="200 lines (--lookups: 10,000)")
    ap.add_argument("--lookups", action="store_true", help="time the ledger's lookups instead")
    ap.add_argument("--backend", choices=("sqlite", "postgresql", "both"), default="both",
                    help="--lookups: the ledgers timed")  # fmt: skip
    ap.add_argument(
        "--analyze",
        action="store_true",
        help="--lookups: ANALYZE the ledger once it is filled (by default it is timed as filled, "
        "before autovacuum has gathered statistics: the planner's worst case)",
    )
    args = ap.parse_args(argv)
    if args.lines is None:
        args.lines = (10_000 if args.quick else 100_000) if args.lookups else 2000
    if args.quick and not args.lookups:
        args.lines = 200
    return args


def run(api: str, path: Path) -> tuple[float, dict]:
    """One batch of `path` with reuse on, submitted and waited for: its wall time and object."""
    started = time.perf_counter()
    body = {"input_file_id": upload_file(api, path), "endpoint": "/v1/chat/completions",
            "reuse": "exact"}  # fmt: skip
    created = httpx.post(f"{api}/v1/batches", json=body, timeout=120)
    created.raise_for_status()
    done = wait_for(api, created.json()["id"], timeout=3600)
    return time.perf_counter() - started, done


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.lookups:
        report = run_lookups(args)
        print_result(report)
        return report
    with service_deployment("reuse") as stack:
        root = stack.root
        first_weights = write_tiny_model(root / "weights-a", "llama", seed=0, **SHAPE)
        other_weights = write_tiny_model(root / "weights-b", "llama", seed=1, **SHAPE)
        lines = batch_lines(args.lines, model="suite", prefix="task", max_tokens=args.max_tokens)
        suite = write_jsonl(root / "suite.jsonl", lines)
        edited_count = max(1, round(args.lines * args.changed))
        edited = [
            {**line, "body": {**line["body"], "max_tokens": args.max_tokens - 1}}
            if i < edited_count else line
            for i, line in enumerate(lines)
        ]  # fmt: skip
        edited_path = write_jsonl(root / "edited.jsonl", edited)
        api = stack.start_api()
        stack.start_worker("w1", first_weights, served="suite")
        first_s, first = run(api, suite)
        rerun_s, rerun = run(api, suite)
        edited_s, edited_run = run(api, edited_path)
        stack.kill("w1", signal.SIGTERM)  # it withdraws; the same name on other weights
        stack.start_worker("w2", other_weights, served="suite")
        other_s, other = run(api, suite)
    for batch in (first, rerun, edited_run, other):
        assert batch["request_counts"]["completed"] == args.lines, batch
    share = rerun_s / first_s
    report = {
        "bench": "reuse",
        "lines": args.lines,
        "max_tokens": args.max_tokens,
        "first_s": round(first_s, 2),
        "rerun_s": round(rerun_s, 2),
        "rerun_reused": rerun["request_counts"]["reused"],
        "rerun_share_of_first": round(share, 4),
        "goal_met": share <= GOAL_RERUN_SHARE and rerun["request_counts"]["reused"] == args.lines,
        "edited_lines": edited_count,
        "edited_s": round(edited_s, 2),
        "edited_reused": edited_run["request_counts"]["reused"],
        "other_weights_s": round(other_s, 2),
        "other_weights_reused": other["request_counts"]["reused"],
        "loadavg": loadavg(),
        "cpu_isa": cpu_isa(),
        "date": date.today().isoformat(),
        "code": git_state(),
    }
    print(
        f"{args.lines} lines: first run {first_s:.1f} s; rerun with reuse {rerun_s:.2f} s "
        f"({share:.1%} of it, goal <= {GOAL_RERUN_SHARE:.0%}; {report['rerun_reused']} reused); "
        f"{edited_count} lines edited: {edited_s:.1f} s, {report['edited_reused']} reused; "
        f"other weights under the same name: {report['other_weights_reused']} reused"
    )
    print_result(report)
    return report


if __name__ == "__main__":
    main()
