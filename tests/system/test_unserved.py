"""A batch whose model no live worker serves says so (batch object, /readyz, metrics), and the
models list shows served names, never a worker's file paths."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import sqlalchemy as sa

from conveyor.ledger.db import Ledger
from conveyor.ledger.models import BatchRow
from conveyor.ledger.serving import note_serving, unserved_models
from conveyor.served_names import is_path_alias, served_model_names
from conveyor.settings import normalize_database_url
from conveyor.testing import Stack, batch_lines, submit_batch, wait_for, write_jsonl
from tests.system.test_metrics import scrape


def test_a_model_directory_is_served_under_its_name_and_its_path(tmp_path: Path) -> None:
    """The directory's name first; the path as given (vLLM's name for it) as an alias that
    the models list leaves out."""
    model = tmp_path / "checkpoints" / "Qwen3-0.6B"
    model.mkdir(parents=True)
    path = str(model)
    assert served_model_names(path) == ["Qwen3-0.6B", path]
    assert served_model_names(path + "/") == ["Qwen3-0.6B", path + "/", path]
    assert served_model_names("Qwen/Qwen3-0.6B") == ["Qwen/Qwen3-0.6B"]  # a hub id is a name
    assert served_model_names(path, ["qwen3", "q", "qwen3"]) == ["qwen3", "q", path]
    assert served_model_names(path, [path]) == [path]  # asked for
    names = served_model_names(path)
    assert [n for n in names if not is_path_alias(n, names)] == ["Qwen3-0.6B"]
    assert not is_path_alias(path, [path])  # the only name: listed


def _batch(session, batch_id: str, model: str, status: str = "in_progress") -> None:
    session.add(
        BatchRow(
            id=batch_id,
            input_file_id="file-x",
            endpoint="/v1/chat/completions",
            completion_window="24h",
            model=model,
            status=status,
            created_at=0,
        )
    )


def test_the_ledger_notes_batches_no_worker_serves(database_url: str) -> None:
    ledger = Ledger(normalize_database_url(database_url))
    with ledger.session() as session:
        _batch(session, "b-served", "tiny")
        _batch(session, "b-lost-1", "nobody")
        _batch(session, "b-lost-2", "nobody")
        _batch(session, "b-done", "nobody", status="completed")
    served = {"tiny"}
    with ledger.session() as session:
        note_serving(session, lambda model: model in served)
    with ledger.session() as session:
        since = dict(session.execute(sa.select(BatchRow.id, BatchRow.unserved_since)).all())
        assert since["b-served"] is None and since["b-done"] is None
        assert since["b-lost-1"] is not None and since["b-lost-2"] is not None
        assert unserved_models(session) == {"nobody": 2}
    time.sleep(0.01)
    with ledger.session() as session:  # a later round keeps the first moment
        note_serving(session, lambda model: model in served)
    with ledger.session() as session:
        assert session.get(BatchRow, "b-lost-1").unserved_since == since["b-lost-1"]
    served.add("nobody")  # a worker for it came up
    with ledger.session() as session:
        note_serving(session, lambda model: model in served)
    with ledger.session() as session:
        assert unserved_models(session) == {}
        assert session.get(BatchRow, "b-lost-1").unserved_since is None
    ledger.dispose()


def test_a_batch_for_a_model_nobody_serves_says_so(
    stack: Stack, chat_model: Path, tmp_path: Path
) -> None:
    api = stack.start_api()
    stack.start_worker("w1", chat_model)  # serves "tiny" only
    path = write_jsonl(tmp_path / "in.jsonl", batch_lines(4, model="nobody"))
    batch_id = submit_batch(api, path)
    batch = httpx.get(f"{api}/v1/batches/{batch_id}").json()  # said from the start
    assert batch["status"] == "in_progress"
    assert "no live worker serves model 'nobody'" in batch["status_details"]
    ready = httpx.get(f"{api}/readyz")
    assert ready.status_code == 200  # the API itself is ready; the note is information
    assert ready.json()["unserved_models"] == {"nobody": 1}
    assert scrape(f"{api}/metrics")["conveyor:unserved_batches"] == {
        (("model_name", "nobody"),): 1.0
    }

    # a batch for the served model carries no note
    served = submit_batch(api, write_jsonl(tmp_path / "ok.jsonl", batch_lines(2)))
    done = wait_for(api, served, timeout=120)
    assert done["status"] == "completed" and done["status_details"] is None
    # the model's path, as vLLM names it, is served too, and not listed as a model
    lines = batch_lines(2, model=str(chat_model))
    by_path = submit_batch(api, write_jsonl(tmp_path / "path.jsonl", lines))
    done = wait_for(api, by_path, timeout=120)
    assert done["status"] == "completed" and done["status_details"] is None
    listed = {m["id"] for m in httpx.get(f"{api}/v1/models").json()["data"]}
    assert listed == {"tiny"}
    # a request that names no model goes to the one listed, the alias not counted as another
    assert httpx.get(f"{api}/tokenizer_info").status_code == 200

    stack.start_worker("w2", chat_model, served="nobody")  # now someone serves it
    done = wait_for(api, batch_id, timeout=120)
    assert done["status"] == "completed" and done["status_details"] is None
    assert done["request_counts"] == {"total": 4, "completed": 4, "failed": 0, "reused": 0}
    assert httpx.get(f"{api}/readyz").json()["unserved_models"] == {}


def test_a_batch_whose_model_stays_unserved_fails_with_model_not_found(
    stack: Stack, chat_model: Path, tmp_path: Path
) -> None:
    """A model name no worker serves (a typo, a worker that never comes) fails the batch after
    CONVEYOR_UNSERVED_TIMEOUT instead of its whole completion window; a served batch beside it
    is not touched."""
    stack.env["CONVEYOR_UNSERVED_TIMEOUT"] = "2"
    api = stack.start_api()
    stack.start_worker("w1", chat_model)  # serves "tiny" only
    lost = submit_batch(api, write_jsonl(tmp_path / "in.jsonl", batch_lines(3, model="qwne3")))
    served = submit_batch(api, write_jsonl(tmp_path / "ok.jsonl", batch_lines(2)))
    failed = wait_for(api, lost, timeout=60)
    assert failed["status"] == "failed" and failed["failed_at"] is not None
    (error,) = failed["errors"]["data"]
    assert error["code"] == "model_not_found" and "'qwne3'" in error["message"]
    assert failed["request_counts"] == {"total": 3, "completed": 0, "failed": 3, "reused": 0}
    lines = httpx.get(f"{api}/v1/files/{failed['error_file_id']}/content").text.splitlines()
    assert len(lines) == 3
    assert all('"model_not_found"' in line for line in lines)
    assert wait_for(api, served, timeout=120)["status"] == "completed"
