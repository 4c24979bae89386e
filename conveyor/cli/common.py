"""What the `conveyor` subcommands share: the program's name, its exit codes, how a command
reports its failure, and the API URL option of the commands that talk to the API."""

from __future__ import annotations

import argparse
import sys

PROG = "conveyor"

EXIT_OK = 0
EXIT_ERROR = 1  # the command failed (e.g. could not talk to the API)
EXIT_USAGE = 2  # the arguments are wrong, as in argparse
# how a batch that `submit --wait` or `submit --resume` waited for ended
EXIT_BATCH_FAILED = 3  # validation failed the batch
EXIT_BATCH_EXPIRED = 4
EXIT_BATCH_CANCELLED = 5
EXIT_TOO_MANY_FAILED = 6  # completed, but more failed requests than --max-failed
EXIT_RUNS_DIFFER = 7  # `conveyor diff`: the two runs answered differently
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports a command SIGINT ended


def fail(command: str, message: str, code: int = EXIT_ERROR) -> int:
    """Say on stderr why `command` failed; return its exit code."""
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)
    return code


def add_url_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", help="API base URL (default $CONVEYOR_URL or http://127.0.0.1:8000)"
    )
