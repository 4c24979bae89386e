"""`conveyor diff A B`: what changed between two runs of the same lines (batches, or result
files), for a pipeline to stop on."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from conveyor.cli.common import EXIT_OK, EXIT_RUNS_DIFFER, add_url_argument, fail


def add_diff(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diff",
        help="what changed between two runs: lines by custom_id, and loglikelihood scores",
        description="Compare two runs of the same lines, each a batch id or a results JSONL "
        "file: the lines whose answers differ (text, tool calls, finish reasons, errors), the "
        "lines only one run has, and for lines with logprobs the largest changes in their "
        f"summed log-probability. Exit codes: {EXIT_OK} the runs agree; {EXIT_RUNS_DIFFER} "
        "they differ; 1 the runs could not be read.",
    )
    p.add_argument("first", metavar="A", help="a batch id or a results file")
    p.add_argument("second", metavar="B", help="a batch id or a results file")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--top", type=int, default=10, help="score changes to show (default 10)")
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.0,
        help="a score that moved by at most this much counts as the same (default 0: exact)",
    )
    add_url_argument(p)
    p.set_defaults(func=cmd_diff)


def cmd_diff(args: argparse.Namespace) -> int:
    from conveyor.client import ConveyorClient, ServiceError
    from conveyor.wire_format.result_diff import diff_runs

    try:
        with ConveyorClient(args.url) as client:
            first = list(_lines(client, args.first))
            second = list(_lines(client, args.second))
    except (ServiceError, OSError, ValueError) as err:
        return fail("diff", str(err))
    found = diff_runs(first, second, args.tolerance)
    if args.json:
        print(json.dumps(found.as_dict(args.top), ensure_ascii=False))
    else:
        _print(found, args.top)
    return EXIT_RUNS_DIFFER if found.differs else EXIT_OK


def _lines(client: Any, run: str) -> Iterator[dict[str, Any]]:
    path = Path(run)
    if path.is_file():
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except ValueError as err:
                        raise ValueError(f"{path}:{number}: not JSON ({err})") from None
    else:
        yield from client.results(run)


def _print(found: Any, top: int) -> None:
    print(
        f"{found.same} lines the same, {len(found.changed)} changed, {len(found.new)} new, "
        f"{len(found.gone)} gone; {len(found.scores)} scores moved"
    )
    for line in found.changed:
        print(f"changed {line.custom_id}:")
        print(f"  - {json.dumps(line.before, ensure_ascii=False)}")
        print(f"  + {json.dumps(line.after, ensure_ascii=False)}")
    for custom_id in found.new:
        print(f"new {custom_id}")
    for custom_id in found.gone:
        print(f"gone {custom_id}")
    if found.scores:
        print("score changes, largest first:")
        for s in found.scores[:top]:
            print(f"  {s.custom_id}: {s.before:.6f} -> {s.after:.6f} ({s.delta:+.6g})")
