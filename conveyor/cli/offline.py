"""The offline engine commands: `conveyor run-batch` runs a batch file through one engine in this
process; `conveyor demo-model` writes a tiny model to try it on."""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from conveyor.cli.common import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, fail
from conveyor.cli.engine_options import add_engine_arguments, engine_config
from conveyor.served_names import served_model_names

if TYPE_CHECKING:  # the CLI's help loads nothing of the engine but its config
    from conveyor.engine.protocol import Engine

RUN_BATCH = "run-batch"

RUN_BATCH_DESCRIPTION = """\
Run an OpenAI Batch input file (JSONL) offline through one engine.

Each input line is {"custom_id", "method": "POST", "url", "body"} with url /v1/chat/completions
or /v1/completions. Output lines are OpenAI Batch result lines
({"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}), written and
flushed as each request finishes, so they come in completion order, not input order: match them
up by custom_id. An interrupted run keeps every line written so far.

Every non-blank input line yields exactly one output line. A line that cannot run (invalid JSON,
wrong method or url, missing or mistyped field, duplicate custom_id, prompt longer than the
model's context, invalid sampling parameters) yields an error line instead:
{"id", "custom_id", "response": {"status_code": 400, ...} or null, "error": {"code", "message",
"line", "param"}}; custom_id and response are null when the line had no readable custom_id.
Error lines go to the output file, next to the results (as vLLM's run_batch does), unless
--error-file is given, in which case they go only there (as OpenAI's batch error file).

The exit code is 0 when the whole file was processed, even if some lines were rejected; it is
non-zero when the input cannot be read, the model cannot be loaded, or the run is interrupted.
"""


def add_run_batch(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run-batch",
        help="run an OpenAI Batch JSONL file offline",
        description=RUN_BATCH_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    io = p.add_argument_group("files")
    io.add_argument("-i", "--input", required=True, metavar="IN.jsonl", help="batch input file")
    io.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="OUT.jsonl",
        help="result file (overwritten); also gets the error lines unless --error-file is given",
    )
    io.add_argument(
        "--error-file",
        metavar="ERR.jsonl",
        help="write error lines here instead of into the output file (overwritten)",
    )
    add_engine_arguments(p)
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="do not show the progress bar",
    )
    p.set_defaults(func=cmd_run_batch)


def cmd_run_batch(args: argparse.Namespace) -> int:
    from conveyor.wire_format.lines import count_request_lines

    input_path = Path(args.input)
    if not input_path.is_file():
        what = "is a directory" if input_path.is_dir() else "does not exist"
        return fail(RUN_BATCH, f"input file {str(input_path)!r} {what}", EXIT_USAGE)
    try:
        total = count_request_lines(input_path)
    except OSError as err:
        return fail(RUN_BATCH, f"cannot read input file {str(input_path)!r}: {err}", EXIT_USAGE)
    if problem := _output_problem(args):
        return fail(RUN_BATCH, problem, EXIT_USAGE)

    try:
        from conveyor.engine import LLM
    except Exception as err:  # a broken install should say so, not dump a traceback
        return fail(RUN_BATCH, f"cannot import the engine: {type(err).__name__}: {err}")

    print(f"loading model {args.model!r} ...", file=sys.stderr)
    try:
        llm = LLM(args.model, engine_config(args))
    except Exception as err:
        return fail(RUN_BATCH, f"cannot load model {args.model!r}: {type(err).__name__}: {err}")
    return _run_batch(args, llm, input_path, total)


def _output_problem(args: argparse.Namespace) -> str | None:
    """Why the output files cannot be written, if they cannot."""
    outputs = [Path(args.output)] + ([Path(args.error_file)] if args.error_file else [])
    for path in outputs:
        if path.is_dir() or not path.resolve().parent.is_dir():
            return f"cannot write {str(path)!r}: no such file location"
    if args.error_file and Path(args.error_file).resolve() == Path(args.output).resolve():
        return "--error-file must differ from --output (or leave it out)"
    return None


def _run_batch(args: argparse.Namespace, llm: Engine, input_path: Path, total: int) -> int:
    """Run the `total` request lines of `input_path` through `llm`, writing as they finish."""
    from tqdm.auto import tqdm

    from conveyor.batch_runner import BatchRunner
    from conveyor.wire_format.lines import iter_request_lines

    served = args.served_model_name
    with contextlib.ExitStack() as files:
        try:
            out = files.enter_context(open(args.output, "w", encoding="utf-8"))
            err_out = (
                files.enter_context(open(args.error_file, "w", encoding="utf-8"))
                if args.error_file
                else None
            )
        except OSError as err:
            return fail(RUN_BATCH, f"cannot open the output for writing: {err}", EXIT_USAGE)
        progress = files.enter_context(
            tqdm(total=total, desc="run-batch", unit="req", disable=args.no_progress)
        )
        runner = BatchRunner(
            llm,
            model_name=served_model_names(args.model, served)[0],
            out=out,
            error_out=err_out,
            served_model_names=served and served_model_names(args.model, served),
            max_pending=4 * llm.engine_config.max_num_seqs,
            progress=progress,
        )
        try:
            stats = runner.run(iter_request_lines(input_path))
        except (KeyboardInterrupt, Exception) as err:
            runner.abort_pending()
            progress.close()
            return _stopped(args, runner.stats.succeeded + runner.stats.failed, total, err)
    where = f"{args.output!r}" + (f" (errors in {args.error_file!r})" if args.error_file else "")
    print(
        f"run-batch: {stats.lines} requests, {stats.succeeded} succeeded, {stats.failed} failed; "
        f"wrote {where}",
        file=sys.stderr,
    )
    return EXIT_OK


def _stopped(args: argparse.Namespace, written: int, total: int, err: BaseException) -> int:
    """Report a run that `err` stopped after `written` of `total` lines."""
    if isinstance(err, KeyboardInterrupt):
        where = f"{args.output!r}" + (f" and {args.error_file!r}" if args.error_file else "")
        return fail(
            RUN_BATCH,
            f"interrupted; {written} of {total} lines were written to {where}",
            EXIT_INTERRUPTED,
        )
    traceback.print_exc()
    return fail(
        RUN_BATCH,
        f"the engine failed: {type(err).__name__}: {err}; {written} of {total} lines were "
        "written before it stopped",
    )


def add_demo_model(subparsers: argparse._SubParsersAction) -> None:
    from conveyor.demo_model import ARCHITECTURES

    p = subparsers.add_parser(
        "demo-model",
        help="write a tiny random-weight model and tokenizer for trying things out",
        description="Write a tiny random-weight model (config, safetensors weights, tokenizer "
        "with a ChatML chat template) to PATH. Its output is gibberish; it exists to exercise "
        "the engine and the batch pipeline without downloading anything.",
    )
    p.add_argument("path", metavar="PATH", help="directory to write (created if missing)")
    p.add_argument(
        "--arch", choices=ARCHITECTURES, default="llama", help="architecture (default llama)"
    )
    p.set_defaults(func=cmd_demo_model)


def cmd_demo_model(args: argparse.Namespace) -> int:
    from conveyor.demo_model import write_tiny_model

    path = Path(args.path)
    if path.exists() and not path.is_dir():
        return fail("demo-model", f"{str(path)!r} exists and is not a directory", EXIT_USAGE)
    try:
        written = write_tiny_model(path, args.arch)
    except OSError as err:
        return fail("demo-model", f"cannot write {str(path)!r}: {err}")
    print(f"wrote a tiny {args.arch} model to {str(written)!r}")
    return EXIT_OK
