"""The server-side commands, what runs the service: `conveyor migrate | serve | worker` and
`conveyor keys` (its API keys), `conveyor ready` (its healthcheck)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from conveyor.cli.common import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, PROG, add_url_argument, fail
from conveyor.cli.engine_options import add_engine_arguments, engine_config
from conveyor.env_args import apply_env_defaults
from conveyor.served_names import served_model_names


def _settings():
    from conveyor.settings import Settings

    return Settings()


def _upgrade_embedded_ledger(settings: Any) -> None:
    if settings.database_url is None:
        from conveyor.ledger.migrate import upgrade

        upgrade(settings.db_url)  # the embedded ledger migrates itself


def _log_setup(level: str) -> None:
    from conveyor.logs import setup_logging

    setup_logging(level, _settings().log_format)


# ---- migrate ---------------------------------------------------------------------------------


def add_migrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("migrate", help="create or upgrade the ledger's tables (Alembic)")
    p.add_argument("--database-url", help="default: $DATABASE_URL, else the embedded SQLite file")
    p.set_defaults(func=cmd_migrate)


def cmd_migrate(args: argparse.Namespace) -> int:
    from conveyor.ledger.migrate import current_revision, upgrade
    from conveyor.settings import normalize_database_url

    settings = _settings()
    url = normalize_database_url(args.database_url) if args.database_url else settings.db_url
    try:
        upgrade(url)
    except Exception as err:
        return fail("migrate", f"{type(err).__name__}: {err}")
    print(f"ledger at revision {current_revision(url)}")
    return EXIT_OK


# ---- worker ----------------------------------------------------------------------------------


def add_worker(sub: argparse._SubParsersAction) -> None:
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
        p.set_defaults(func=lambda _: fail("worker", "; ".join(errors), EXIT_USAGE))


def cmd_worker(args: argparse.Namespace) -> int:
    settings = _settings()
    _log_setup(args.loglevel)
    _upgrade_embedded_ledger(settings)
    from conveyor.worker.main import consume, start_runtime
    from conveyor.worker.runtime import ENGINE_FAILED_EXIT

    try:
        runtime = start_runtime(
            settings, args.model, args.served_model_name, engine_config(args), name=args.name
        )
    except Exception as err:
        return fail("worker", f"cannot start: {type(err).__name__}: {err}")
    if args.metrics_port:
        runtime.metrics.serve(args.metrics_port)
    try:
        consume(runtime, args.concurrency, args.loglevel, on_interrupt=interrupted("worker"))
    finally:
        runtime.stop()
    exit_now(ENGINE_FAILED_EXIT if runtime.engine_failed.is_set() else EXIT_OK)


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
    engine = add_engine_arguments(
        p,
        model_help="model of the in-process worker (embedded mode only; default: a tiny demo "
        "model written on first use, served as `demo`)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="the in-process worker's shard tasks in flight at once (default 8)",
    )
    p.add_argument(
        "--no-worker", action="store_true", help="embedded mode without the in-process worker"
    )
    p.set_defaults(func=cmd_serve)
    p.epilog = (
        "The engine options (and --concurrency) of the in-process worker can also come from the "
        "environment, as for `conveyor worker`: --max-num-seqs from CONVEYOR_MAX_NUM_SEQS, and "
        "so on (the command line wins)."
    )
    if errors := apply_env_defaults(p, [*engine, "concurrency"]):
        p.set_defaults(func=lambda _: fail("serve", "; ".join(errors), EXIT_USAGE))


def cmd_serve(args: argparse.Namespace) -> int:
    settings = _settings()
    _log_setup("INFO")
    if settings.auth == "off":
        print(
            "authentication is off (CONVEYOR_AUTH=off): every client sees every file and "
            "batch; set CONVEYOR_AUTH=required and create keys with `conveyor keys create` "
            "before exposing the API beyond this machine",
            file=sys.stderr,
        )
    from conveyor.api.server import listen

    try:
        sock = listen(args.host, args.port)
    except OSError as err:
        return fail("serve", f"cannot listen on {args.host}:{args.port}: {err.strerror or err}")
    _upgrade_embedded_ledger(settings)
    server = _api_server(settings)
    if not settings.embedded or args.no_worker:
        server.run(sockets=[sock])
        return EXIT_OK

    from conveyor.worker.main import consume, start_runtime
    from conveyor.worker.runtime import ENGINE_FAILED_EXIT

    model, names = _embedded_model(settings, args)
    print(
        f"embedded mode: ledger and broker under {settings.data_dir.resolve()}; "
        f"serving model {names[0]!r}",
        file=sys.stderr,
    )
    try:
        runtime = start_runtime(settings, model, names, engine_config(args), restart_engine=True)
    except Exception as err:
        return fail("serve", f"cannot start the worker: {type(err).__name__}: {err}")
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="conveyor-api", daemon=True
    )
    thread.start()
    try:
        # Celery wants the main thread
        consume(runtime, args.concurrency, on_interrupt=interrupted("serve"))
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        runtime.stop()
    exit_now(ENGINE_FAILED_EXIT if runtime.engine_failed.is_set() else EXIT_OK)


def interrupted(command: str) -> Callable[[int], NoReturn]:
    """What ends `conveyor COMMAND` after Ctrl-C handed its shards back: one line saying what
    became of them, and exit 130 at once: the ledger holds all that must last, and the
    interpreter's teardown of a model takes seconds."""

    def end(late: int) -> NoReturn:
        still = f" ({late} not yet: the reconciler re-sends them)" if late else ""
        print(
            f"{PROG} {command}: interrupted; its running shards went back to the queue{still};"
            " running it again goes on with them",
            file=sys.__stderr__,
            flush=True,
        )
        exit_now(EXIT_INTERRUPTED)

    return end


