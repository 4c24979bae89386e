"""The client commands: `conveyor submit | status | results | cancel` talk to the API over HTTP."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conveyor.cli.common import (
    EXIT_BATCH_CANCELLED,
    EXIT_BATCH_EXPIRED,
    EXIT_BATCH_FAILED,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TOO_MANY_FAILED,
    EXIT_USAGE,
    PROG,
    add_url_argument,
    fail,
)
from conveyor.ledger.states import BatchStatus
from conveyor.wire_format.result_lines import dump_line


def add_submit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "submit",
        help="upload a JSONL file and create a batch (optionally wait and download results)",
        description="Upload a batch input file, create the batch, and with --wait show its "
        f"progress and download the results. Exit codes: {EXIT_OK} completed; {EXIT_ERROR} "
        f"error talking to the API; {EXIT_BATCH_FAILED} the batch failed validation; "
        f"{EXIT_BATCH_EXPIRED} expired; {EXIT_BATCH_CANCELLED} cancelled; "
        f"{EXIT_TOO_MANY_FAILED} completed with more failed requests than --max-failed.",
    )
    p.add_argument("input", type=Path, metavar="IN.jsonl", nargs="?")
    p.add_argument("--model", help="set body.model on every line that has none")
    p.add_argument("--endpoint", help="default: the first line's url")
    p.add_argument("--completion-window", default="24h")
    p.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--wait", action="store_true", help="wait for the batch to finish")
    p.add_argument(
        "--resume",
        metavar="BATCH_ID",
        help="reattach to this batch (printed by an earlier submit) instead of submitting: "
        "wait for it and download its results as --wait does; IN.jsonl is not needed",
    )
    p.add_argument(
        "--idempotency-key",
        metavar="KEY",
        help="if a batch was already created with this key, reuse it instead of submitting "
        "again (e.g. nightly-$(date +%%F) makes a re-run of a nightly step attach to that "
        "night's batch, whatever became of it)",
    )
    p.add_argument(
        "--reuse",
        action="store_true",
        help="answer each deterministic line (greedy, or with a seed) from an earlier "
        "completed line of this project with the same model fingerprint and the same request, "
        'computing only the rest (the API\'s reuse: "exact")',
    )
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        help="with --wait: write the results here, and what produced them (the batch's "
        "reproducibility record) beside them in OUTPUT.meta.json",
    )
    p.add_argument("--errors", type=Path, help="with --wait: write the error lines here")
    p.add_argument(
        "--max-failed",
        type=int,
        default=0,
        help="with --wait: failed requests tolerated before exiting non-zero",
    )
    p.add_argument("--poll", type=float, default=1.0, help="seconds between status polls")
    p.add_argument(
        "--wait-api",
        type=float,
        default=0,
        metavar="SECONDS",
        help="wait up to this long for the API to be ready before uploading",
    )
    add_url_argument(p)
    p.set_defaults(func=cmd_submit)


def _prepared_input(path: Path, model: str | None) -> tuple[Path, str | None, bool]:
    """(file to upload, first line's url, whether it is a temp copy)."""
    url = None
    if model is None:
        with open(path, "rb") as f:
            for raw in f:
                if raw.strip():
                    with contextlib.suppress(ValueError, AttributeError):
                        url = json.loads(raw).get("url")
                    break
        return path, url, False
    with (
        open(path, "rb") as f,
        tempfile.NamedTemporaryFile("wb", suffix=".jsonl", delete=False) as tmp,
    ):
        for raw in f:
            try:
                obj = json.loads(raw)
            except ValueError:
                tmp.write(raw)  # the API reports it with its line number
                continue
            if isinstance(obj, dict):
                url = url or obj.get("url")
                body = obj.get("body")
                if isinstance(body, dict) and "model" not in body:
                    body["model"] = model
                tmp.write(json.dumps(obj, ensure_ascii=False).encode() + b"\n")
            else:
                tmp.write(raw)
    return Path(tmp.name), url, True


def cmd_submit(args: argparse.Namespace) -> int:
    if args.resume:
        if args.idempotency_key:
            return fail("submit", "give --resume or --idempotency-key, not both", EXIT_USAGE)
        return _follow(args, lambda client: client.batch(args.resume), wait=True)
    if args.input is None:
        return fail("submit", "give the input file IN.jsonl (or --resume BATCH_ID)", EXIT_USAGE)
    if not args.input.is_file():
        return fail("submit", f"input file {str(args.input)!r} does not exist", EXIT_USAGE)
    metadata = {}
    for item in args.metadata:
        key, sep, value = item.partition("=")
        if not sep:
            return fail("submit", f"--metadata wants KEY=VALUE, got {item!r}", EXIT_USAGE)
        metadata[key] = value
    path, url, temporary = _prepared_input(args.input, args.model)
    endpoint = args.endpoint or url or "/v1/chat/completions"
    try:
        return _follow(
            args, lambda client: _new_batch(client, args, path, endpoint, metadata), args.wait
        )
    finally:
        if temporary:
            path.unlink(missing_ok=True)


def _follow(args: argparse.Namespace, get_batch: Callable[[Any], dict], wait: bool) -> int:
    """Print the id of the batch `get_batch` gives; with `wait`, wait for it and download its
    results, else report whether it was accepted."""
    from conveyor.client import CLIENT_ERRORS, ConveyorClient, client_error_text

    try:
        with ConveyorClient(args.url) as client:
            if args.wait_api:
                client.wait_ready(args.wait_api)
            batch = get_batch(client)
            print(batch["id"], flush=True)
            if not wait:
                return EXIT_OK if batch["status"] != BatchStatus.FAILED else _report_failed(batch)
            try:
                return wait_and_download(client, batch["id"], args)
            except KeyboardInterrupt:
                print(
                    f"{PROG} submit: interrupted; batch {batch['id']} goes on: `{PROG} submit "
                    f"--resume {batch['id']}` waits for it again",
                    file=sys.stderr,
                )
                return EXIT_INTERRUPTED
    except CLIENT_ERRORS as err:
        return fail("submit", client_error_text(err))


def _new_batch(
    client: Any, args: argparse.Namespace, path: Path, endpoint: str, metadata: dict[str, str]
) -> dict:
    """The batch made earlier with --idempotency-key, else a new one of the uploaded `path`."""
    batch, reused = client.find_or_create_batch(
        path, endpoint, args.completion_window, metadata or None, args.idempotency_key,
        "exact" if args.reuse else None,
    )  # fmt: skip
    if reused:
        print(
            f"reusing batch {batch['id']} ({batch['status']}), created with "
            f"idempotency key {args.idempotency_key!r}",
            file=sys.stderr,
        )
    return batch


def _report_failed(batch: dict) -> int:
    errors = (batch.get("errors") or {}).get("data") or []
    for e in errors[:50]:
        where = f"line {e['line']}: " if e.get("line") else ""
        print(f"  {where}{e.get('code')}: {e.get('message')}", file=sys.stderr)
    if len(errors) > 50:
        print(f"  ... and {len(errors) - 50} more", file=sys.stderr)
    print(f"batch {batch['id']} failed validation", file=sys.stderr)
    return EXIT_BATCH_FAILED


def wait_and_download(client, batch_id: str, args: argparse.Namespace) -> int:
    (batch,) = client.wait([batch_id], args.poll, desc=batch_id)
    if batch["status"] == BatchStatus.FAILED:
        return _report_failed(batch)
    if args.output and batch.get("output_file_id"):
        client.download(batch["output_file_id"], args.output)
    elif args.output:
        args.output.write_bytes(b"")
    if args.errors and batch.get("error_file_id"):
        client.download(batch["error_file_id"], args.errors)
    elif args.errors:
        args.errors.write_bytes(b"")
    if args.output or args.errors:
        write_record(batch, args.output or args.errors)
    counts = batch["request_counts"]
    reused = f" ({counts['reused']} reused)" if counts.get("reused") else ""
    print(
        f"batch {batch_id} {batch['status']}: {counts['completed']} completed{reused}, "
        f"{counts['failed']} failed of {counts['total']}",
        file=sys.stderr,
    )
    if batch["status"] == BatchStatus.EXPIRED:
        return EXIT_BATCH_EXPIRED
    if batch["status"] == BatchStatus.CANCELLED:
        return EXIT_BATCH_CANCELLED
    if counts["failed"] > args.max_failed:
        return EXIT_TOO_MANY_FAILED
    return EXIT_OK


def record_path(results: Path) -> Path:
    """Where what produced the lines of `results` is written: `results` + `.meta.json`."""
    return results.with_name(results.name + ".meta.json")


def write_record(batch: dict, results: Path) -> Path:
    """Write what produced the lines of `results` beside it (`record_path`): the batch's id,
    status and model and its `reproducibility` (each worker and model fingerprint that ran it,
    with the engine's settings and the sampling defaults in force), and say so on stderr. The
    lines themselves stay as the API gave them."""
    path = record_path(results)
    runs = batch.get("reproducibility") or []
    record = {"batch_id": batch["id"], "status": batch["status"], "model": batch.get("model"),
              "reproducibility": runs}  # fmt: skip
    path.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    fingerprints = ", ".join(dict.fromkeys(run["fingerprint"] for run in runs)) or "none recorded"
    print(f"what produced {results}: {path} (model fingerprints: {fingerprints})",
          file=sys.stderr)  # fmt: skip
    return path


def add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="print a batch object")
    p.add_argument("batch_id")
    add_url_argument(p)
    p.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    from conveyor.client import CLIENT_ERRORS, ConveyorClient, client_error_text

    try:
        with ConveyorClient(args.url) as client:
            print(json.dumps(client.batch(args.batch_id), indent=2))
    except CLIENT_ERRORS as err:
        return fail("status", client_error_text(err))
    return EXIT_OK


