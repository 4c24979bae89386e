"""Start a worker: load the engine once, then consume shard tasks on Celery's threads pool."""

from __future__ import annotations

import gc
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import IO, Any, NoReturn

from celery.signals import worker_shutting_down

from conveyor.engine.config import EngineConfig
from conveyor.served_names import served_model_names
from conveyor.settings import Settings
from conveyor.worker.echo import ECHO_MODEL, EchoEngine
from conveyor.worker.gpu import claim_gpu
from conveyor.worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)


def build_engine(model: str, config: EngineConfig) -> Any:
    """The engine for `model`; `echo` is the null engine."""
    from conveyor.engine import LLM

    if model == ECHO_MODEL:
        step = float(os.environ.get("CONVEYOR_ECHO_STEP_SECONDS") or 0)
        return EchoEngine(step, config.max_num_seqs)
    llm = LLM(model, config)
    llm.warm_up()  # compile now, not in the first request (an online one may have a deadline)
    return llm


def pick_device(settings: Settings, config: EngineConfig) -> EngineConfig:
    """With CONVEYOR_GPU_LOCK_DIR set and several GPUs visible, claim one for this worker."""
    if settings.gpu_lock_dir is None or config.device not in ("auto", "cuda"):
        return config
    import torch

    count = torch.cuda.device_count()
    if count <= 1:
        return config
    index, lock = claim_gpu(settings.gpu_lock_dir, count)
    _held_locks.append(lock)
    log.info("claimed GPU %d of %d (lock in %s)", index, count, settings.gpu_lock_dir)
    return replace(config, device=f"cuda:{index}")


_held_locks: list[IO[bytes]] = []  # the GPU claim lasts as long as the process


def start_runtime(
    settings: Settings,
    model: str,
    served_names: list[str] | None,
    config: EngineConfig,
    name: str | None = None,
    restart_engine: bool = False,
) -> WorkerRuntime:
    """The worker runtime, started. With `restart_engine`, an engine that fails is built anew
    in this process (for the embedded service, which no supervisor restarts)."""
    if model != ECHO_MODEL:
        config = pick_device(settings, config)
    engine = build_engine(model, config)
    names = served_model_names(model, served_names)
    rebuild = (lambda: _rebuild_engine(model, config)) if restart_engine else None
    runtime = WorkerRuntime(settings, engine, names, name=name, rebuild_engine=rebuild)
    runtime.start()
    freeze_heap()
    return runtime


def freeze_heap() -> None:
    """Keep what start-up made (the model's modules, torch, the libraries: hundreds of
    thousands of objects) out of the collector's full passes, as vLLM does once its engine is
    up: each full pass walked them all and stalled the engine's thread ~0.4 s (a tiny model
    under online churn); the requests' own objects are what the passes are for."""
    gc.collect()
    gc.freeze()


def _rebuild_engine(model: str, config: EngineConfig) -> Any:
    """A new engine after the last failed: the failed one's objects go back to the collector
    (its tensors may sit in reference cycles), and the new one's stay with it."""
    gc.unfreeze()
    return build_engine(model, config)


def consume(
    runtime: WorkerRuntime,
    concurrency: int,
    loglevel: str = "INFO",
    on_interrupt: Callable[[int], NoReturn] | None = None,
) -> None:
    """Run the Celery worker in this thread until it is told to stop: SIGTERM (a supervisor's
    stop) gives running shards CONVEYOR_SHUTDOWN_TIMEOUT to finish; Ctrl-C, with
    `on_interrupt`, hands them back at once (`WorkerRuntime.hand_back_now`) and then calls it
    with the count of those that were late, to end the process."""
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
    def _shutting_down(sig: str = "", **_: Any) -> None:
        if sig == "SIGINT" and on_interrupt is not None:
            handover = threading.Thread(
                target=lambda: on_interrupt(runtime.hand_back_now()), daemon=True
            )
            handovers.append(handover)
            handover.start()
        else:
            runtime.begin_shutdown(runtime.settings.shutdown_timeout)

    handovers: list[threading.Thread] = []
    os.environ.setdefault("FORKED_BY_MULTIPROCESSING", "1")
    runtime.app.worker_main(argv)
    for handover in handovers:  # Celery may end first: `on_interrupt` ends the process
        handover.join()
