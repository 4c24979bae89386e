"""What produced a batch's results travels with its output and error files: their file objects
carry the batch's `reproducibility`, and their content's answer names the batch and the model
fingerprints in its headers, the result lines themselves unchanged. The ledger is written as
a worker writes it (runs, results, the batch completed by the ledger's own lifecycle); the API
runs in process, on PostgreSQL and on SQLite."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from conveyor.client import json_lines
from conveyor.ledger import batch_lifecycle, results
from conveyor.ledger.batch_runs import record_run
from conveyor.ledger.db import Ledger
from conveyor.ledger.ids import new_batch_id
from conveyor.ledger.models import BatchRow, RequestRow, ResultRow
from conveyor.settings import Settings

OPENAI_FILE_KEYS = {"id", "object", "bytes", "created_at", "filename", "purpose", "status",
                    "expires_at", "status_details"}  # fmt: skip
RECORD = {"conveyor": "0.1.0", "engine": {"dtype": "torch.float32", "plan": {"device": "cpu"}},
          "default_sampling": {"temperature": 0.6, "top_p": 0.95}}  # fmt: skip


def result_lines(batch_id: str, text: str = "a") -> list[dict]:
    """Two answers and one error line, as a worker writes them, their texts made of `text`."""
    lines = []
    for i in range(3):
        body = {"id": f"chatcmpl-{i}", "object": "chat.completion", "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": f"{text}{i}"},
                             "finish_reason": "stop"}]}  # fmt: skip
        response = {"status_code": 200, "request_id": f"req-{i}", "body": body}
        error = {"code": "invalid_request", "message": f"bad {text}", "line": i + 1}
        failed = i == 2
        line = {"id": f"{batch_id}-l{i}", "custom_id": f"c{i}"}
        lines.append(line | {"response": None, "error": error} if failed
                     else line | {"response": response, "error": None})  # fmt: skip
    return lines


def finished_batch(
    ledger: Ledger, runs: list[tuple[str, str]], text: str = "a"
) -> tuple[str, list[dict]]:
    """A batch that `runs` ((worker, fingerprint), first first) ran to completion: its id and
    its result lines."""
    batch_id = new_batch_id()
    lines = result_lines(batch_id, text)
    with ledger.session() as session:
        session.add(BatchRow(id=batch_id, input_file_id="file-x", model="m", total=len(lines),
                             endpoint="/v1/chat/completions", completion_window="24h",
                             status="in_progress", created_at=0))  # fmt: skip
        requests = [RequestRow(batch_id=batch_id, shard_index=0, line=i + 1,
                               custom_id=line["custom_id"], raw="{}")
                    for i, line in enumerate(lines)]  # fmt: skip
        session.add_all(requests)
        session.flush()
        for worker, fingerprint in runs:
            record_run(session, batch_id, worker, fingerprint, RECORD)
        rows = [results.result_row(r.id, batch_id, line, ok=line["error"] is None)
                for r, line in zip(requests, lines, strict=True)]  # fmt: skip
        results.record_results(session, rows)
    with ledger.session() as session:
        assert batch_lifecycle.advance(session, batch_id, 60) == "completed"
    return batch_id, lines


@pytest.fixture(params=["postgresql", "sqlite"])
def api(request, tmp_path: Path) -> Iterator[tuple[TestClient, Ledger]]:
    """The API in process on a migrated ledger, and that ledger."""
    if request.param == "postgresql":
        url = request.getfixturevalue("database_url")
    else:
        from conveyor.ledger.migrate import upgrade

        url = f"sqlite:///{tmp_path / 'ledger.db'}"
        upgrade(url)
    settings = Settings(data_dir=tmp_path, database_url=url, redis_url="redis://127.0.0.1:1/0")
    from conveyor.api.app import create_app

    ledger = Ledger(url)
    with TestClient(create_app(settings, reconcile=False)) as client:
        yield client, ledger
    ledger.dispose()


def test_a_batch_file_object_carries_what_produced_it(api: tuple[TestClient, Ledger]):
    client, ledger = api
    batch_id, _ = finished_batch(ledger, [("w1", "fp-a"), ("w2", "fp-b")])
    batch = client.get(f"/v1/batches/{batch_id}").json()
    runs = batch["reproducibility"]
    assert [(r["worker"], r["fingerprint"]) for r in runs] == [("w1", "fp-a"), ("w2", "fp-b")]
    assert runs[0]["engine"] == RECORD["engine"]
    assert runs[0]["default_sampling"] == RECORD["default_sampling"]
    upload = client.post("/v1/files", files={"file": ("in.jsonl", b'{"a": 1}\n')},
                         data={"purpose": "batch"}).json()  # fmt: skip
    assert upload["reproducibility"] is None  # an uploaded file: nothing produced it here

    for file_id in (batch["output_file_id"], batch["error_file_id"]):
        file = client.get(f"/v1/files/{file_id}").json()
        assert set(file) == OPENAI_FILE_KEYS | {"reproducibility"}
        assert file["purpose"] in ("batch_output", "batch_error") and file["object"] == "file"
        assert file["reproducibility"] == runs
    listed = {f["id"]: f for f in client.get("/v1/files").json()["data"]}
    assert listed[batch["output_file_id"]]["reproducibility"] == runs
    assert listed[batch["error_file_id"]]["reproducibility"] == runs
    assert listed[upload["id"]]["reproducibility"] is None
    assert client.get(f"/v1/files/{upload['id']}").json() == upload


def test_a_batch_file_download_names_what_produced_it(api: tuple[TestClient, Ledger]):
    client, ledger = api
    runs = [("w1", "fp-a"), ("w2", "fp-b"), ("w3", "fp-a")]  # two workers on one fingerprint
    batch_id, lines = finished_batch(ledger, runs)
    batch = client.get(f"/v1/batches/{batch_id}").json()
    for file_id, wanted in ((batch["output_file_id"], lines[:2]),
                            (batch["error_file_id"], lines[2:])):  # fmt: skip
        content = client.get(f"/v1/files/{file_id}/content")
        assert content.status_code == 200
        assert content.headers["conveyor-batch-id"] == batch_id
        assert content.headers["conveyor-fingerprints"] == "fp-a,fp-b"  # each once, first first
        # the lines are the results as written: no record in any of them
        assert [json.loads(x) for x in content.text.splitlines()] == wanted

    upload = client.post("/v1/files", files={"file": ("in.jsonl", b'{"a": 1}\n')},
                         data={"purpose": "batch"}).json()  # fmt: skip
    content = client.get(f"/v1/files/{upload['id']}/content")
    assert content.content == b'{"a": 1}\n'
    assert not any(name.startswith("conveyor-") for name in content.headers)


def test_a_batch_without_a_recorded_run_says_so(api: tuple[TestClient, Ledger]):
    # the echo engine has no model to fingerprint: no run is recorded
    client, ledger = api
    batch_id, _ = finished_batch(ledger, [])
    output_file_id = client.get(f"/v1/batches/{batch_id}").json()["output_file_id"]
    assert client.get(f"/v1/files/{output_file_id}").json()["reproducibility"] == []
    content = client.get(f"/v1/files/{output_file_id}/content")
    assert content.headers["conveyor-batch-id"] == batch_id
    assert "conveyor-fingerprints" not in content.headers


# what a model can write: besides other non-ASCII text, characters that a JSON string may hold
# as they are but that `str.splitlines` and httpx's `iter_lines` take for line ends
AWKWARD = "é 😀 x\x85y\u2028z\u2029w"


def chunked(data: bytes, size: int = 7) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def test_result_lines_stay_one_line_for_every_reader_and_a_file_says_its_bytes(
    api: tuple[TestClient, Ledger],
):
    client, ledger = api
    batch_id, lines = finished_batch(ledger, [], text=AWKWARD)
    batch = client.get(f"/v1/batches/{batch_id}").json()
    for file_id, wanted in ((batch["output_file_id"], lines[:2]),
                            (batch["error_file_id"], lines[2:])):  # fmt: skip
        content = client.get(f"/v1/files/{file_id}/content")
        assert [json.loads(x) for x in content.text.splitlines()] == wanted
        assert client.get(f"/v1/files/{file_id}").json()["bytes"] == len(content.content)
    streamed = client.get(f"/v1/batches/{batch_id}/results")
    assert [json.loads(x) for x in streamed.text.splitlines()] == lines
    assert list(json_lines(chunked(streamed.content))) == lines


def test_a_line_stored_with_raw_line_ends_is_sent_as_one_and_read_as_one(
    api: tuple[TestClient, Ledger],
):
    client, ledger = api
    batch_id, lines = finished_batch(ledger, [], text=AWKWARD)
    with ledger.session() as session:  # as results were written before their line ends were escaped
        for row in session.scalars(sa.select(ResultRow).where(ResultRow.batch_id == batch_id)):
            row.output = json.dumps(json.loads(row.output), ensure_ascii=False)
            assert "\u2028" in row.output
    streamed = client.get(f"/v1/batches/{batch_id}/results")
    assert [json.loads(x) for x in streamed.text.splitlines()] == lines
    # and the client reads such lines from a server that sends them as they are
    raw = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines).encode()
    assert len(raw.decode().splitlines()) > len(lines)
    assert list(json_lines(chunked(raw))) == lines
