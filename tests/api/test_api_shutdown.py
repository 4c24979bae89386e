"""SIGTERM on the API drains it: the listening socket closes at once, a response in flight
runs to its end, and then the process shuts down cleanly."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from conveyor.testing import Stack

CHUNK = 64 * 1024


def test_sigterm_drains_a_download_in_flight(stack: Stack, tmp_path: Path) -> None:
    api = stack.start_api()
    proc = stack.procs[-1]
    # 24 MB: far more than loopback socket buffers hold, so the server is still sending
    # while the client reads slowly
    line = b'{"custom_id": "x", "filler": "' + b"y" * (1 << 20) + b'"}\n'
    path = tmp_path / "big.jsonl"
    path.write_bytes(line * 24)
    with open(path, "rb") as f:
        r = httpx.post(f"{api}/v1/files", files={"file": f}, data={"purpose": "batch"}, timeout=60)
    r.raise_for_status()
    file_id = r.json()["id"]

    digest, received = hashlib.sha256(), 0
    with httpx.stream("GET", f"{api}/v1/files/{file_id}/content", timeout=60) as response:
        assert response.status_code == 200
        chunks = response.iter_raw(CHUNK)
        for _ in range(8):  # the download is under way
            data = next(chunks)
            digest.update(data)
            received += len(data)
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(1.0)
        with pytest.raises(httpx.ConnectError):  # no new connections once draining
            httpx.get(f"{api}/healthz", timeout=2)
        assert proc.poll() is None, "the API exited with a response still in flight"
        for n, data in enumerate(chunks):
            digest.update(data)
            received += len(data)
            if n < 20:
                time.sleep(0.02)  # a slow reader: the server keeps sending while draining
    assert received == path.stat().st_size
    assert digest.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()
    # uvicorn re-raises the signal once it has shut down, so the exit status says SIGTERM
    assert proc.wait(30) == -signal.SIGTERM, stack.log("api")
    log = stack.log("api")
    assert "Waiting for connections to close" in log and "Application shutdown complete" in log


def test_startup_objects_are_kept_out_of_full_collections(tmp_path: Path) -> None:
    """What the app loads at start is frozen out of the collector's full passes while it runs
    (they would stall every request in flight), and handed back when it stops."""
    import gc

    from fastapi.testclient import TestClient

    from conveyor.api.app import create_app
    from conveyor.ledger.migrate import upgrade
    from conveyor.settings import Settings

    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade(db)
    settings = Settings(data_dir=tmp_path, database_url=db, redis_url="redis://127.0.0.1:1/0")
    assert gc.get_freeze_count() == 0
    with TestClient(create_app(settings, reconcile=False)) as client:
        assert gc.get_freeze_count() > 10_000
        assert client.get("/v1/batches").status_code == 200
    assert gc.get_freeze_count() == 0
