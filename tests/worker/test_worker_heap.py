"""A started worker keeps what start-up made out of the collector's full passes, and gives it
back before it builds a new engine (the failed one must be collectable)."""

from __future__ import annotations

import gc
from pathlib import Path

from conveyor.engine.config import EngineConfig
from conveyor.ledger.migrate import upgrade
from conveyor.settings import Settings
from conveyor.worker.echo import ECHO_MODEL
from conveyor.worker.main import _rebuild_engine, start_runtime


def test_start_up_objects_are_frozen_and_a_rebuild_thaws_them(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, database_url=None, redis_url=None)
    upgrade(settings.db_url)
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    runtime = start_runtime(settings, ECHO_MODEL, None, EngineConfig(), name="w-heap")
    try:
        assert gc.get_freeze_count() > 10_000  # torch, the libraries, the runtime's objects
        engine = _rebuild_engine(ECHO_MODEL, EngineConfig())
        assert engine is not runtime.engine
        assert gc.get_freeze_count() == 0
    finally:
        runtime.stop()
        gc.unfreeze()
