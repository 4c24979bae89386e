"""A shutdown that takes long says where every thread is."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from conveyor.worker.runtime import WorkerRuntime


def test_a_slow_shutdown_logs_every_thread_stack(capfd, caplog):
    with caplog.at_level(logging.WARNING, logger="conveyor.worker.runtime"):
        WorkerRuntime._report_slow_shutdown(SimpleNamespace(_shard_runs=2))
    assert "still shutting down 20 s after the signal (2 shards running)" in caplog.text
    stacks = capfd.readouterr().err
    assert "most recent call first" in stacks and "test_slow_shutdown.py" in stacks
