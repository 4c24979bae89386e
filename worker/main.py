"""Start a worker: load the engine once, then consume shard tasks on Celery's threads pool."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from conveyor.settings import Settings
from worker.echo import ECHO_MODEL, EchoEngine
from worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)


def build_engine(model: str, engine_kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """(engine, SamplingParams class) for `model`; `echo` is the null engine."""
    from engine import LLM, SamplingParams

    if model == ECHO_MODEL:
        return EchoEngine(), SamplingParams
    return LLM(model, **engine_kwargs), SamplingParams


def start_runtime(
    settings: Settings,
    model: str,
    served_names: list[str] | None,
    engine_kwargs: dict[str, Any],
    name: str | None = None,
) -> WorkerRuntime:
    engine, params_cls = build_engine(model, engine_kwargs)
    names = list(served_names or []) + [model]
    runtime = WorkerRuntime(settings, engine, names, params_cls, name=name)
    runtime.start()
    return runtime


def consume(runtime: WorkerRuntime, concurrency: int, loglevel: str = "INFO") -> None:
    """Run the Celery worker in this thread until it is told to stop (SIGTERM, Ctrl-C)."""
    node = f"{runtime.name}@{socket.gethostname()}"
    argv = [
        "worker",
        "--pool=threads",
        f"--concurrency={concurrency}",
        f"--queues={','.join(runtime.queues)}",
        f"--hostname={node}",
        f"--loglevel={loglevel}",
        "--without-gossip",
        "--without-mingle",
    ]
    log.info("worker %s serving %s on %s", runtime.name, runtime.model_names, runtime.queues)
    os.environ.setdefault("FORKED_BY_MULTIPROCESSING", "1")
    runtime.app.worker_main(argv)