def add_results(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "results", help="print (or with -o write) the result lines finished so far (JSONL)"
    )
    p.add_argument("batch_id")
    p.add_argument("--after", help="only lines after this line id")
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="FILE",
        help="write the lines to FILE instead of printing them, and what produced them (the "
        "batch's reproducibility record: model fingerprints, engine settings, sampling "
        "defaults) beside it, in FILE.meta.json",
    )
    add_url_argument(p)
    p.set_defaults(func=cmd_results)


def cmd_results(args: argparse.Namespace) -> int:
    from conveyor.client import CLIENT_ERRORS, ConveyorClient, client_error_text

    try:
        with ConveyorClient(args.url) as client:
            lines = client.results(args.batch_id, args.after)
            if args.output is None:
                for line in lines:
                    print(dump_line(line))
                return EXIT_OK
            with open(args.output, "w", encoding="utf-8") as out:
                for line in lines:
                    out.write(dump_line(line) + "\n")
            # read after the lines: a worker's run is recorded before it writes any of them
            write_record(client.batch(args.batch_id), args.output)
    except CLIENT_ERRORS as err:
        return fail("results", client_error_text(err))
    return EXIT_OK


def add_cancel(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cancel", help="cancel a batch")
    p.add_argument("batch_id")
    add_url_argument(p)
    p.set_defaults(func=cmd_cancel)


def cmd_cancel(args: argparse.Namespace) -> int:
    from conveyor.client import CLIENT_ERRORS, ConveyorClient, client_error_text

    try:
        with ConveyorClient(args.url) as client:
            batch = client.cancel(args.batch_id)
    except CLIENT_ERRORS as err:
        return fail("cancel", client_error_text(err))
    print(f"batch {batch['id']} is {batch['status']}")
    return EXIT_OK


EVAL_HELP = """\
conveyor eval: lm-eval's command line (lm-eval run; also `conveyor eval ls tasks` and `conveyor
eval validate`), with --model conveyor unless --model (or a --config that names one) says
otherwise. The conveyor model runs each request type as durable batches on a Conveyor service
with a progress bar; running the same command again attaches to the batches it made instead of
computing them again. Its --model_args: base_url (default $CONVEYOR_URL or {url}), model
(default: the one model the service serves), tokenizer (a path or Hugging Face name; needed for
loglikelihood tasks while the service offers no tokenizer), poll, completion_window,
max_batch_lines, max_batch_bytes, and local-completions' own (max_length, max_gen_toks, seed,
...). $CONVEYOR_API_KEY is sent as Bearer. Needs lm-eval: pip install 'conveyor[eval]'.
lm-eval's help follows.
"""
LM_EVAL_SUBCOMMANDS = ("run", "ls", "validate")


def add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a served model with lm-eval's command line (--model conveyor)",
        add_help=False,
        # every argument, options included, belongs to lm-eval: none is an option here
        prefix_chars="\0",
    )
    p.add_argument("lm_eval_args", nargs="*")
    p.set_defaults(func=cmd_eval)


