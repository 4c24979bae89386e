"""The `conveyor` command line.

Its subcommands live by audience: `offline` (the engine in this process), `server` (what runs
the service) and `client_commands` (what talks to its API through `conveyor.client`). Each
subcommand has an `add_<name>` function that declares its arguments and a `cmd_<name>` function
that runs it and returns the exit code.
Heavy imports (torch, the engine, the service) happen inside the command functions so that
`conveyor --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from conveyor.cli import client_commands, offline, run_diff, server
from conveyor.cli.common import EXIT_INTERRUPTED, PROG
from conveyor.version import __version__

SUBCOMMANDS = [
    offline.add_run_batch,
    offline.add_demo_model,
    server.add_migrate,
    server.add_serve,
    server.add_worker,
    client_commands.add_submit,
    client_commands.add_status,
    client_commands.add_results,
    client_commands.add_cancel,
    client_commands.add_eval,
    run_diff.add_diff,
    server.add_ready,
    server.add_keys,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Conveyor: batch LLM inference on a paged-KV engine."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
