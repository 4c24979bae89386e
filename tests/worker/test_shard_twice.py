"""A shard delivered twice to the worker that is running it (handed back by a worker that
stopped, and re-sent by the reconciler as well) runs once: the second delivery is dropped,
where two runs would add the same requests to the engine and fail them as duplicates."""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

from conveyor.worker.runtime import WorkerRuntime


def runtime_running(started: threading.Event, release: threading.Event) -> SimpleNamespace:
    runs: list[int] = []

    def run(shard_id: int) -> str:
        runs.append(shard_id)
        if shard_id == 7 and not release.is_set():  # the first run of shard 7 stays running
            started.set()
            release.wait(10)
        return "done"

    return SimpleNamespace(
        name="w", _engine_up=lambda: True, _shard_runs=0, _shard_runs_lock=threading.Lock(),
        _running_shards=set(), _run_shard=run, runs=runs,
    )  # fmt: skip


def test_a_shard_running_here_is_not_run_again_beside_itself(monkeypatch) -> None:
    monkeypatch.setattr("conveyor.worker.runtime.log_context", lambda **_: contextlib.nullcontext())
    started, release = threading.Event(), threading.Event()
    runtime = runtime_running(started, release)
    results: list[str] = []
    first = threading.Thread(target=lambda: results.append(WorkerRuntime.run_shard(runtime, 7)))
    first.start()
    assert started.wait(10)
    assert WorkerRuntime.run_shard(runtime, 7) == "already running"
    assert WorkerRuntime.run_shard(runtime, 8) == "done"  # another shard runs beside it
    release.set()
    first.join(10)
    assert results == ["done"] and runtime.runs == [7, 8]
    assert runtime._running_shards == set() and runtime._shard_runs == 0
    assert WorkerRuntime.run_shard(runtime, 7) == "done"  # once it has ended, it may run again