def _option_value(args: list[str], i: int, long: str, short: str) -> str | None:
    """The value of `args[i]` if it is the option `long`/`short` (`--opt V`, `--opt=V`, `-o V`,
    `-oV`), else None; "" when the value is missing."""
    arg = args[i]
    if arg in (long, short):
        return args[i + 1] if i + 1 < len(args) else ""
    if arg.startswith(long + "="):
        return arg[len(long) + 1 :]
    if arg.startswith(short) and not arg.startswith("--"):
        return arg[len(short) :]
    return None


def _names_a_model(args: list[str]) -> bool:
    """Whether lm-eval's arguments choose a model type, directly or in a --config file."""
    for i in range(len(args)):
        if _option_value(args, i, "--model", "-M") is not None:
            return True
        config = _option_value(args, i, "--config", "-C")
        if config and _config_names_model(Path(config)):
            return True
    return False


def _config_names_model(path: Path) -> bool:
    import yaml

    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return False  # lm-eval says what is wrong with it
    return isinstance(config, dict) and bool(config.get("model"))


def lm_eval_argv(args: list[str]) -> list[str]:
    """lm-eval's argv for `conveyor eval ARGS`: its `run` unless ARGS name another of its
    subcommands, with `--model conveyor` when they choose no model type."""
    if args and args[0] in LM_EVAL_SUBCOMMANDS[1:]:
        return ["lm-eval", *args]
    if args and args[0] == "run":
        args = args[1:]
    extra = [] if _names_a_model(args) else ["--model", "conveyor"]
    return ["lm-eval", "run", *extra, *args]


