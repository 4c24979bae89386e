"""`conveyor migrate | serve | worker | submit | status | results | cancel`."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

from conveyor.env_args import apply_env_defaults
from conveyor.served_names import served_model_names

PROG = "conveyor"

# exit codes of `submit --wait` and `submit --resume` (2 is a usage error, as in argparse)
EXIT_OK = 0
EXIT_ERROR = 1  # could not talk to the API
EXIT_BATCH_FAILED = 3  # validation failed the batch
EXIT_BATCH_EXPIRED = 4
EXIT_BATCH_CANCELLED = 5
EXIT_TOO_MANY_FAILED = 6  # completed, but more failed requests than --max-failed


def _fail(command: str, message: str, code: int = EXIT_ERROR) -> int:
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)
    return code


def _settings():
    from conveyor.settings import Settings

    return Settings.from_env()


# ---- migrate ---------------------------------------------------------------------------------


def add_migrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("migrate", help="create or upgrade the ledger's tables (Alembic)")
    p.add_argument("--database-url", help="default: $DATABASE_URL, else the embedded SQLite file")
    p.set_defaults(func=cmd_migrate)


def cmd_migrate(args: argparse.Namespace) -> int:
    from conveyor.settings import normalize_database_url
    from ledger.migrate import current_revision, upgrade

    settings = _settings()
    url = normalize_database_url(args.database_url) if args.database_url else settings.db_url
    try:
        upgrade(url)
    except Exception as err:
        return _fail("migrate", f"{type(err).__name__}: {err}")
    print(f"ledger at revision {current_revision(url)}")
    return 0


# ---- worker ----------------------------------------------------------------------------------


def add_worker(sub: argparse._SubParsersAction) -> None:
    from conveyor.cli import add_engine_arguments

    p = sub.add_parser("worker", help="run a worker: one engine fed by shard tasks")
    add_engine_arguments(p)
    p.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="shard tasks in flight at once, all feeding the one engine (default 8)",
    )
    p.add_argument("--name", help="worker name (default: host-pid)")
    p.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics at http://0.0.0.0:PORT/metrics (default: not served)",
    )
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(func=cmd_worker)
    p.epilog = (
        "Every option can also come from the environment: --max-num-seqs from "
        "CONVEYOR_MAX_NUM_SEQS, --model from CONVEYOR_MODEL, and so on (the command line wins)."
    )
    if errors := apply_env_defaults(p):
        p.set_defaults(func=lambda _: _fail("worker", "; ".join(errors), 2))


def cmd_worker(args: argparse.Namespace) -> int:
    from conveyor.cli import engine_kwargs

    settings = _settings()
    _log_setup(args.loglevel)
    if settings.database_url is None:
        from ledger.migrate import upgrade

        upgrade(settings.db_url)
    from worker.main import consume, start_runtime
    from worker.runtime import ENGINE_FAILED_EXIT

    try:
        runtime = start_runtime(
            settings, args.model, args.served_model_name, engine_kwargs(args), name=args.name
        )
    except Exception as err:
        return _fail("worker", f"cannot start: {type(err).__name__}: {err}")
    if args.metrics_port:
        runtime.metrics.serve(args.metrics_port)
    try:
        consume(runtime, args.concurrency, args.loglevel)
    finally:
        runtime.stop()
    return ENGINE_FAILED_EXIT if runtime.engine_failed.is_set() else 0


# ---- serve -----------------------------------------------------------------------------------


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run the API (and, with no DATABASE_URL/REDIS_URL, an in-process worker)",
        description="Run the REST API. With DATABASE_URL and REDIS_URL set it runs only the API. "
        "With neither set it runs the API plus one in-process worker on an embedded SQLite "
        "ledger and broker under CONVEYOR_DATA_DIR, serving --model (default: a tiny demo "
        "model written on first use).",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", help="model of the in-process worker (embedded mode only)")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument(
        "--no-worker", action="store_true", help="embedded mode without the in-process worker"
    )
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from api.app import create_app
    from ledger.migrate import upgrade

    settings = _settings()
    _log_setup("INFO")
    if settings.auth == "off":
        print(
            "authentication is off (CONVEYOR_AUTH=off): every client sees every file and "
            "batch; set CONVEYOR_AUTH=required and create keys with `conveyor keys create` "
            "before exposing the API beyond this machine",
            file=sys.stderr,
        )
    embedded = settings.embedded
    if settings.database_url is None:
        upgrade(settings.db_url)  # the embedded ledger migrates itself
    app = create_app(settings)
    # SIGTERM: stop accepting, let requests in flight finish (up to 30 s), then exit
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        log_config=None,  # uvicorn's lines go through our handler (text or JSON)
        timeout_graceful_shutdown=30,
    )
    server = uvicorn.Server(config)
    if not embedded or args.no_worker:
        server.run()
        return 0

    from worker.main import consume, start_runtime
    from worker.runtime import ENGINE_FAILED_EXIT

    model = args.model
    if model is None:
        from conveyor.demo_model import write_tiny_model

        demo = settings.data_dir / "demo-model"
        if not (demo / "config.json").exists():
            write_tiny_model(demo, "llama")
        model = str(demo)
        names = served_model_names(model, args.served_model_name or ["demo"])
    else:
        names = served_model_names(model, args.served_model_name)
    print(
        f"embedded mode: ledger and broker under {settings.data_dir.resolve()}; "
        f"serving model {names[0]!r}",
        file=sys.stderr,
    )
    runtime = start_runtime(settings, model, names, {})
    thread = threading.Thread(target=server.run, name="conveyor-api", daemon=True)
    thread.start()
    try:
        consume(runtime, args.concurrency)  # the Celery worker wants the main thread
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        runtime.stop()
    return ENGINE_FAILED_EXIT if runtime.engine_failed.is_set() else 0


def _log_setup(level: str) -> None:
    from conveyor.logs import setup_logging

    setup_logging(level, _settings().log_format)


# ---- submit / status / results / cancel -------------------------------------------------------


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
    p.add_argument("-o", "--output", type=Path, help="with --wait: write the results here")
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
    _add_url(p)
    p.set_defaults(func=cmd_submit)


def _add_url(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="API base URL (default $CONVEYOR_URL or http://127.0.0.1:8000)")


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
    from conveyor.client import APIError, ConveyorClient

    if args.resume:
        if args.idempotency_key:
            return _fail("submit", "give --resume or --idempotency-key, not both", 2)
        try:
            with ConveyorClient(args.url) as client:
                if args.wait_api:
                    client.wait_ready(args.wait_api)
                batch = client.batch(args.resume)
                print(batch["id"], flush=True)
                return wait_and_download(client, batch["id"], args)
        except (APIError, OSError) as err:
            return _fail("submit", str(err))
        except Exception as err:  # httpx transport errors
            return _fail("submit", f"{type(err).__name__}: {err}")
    if args.input is None:
        return _fail("submit", "give the input file IN.jsonl (or --resume BATCH_ID)", 2)
    if not args.input.is_file():
        return _fail("submit", f"input file {str(args.input)!r} does not exist", 2)
    metadata = {}
    for item in args.metadata:
        key, sep, value = item.partition("=")
        if not sep:
            return _fail("submit", f"--metadata wants KEY=VALUE, got {item!r}", 2)
        metadata[key] = value
    path, url, temporary = _prepared_input(args.input, args.model)
    endpoint = args.endpoint or url or "/v1/chat/completions"
    try:
        with ConveyorClient(args.url) as client:
            if args.wait_api:
                client.wait_ready(args.wait_api)
            batch = None
            if args.idempotency_key:
                batch = client.batch_for_key(args.idempotency_key)
                if batch is not None:
                    print(
                        f"reusing batch {batch['id']} ({batch['status']}), created with "
                        f"idempotency key {args.idempotency_key!r}",
                        file=sys.stderr,
                    )
            if batch is None:
                file = client.upload(path)
                try:
                    batch = client.create_batch(
                        file["id"],
                        endpoint,
                        args.completion_window,
                        metadata or None,
                        args.idempotency_key,
                    )
                except APIError as err:
                    # a concurrent submit with the key won, with its own upload of the file
                    if err.code != "idempotency_key_reused":
                        raise
                    batch = client.batch_for_key(args.idempotency_key)
                    if batch is None:
                        raise
                if batch["input_file_id"] != file["id"]:
                    client.delete_file(file["id"])
            print(batch["id"], flush=True)
            if not args.wait:
                return EXIT_OK if batch["status"] != "failed" else _report_failed(batch)
            return wait_and_download(client, batch["id"], args)
    except (APIError, OSError) as err:
        return _fail("submit", str(err))
    except Exception as err:  # httpx transport errors
        return _fail("submit", f"{type(err).__name__}: {err}")
    finally:
        if temporary:
            path.unlink(missing_ok=True)


def _report_failed(batch: dict) -> int:
    errors = (batch.get("errors") or {}).get("data") or []
    for e in errors[:50]:
        where = f"line {e['line']}: " if e.get("line") else ""
        print(f"  {where}{e.get('code')}: {e.get('message')}", file=sys.stderr)
    if len(errors) > 50:
        print(f"  ... and {len(errors) - 50} more", file=sys.stderr)
    print(f"batch {batch['id']} failed validation", file=sys.stderr)
    return EXIT_BATCH_FAILED


API_OUTAGE_TOLERANCE = 300.0  # seconds a waiting submit rides out an unreachable API


def _poll(client, batch_id: str, bar) -> dict:
    """The batch, retrying while the API is unreachable or restarting (up to 5 minutes)."""
    import httpx

    from conveyor.client import APIError

    deadline = time.monotonic() + API_OUTAGE_TOLERANCE
    while True:
        try:
            return client.batch(batch_id)
        except (httpx.TransportError, APIError) as err:
            if isinstance(err, APIError) and err.status < 500:
                raise
            if time.monotonic() > deadline:
                raise
            bar.write(f"the API is unavailable ({err}); retrying")
            time.sleep(2.0)


def wait_and_download(client, batch_id: str, args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    batch = client.batch(batch_id)
    with tqdm(total=batch["request_counts"]["total"], desc=batch_id, unit="req") as bar:
        while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(args.poll)
            batch = _poll(client, batch_id, bar)
            counts = batch["request_counts"]
            bar.total = counts["total"]
            bar.n = counts["completed"] + counts["failed"]
            bar.set_postfix(status=batch["status"], failed=counts["failed"])
            bar.refresh()
    if batch["status"] == "failed":
        return _report_failed(batch)
    if args.output and batch.get("output_file_id"):
        client.download(batch["output_file_id"], args.output)
    elif args.output:
        args.output.write_bytes(b"")
    if args.errors and batch.get("error_file_id"):
        client.download(batch["error_file_id"], args.errors)
    elif args.errors:
        args.errors.write_bytes(b"")
    counts = batch["request_counts"]
    print(
        f"batch {batch_id} {batch['status']}: {counts['completed']} completed, "
        f"{counts['failed']} failed of {counts['total']}",
        file=sys.stderr,
    )
    if batch["status"] == "expired":
        return EXIT_BATCH_EXPIRED
    if batch["status"] == "cancelled":
        return EXIT_BATCH_CANCELLED
    if counts["failed"] > args.max_failed:
        return EXIT_TOO_MANY_FAILED
    return EXIT_OK


def add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="print a batch object")
    p.add_argument("batch_id")
    _add_url(p)
    p.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    from conveyor.client import APIError, ConveyorClient

    try:
        with ConveyorClient(args.url) as client:
            print(json.dumps(client.batch(args.batch_id), indent=2))
    except (APIError, OSError) as err:
        return _fail("status", str(err))
    return 0


def add_results(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("results", help="print the result lines finished so far (JSONL)")
    p.add_argument("batch_id")
    p.add_argument("--after", help="only lines after this line id")
    _add_url(p)
    p.set_defaults(func=cmd_results)


def cmd_results(args: argparse.Namespace) -> int:
    from conveyor.client import APIError, ConveyorClient

    try:
        with ConveyorClient(args.url) as client:
            for line in client.results(args.batch_id, args.after):
                print(json.dumps(line, ensure_ascii=False))
    except (APIError, OSError) as err:
        return _fail("results", str(err))
    return 0


def add_keys(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "keys",
        help="create, list and revoke API keys (in the ledger at DATABASE_URL)",
        description="API keys for CONVEYOR_AUTH=required. A key belongs to a project; the "
        "files and batches made with it are visible only to keys of that project.",
    )
    keys = p.add_subparsers(dest="keys_command", required=True, metavar="{create,list,revoke}")
    create = keys.add_parser("create", help="make a key; its secret is printed once, last")
    create.add_argument("--name", required=True, help="what the key is for, e.g. nightly-eval")
    create.add_argument(
        "--project",
        help="the project it acts for, new or existing: a key of an existing project sees all "
        "its files and batches (default: a new project named after --name; an existing "
        "project of that name is refused, so that joining one is always asked for)",
    )
    create.set_defaults(func=cmd_keys_create)
    listing = keys.add_parser("list", help="the keys, without their secrets")
    listing.set_defaults(func=cmd_keys_list)
    revoke = keys.add_parser("revoke", help="revoke a key at once")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=cmd_keys_revoke)


def _key_ledger():
    from ledger.db import Ledger
    from ledger.migrate import upgrade

    settings = _settings()
    if settings.database_url is None:
        upgrade(settings.db_url)  # the embedded ledger migrates itself
    return Ledger(settings.db_url)


def cmd_keys_create(args: argparse.Namespace) -> int:
    from ledger.keys import NAME_CHARS, PROJECT_CHARS, check_label, create_key, project_exists

    try:
        name = check_label("--name", args.name, NAME_CHARS)
        project = check_label("--project", args.project or name, PROJECT_CHARS)
    except ValueError as err:
        return _fail("keys create", str(err), 2)
    ledger = _key_ledger()
    try:
        with ledger.session() as session:
            if args.project is None and project_exists(session, project):
                return _fail(
                    "keys create",
                    f"project {project!r} already exists; to give it another key, say so with "
                    f"--project {project!r}; for a new project, choose another --name",
                    2,
                )
            row, secret = create_key(session, name, project)
    finally:
        ledger.dispose()
    print(f"created {row.id} ({row.name}) for project {row.project!r}; the key, shown only once:")
    print(secret)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    from ledger.keys import list_keys

    ledger = _key_ledger()
    try:
        with ledger.session() as session:
            rows = list_keys(session)
    finally:
        ledger.dispose()
    print(f"{'id':<22} {'name':<24} {'project':<24} {'created':<20} revoked")
    for r in rows:
        revoked = _when(r.revoked_at) if r.revoked_at else "-"
        print(f"{r.id:<22} {r.name:<24} {r.project:<24} {_when(r.created_at):<20} {revoked}")
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from ledger.keys import revoke_key

    ledger = _key_ledger()
    try:
        with ledger.session() as session:
            row = revoke_key(session, args.key_id)
    finally:
        ledger.dispose()
    if row is None:
        return _fail("keys revoke", f"no key {args.key_id!r} (see `conveyor keys list`)")
    print(f"revoked {row.id} ({row.name})")
    return 0


def _when(ts: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))


def add_ready(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ready",
        help="exit 0 when the API is ready (its /readyz answers 200), else 1: a healthcheck",
    )
    p.add_argument(
        "--timeout", type=float, default=0, help="keep trying this many seconds (default: once)"
    )
    _add_url(p)
    p.set_defaults(func=cmd_ready)


def cmd_ready(args: argparse.Namespace) -> int:
    from conveyor.client import APIError, ConveyorClient

    try:
        with ConveyorClient(args.url) as client:
            client.wait_ready(args.timeout)
    except APIError as err:
        return _fail("ready", str(err))
    return 0


def add_cancel(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cancel", help="cancel a batch")
    p.add_argument("batch_id")
    _add_url(p)
    p.set_defaults(func=cmd_cancel)


def cmd_cancel(args: argparse.Namespace) -> int:
    from conveyor.client import APIError, ConveyorClient

    try:
        with ConveyorClient(args.url) as client:
            batch = client.cancel(args.batch_id)
    except (APIError, OSError) as err:
        return _fail("cancel", str(err))
    print(f"batch {batch['id']} is {batch['status']}")
    return 0


SERVICE_SUBCOMMANDS = [
    add_migrate,
    add_serve,
    add_worker,
    add_submit,
    add_status,
    add_results,
    add_cancel,
    add_ready,
    add_keys,
]