def exit_now(code: int) -> NoReturn:
    """End a worker's process once it has stopped, skipping the interpreter's teardown: what
    must last is in the ledger by then (results committed, the worker withdrawn), while the
    teardown's last garbage collection over a loaded model's objects takes 1-2 s, which a
    supervisor stopping or restarting the worker waits for."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _api_server(settings: Any) -> Any:
    """The API's uvicorn server, not yet running: its `run` takes the socket to serve on."""
    from conveyor.api.server import api_server

    return api_server(settings)


def _embedded_model(settings: Any, args: argparse.Namespace) -> tuple[str, list[str]]:
    """(model, served names) of the in-process worker: --model, else the demo model."""
    if args.model is not None:
        return args.model, served_model_names(args.model, args.served_model_name)
    from conveyor.demo_model import write_tiny_model

    demo = settings.data_dir / "demo-model"
    if not (demo / "config.json").exists():
        write_tiny_model(demo, "llama")
    model = str(demo)
    return model, served_model_names(model, args.served_model_name or ["demo"])


# ---- keys, ready ------------------------------------------------------------------------------


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
    from conveyor.ledger.db import Ledger

    settings = _settings()
    _upgrade_embedded_ledger(settings)
    return Ledger(settings.db_url)


def cmd_keys_create(args: argparse.Namespace) -> int:
    from conveyor.ledger.keys import (
        NAME_CHARS,
        PROJECT_CHARS,
        check_label,
        create_key,
        project_exists,
    )

    try:
        name = check_label("--name", args.name, NAME_CHARS)
        project = check_label("--project", args.project or name, PROJECT_CHARS)
    except ValueError as err:
        return fail("keys create", str(err), EXIT_USAGE)
    ledger = _key_ledger()
    try:
        with ledger.session() as session:
            if args.project is None and project_exists(session, project):
                return fail(
                    "keys create",
                    f"project {project!r} already exists; to give it another key, say so with "
                    f"--project {project!r}; for a new project, choose another --name",
                    EXIT_USAGE,
                )
            row, secret = create_key(session, name, project)
    finally:
        ledger.dispose()
    print(f"created {row.id} ({row.name}) for project {row.project!r}; the key, shown only once:")
    print(secret)
    return EXIT_OK


def cmd_keys_list(args: argparse.Namespace) -> int:
    from conveyor.ledger.keys import list_keys

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
    return EXIT_OK


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from conveyor.ledger.keys import revoke_key

    ledger = _key_ledger()
    try:
        with ledger.session() as session:
            row = revoke_key(session, args.key_id)
    finally:
        ledger.dispose()
    if row is None:
        return fail("keys revoke", f"no key {args.key_id!r} (see `conveyor keys list`)")
    print(f"revoked {row.id} ({row.name})")
    return EXIT_OK


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
    add_url_argument(p)
    p.set_defaults(func=cmd_ready)


def cmd_ready(args: argparse.Namespace) -> int:
    from conveyor.client import ConveyorClient, ServiceError

    try:
        with ConveyorClient(args.url) as client:
            client.wait_ready(args.timeout)
    except ServiceError as err:
        return fail("ready", str(err))
    return EXIT_OK