def cmd_eval(args: argparse.Namespace) -> int:
    import httpx

    from conveyor.client import DEFAULT_URL, ServiceError, client_error_text

    argv = lm_eval_argv(list(args.lm_eval_args))
    if "-h" in argv or "--help" in argv or argv == ["lm-eval", "run", "--model", "conveyor"]:
        print(EVAL_HELP.format(url=DEFAULT_URL))
        if len(argv) == 4:  # nothing asked: show how to ask
            argv.append("--help")
    try:
        from lm_eval.__main__ import cli_evaluate

        from conveyor.lm_eval_model import EvaluationError
    except ImportError as err:
        return fail("eval", f"lm-eval is not installed ({err}); pip install 'conveyor[eval]'")
    saved = sys.argv
    sys.argv = argv
    try:
        cli_evaluate()
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else EXIT_ERROR if done.code else EXIT_OK
    except EvaluationError as err:
        return fail("eval", str(err))
    except (ServiceError, httpx.HTTPError) as err:
        return fail("eval", client_error_text(err))
    except KeyboardInterrupt:
        print(
            f"{PROG} eval: interrupted; the batches it made go on: run the same command again "
            "to attach to them",
            file=sys.stderr,
            flush=True,
        )
        # nothing is left to save, and the interpreter's teardown of lm-eval, datasets and
        # torch takes a second or two of a Ctrl-C
        logging.shutdown()
        os._exit(EXIT_INTERRUPTED)
    finally:
        sys.argv = saved
    return EXIT_OK
