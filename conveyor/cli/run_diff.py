"""`conveyor diff A B`: what changed between two runs of the same lines (batches, or result
files), for a pipeline to stop on."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from conveyor.cli.client_commands import record_path
from conveyor.cli.common import EXIT_OK, EXIT_RUNS_DIFFER, add_url_argument, fail


def add_diff(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diff",
        help="what changed between two runs: lines by custom_id, and loglikelihood scores",
        description="Compare two runs of the same lines, each a batch id or a results JSONL "
        "file: the lines whose answers differ (text, tool calls, finish reasons, errors), the "
        "lines only one run has, and for lines with logprobs the largest changes in their "
        "summed log-probability; and what ran them where it differs (model fingerprints, "
        "Conveyor's version, engine settings, sampling defaults: a batch's record, or a "
        "results file's FILE.meta.json as `conveyor results -o` writes it). Exit codes: "
        f"{EXIT_OK} the runs agree; {EXIT_RUNS_DIFFER} their answers differ; 1 the runs could "
        "not be read.",
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
    from conveyor.client import CLIENT_ERRORS, ConveyorClient, client_error_text
    from conveyor.wire_format.result_diff import diff_runs

    try:
        with ConveyorClient(args.url) as client:
            first = list(_lines(client, args.first))
            second = list(_lines(client, args.second))
            first_ran, second_ran = (_what_ran(client, run) for run in (args.first, args.second))
    except (*CLIENT_ERRORS, ValueError) as err:
        return fail("diff", client_error_text(err))
    found = diff_runs(first, second, args.tolerance, first_ran, second_ran)
    if args.json:
        print(json.dumps(found.as_dict(args.top), ensure_ascii=False))
    else:
        _print(found, args.top)
        _print_what_ran(found, {"A": (args.first, first_ran), "B": (args.second, second_ran)})
    return EXIT_RUNS_DIFFER if found.differs else EXIT_OK


def _what_ran(client: Any, run: str) -> list[dict[str, Any]]:
    """The records of what ran `run`: a batch's `reproducibility`, or the one in a results
    file's FILE.meta.json; none where there is no such file."""
    path = Path(run)
    if not path.is_file():
        return client.batch(run).get("reproducibility") or []
    meta = record_path(path)
    if not meta.is_file():
        return []
    try:
        return json.loads(meta.read_text(encoding="utf-8")).get("reproducibility") or []
    except (ValueError, AttributeError) as err:
        raise ValueError(f"{meta}: not a record of what ran {path.name} ({err})") from None


def _print_what_ran(found: Any, runs: dict[str, tuple[str, list[dict[str, Any]]]]) -> None:
    if found.what_ran is None:
        unknown = [f"{side} ({_no_record(run)})" for side, (run, ran) in runs.items() if not ran]
        print(f"what ran them: not known for {' and '.join(unknown)}")
    elif not found.what_ran:
        print("what ran them: the same model fingerprint, Conveyor, engine settings and "
              "sampling defaults")  # fmt: skip
    else:
        print("what ran them differs:")
        for change in found.what_ran:
            print(f"  {change.name}: {_values(change.before)} -> {_values(change.after)}")


def _no_record(run: str) -> str:
    path = Path(run)
    if path.is_file():
        return f"no {record_path(path).name} beside it"
    return "the batch recorded no run"


def _values(values: list[Any]) -> str:
    if not values:
        return "(none)"
    return ", ".join(json.dumps(v, ensure_ascii=False) for v in values)


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
