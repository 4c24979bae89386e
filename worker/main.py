"""Start a worker: load the engine once, then consume shard tasks on Celery's threads pool."""

from __future__ import annotations

import logging
import os
import socket
from typing import IO, Any

from celery.signals import worker_shutting_down

from conveyor.served_names import served_model_names
from conveyor.settings import Settings
from worker.echo import ECHO_MODEL, EchoEngine
from worker.gpu import claim_gpu
from worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)


def build_engine(model: str, engine_kwargs: dict[str, Any]) -> Any:
    """The engine for `model`; `echo` is the null engine."""
    from engine import LLM

    if model == ECHO_MODEL:
        step = float(os.environ.get("CONVEYOR_ECHO_STEP_SECONDS") or 0)
        return EchoEngine(step, engine_kwargs.get("max_num_seqs") or 256)
    return LLM(model, **engine_kwargs)


def pick_device(settings: Settings, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """With CONVEYOR_GPU_LOCK_DIR set and several GPUs visible, claim one for this worker."""
    device = engine_kwargs.get("device") or "auto"
    if settings.gpu_lock_dir is None or device not in ("auto", "cuda"):
        return engine_kwargs
    import torch

    count = torch.cuda.device_count()
    if count <= 1:
        return engine_kwargs
    index, lock = claim_gpu(settings.gpu_lock_dir, count)
    _held_locks.append(lock)
    log.info("claimed GPU %d of %d (lock in %s)", index, count, settings.gpu_lock_dir)
    return {**engine_kwargs, "device": f"cuda:{index}"}


_held_locks: list[IO[bytes]] = []  # the GPU claim lasts as long as the process


def start_runtime(
    settings: Settings,
    model: str,
    served_names: list[str] | None,
    engine_kwargs: dict[str, Any],
    name: str | None = None,
) -> WorkerRuntime:
    if model != ECHO_MODEL:
        engine_kwargs = pick_device(settings, engine_kwargs)
    engine = build_engine(model, engine_kwargs)
    names = served_model_names(model, served_names)
    runtime = WorkerRuntime(settings, engine, names, name=name)
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

    @worker_shutting_down.connect(weak=False)
    def _shutting_down(**_: Any) -> None:
        runtime.begin_shutdown(runtime.settings.shutdown_timeout)

    os.environ.setdefault("FORKED_BY_MULTIPROCESSING", "1")
    runtime.app.worker_main(argv)
