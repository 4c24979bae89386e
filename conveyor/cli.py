"""The `conveyor` command line.

Each subcommand has an `_add_<name>` function that declares its arguments and a `_cmd_<name>`
function that runs it and returns the exit code. Heavy imports (torch, the engine) happen inside
the command functions so that `conveyor --help` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from conveyor import __version__
from conveyor.served_names import served_model_names
from conveyor.service_cli import SERVICE_SUBCOMMANDS

PROG = "conveyor"

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


# ------------------------------------------------------------------------------------------------
# run-batch
# ------------------------------------------------------------------------------------------------

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}


def parse_size(text: str) -> int:
    """Bytes from `4GiB`, `512MiB`, `2G`, `1e9` or a plain integer."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not match or match.group(2) not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}; use bytes or a unit such as 512MiB, 4GiB, 2GB"
        )
    value = int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by every command that loads a model."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        required=True,
        help="model directory or Hugging Face model id (config, safetensors weights, tokenizer)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="name(s) the model answers to; the first is reported in each response's `model`. "
        "When given, requests whose body.model is not one of them are rejected "
        "(model_not_found). Default: the model directory's name (or the Hugging Face id); "
        "run-batch then does not check body.model",
    )
    g.add_argument(
        "--max-model-len",
        type=_positive_int,
        help="longest sequence (prompt + output) in tokens (default: the model's "
        "max_position_embeddings, capped by the KV cache size)",
    )
    g.add_argument(
        "--block-size", type=_positive_int, help="tokens per KV cache block (default 16)"
    )
    g.add_argument(
        "--num-kv-blocks",
        type=_positive_int,
        help="number of KV cache blocks (default: as many as --kv-cache-memory holds)",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        metavar="SIZE",
        help="memory for the KV cache, e.g. 4GiB or 512MiB (default: derived from "
        "--gpu-memory-utilization on GPU, a fixed budget on CPU)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        metavar="FRACTION",
        help="fraction of GPU memory the engine may use when --kv-cache-memory is not given "
        "(default 0.9)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=_positive_int,
        help="most sequences in one batch (default 256)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        help="most tokens processed in one engine step (default 4096)",
    )
    g.add_argument(
        "--dtype",
        help="weight and activation dtype: auto, float32, float16, bfloat16 (default auto)",
    )
    g.add_argument("--device", help="cpu, cuda, cuda:N or auto (default auto)")
    g.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not share KV cache blocks between requests with a common prefix",
    )
    g.add_argument("--seed", type=int, help="engine random seed (default 0)")
    g.add_argument(
        "--admission-policy",
        choices=("cache_aware", "fcfs"),
        help="which waiting requests to admit first: cache_aware (longest cached prefix first, "
        "one computation per shared prefix; the default) or fcfs (arrival order)",
    )
    g.add_argument(
        "--max-waiting-time",
        type=float,
        metavar="SECONDS",
        help="a request waiting this long is admitted before all others (default 30)",
    )
    g.add_argument(
        "--attention-backend",
        help="attention implementation: auto or a backend name the engine knows (default auto)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """`LLM(...)` keyword arguments for the options the user gave; the rest keep engine defaults."""
    names = {
        "max_model_len": "max_model_len",
        "block_size": "block_size",
        "num_kv_blocks": "num_kv_blocks",
        "kv_cache_memory": "kv_cache_memory",
        "gpu_memory_utilization": "gpu_memory_utilization",
        "max_num_seqs": "max_num_seqs",
        "max_num_batched_tokens": "max_num_batched_tokens",
        "dtype": "dtype",
        "device": "device",
        "seed": "seed",
        "attention_backend": "attention_backend",
        "admission_policy": "admission_policy",
        "max_waiting_time": "max_waiting_time",
    }
    kwargs: dict[str, object] = {}
    for attr, name in names.items():
        value = getattr(args, attr, None)
        if value is not None:
            kwargs[name] = value
    if getattr(args, "no_prefix_caching", False):
        kwargs["enable_prefix_caching"] = False
    return kwargs


def _add_run_batch(subparsers: argparse._SubParsersAction) -> None:
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
    p.set_defaults(func=_cmd_run_batch)


def _fail(command: str, message: str, code: int = 1) -> int:
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)
    return code


def _cmd_run_batch(args: argparse.Namespace) -> int:
    from conveyor.batch_runner import BatchRunner, count_request_lines, iter_request_lines

    command = "run-batch"
    input_path = Path(args.input)
    if not input_path.is_file():
        what = "is a directory" if input_path.is_dir() else "does not exist"
        return _fail(command, f"input file {str(input_path)!r} {what}", 2)
    try:
        total = count_request_lines(input_path)
    except OSError as err:
        return _fail(command, f"cannot read input file {str(input_path)!r}: {err}", 2)
    outputs = [Path(args.output)] + ([Path(args.error_file)] if args.error_file else [])
    for path in outputs:
        if path.is_dir() or not path.resolve().parent.is_dir():
            return _fail(command, f"cannot write {str(path)!r}: no such file location", 2)
    if args.error_file and Path(args.error_file).resolve() == Path(args.output).resolve():
        return _fail(command, "--error-file must differ from --output (or leave it out)", 2)

    try:
        from engine import LLM
    except Exception as err:  # a broken install should say so, not dump a traceback
        return _fail(command, f"cannot import the engine: {type(err).__name__}: {err}")

    print(f"loading model {args.model!r} ...", file=sys.stderr)
    try:
        llm = LLM(args.model, **engine_kwargs(args))
    except Exception as err:
        return _fail(command, f"cannot load model {args.model!r}: {type(err).__name__}: {err}")

    from tqdm.auto import tqdm

    served = args.served_model_name
    model_name = served_model_names(args.model, served)[0]
    max_pending = 4 * (args.max_num_seqs or 256)

    with contextlib.ExitStack() as files:
        try:
            out = files.enter_context(open(args.output, "w", encoding="utf-8"))
            err_out = (
                files.enter_context(open(args.error_file, "w", encoding="utf-8"))
                if args.error_file
                else None
            )
        except OSError as err:
            return _fail(command, f"cannot open the output for writing: {err}", 2)
        progress = files.enter_context(
            tqdm(total=total, desc="run-batch", unit="req", disable=args.no_progress)
        )
        runner = BatchRunner(
            llm,
            model_name=model_name,
            out=out,
            error_out=err_out,
            served_model_names=served,
            max_pending=max_pending,
            progress=progress,
        )
        try:
            stats = runner.run(iter_request_lines(input_path))
        except KeyboardInterrupt:
            runner.abort_pending()
            progress.close()
            s = runner.stats
            return _fail(
                command,
                f"interrupted; {s.succeeded + s.failed} of {total} lines were written to "
                f"{args.output!r}" + (f" and {args.error_file!r}" if args.error_file else ""),
                130,
            )
        except Exception as err:
            runner.abort_pending()
            progress.close()
            traceback.print_exc()
            s = runner.stats
            return _fail(
                command,
                f"the engine failed: {type(err).__name__}: {err}; {s.succeeded + s.failed} of "
                f"{total} lines were written before it stopped",
            )
    where = f"{args.output!r}" + (f" (errors in {args.error_file!r})" if args.error_file else "")
    print(
        f"run-batch: {stats.lines} requests, {stats.succeeded} succeeded, {stats.failed} failed; "
        f"wrote {where}",
        file=sys.stderr,
    )
    return 0


# ------------------------------------------------------------------------------------------------
# demo-model
# ------------------------------------------------------------------------------------------------


def _add_demo_model(subparsers: argparse._SubParsersAction) -> None:
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
    p.set_defaults(func=_cmd_demo_model)


def _cmd_demo_model(args: argparse.Namespace) -> int:
    from conveyor.demo_model import write_tiny_model

    path = Path(args.path)
    if path.exists() and not path.is_dir():
        return _fail("demo-model", f"{str(path)!r} exists and is not a directory", 2)
    try:
        written = write_tiny_model(path, args.arch)
    except OSError as err:
        return _fail("demo-model", f"cannot write {str(path)!r}: {err}")
    print(f"wrote a tiny {args.arch} model to {str(written)!r}")
    return 0


# ------------------------------------------------------------------------------------------------
# entry point
# ------------------------------------------------------------------------------------------------

SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_run_batch,
    _add_demo_model,
    *SERVICE_SUBCOMMANDS,
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
        return 130


if __name__ == "__main__":
    sys.exit(main())
