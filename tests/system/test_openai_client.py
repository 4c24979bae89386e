"""The official `openai` package drives the service: what it sends is accepted and what the
service answers parses into its `Batch` / `FileObject` types."""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest
from openai.types import Batch, FileDeleted, FileObject

from conveyor.testing import Stack, batch_lines, write_jsonl

TERMINAL = ("completed", "failed", "expired", "cancelled")


def wait_status(client: openai.OpenAI, batch_id: str, statuses, timeout: float = 300) -> Batch:
    deadline = time.time() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        assert isinstance(batch, Batch)
        if batch.status in statuses:
            return batch
        assert time.time() < deadline, f"batch {batch_id} still {batch.status}: {batch}"
        time.sleep(0.3)


def test_openai_client_runs_a_batch(stack: Stack, chat_model: Path, tmp_path: Path):
    lines = batch_lines(24, max_tokens=6)
    bad = dict(lines[5], custom_id="bad-top-p")
    bad["body"] = {**bad["body"], "top_p": 2}
    lines.append(bad)
    path = write_jsonl(tmp_path / "in.jsonl", lines)

    api = stack.start_api()
    stack.start_worker("w1", chat_model)
    client = openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0, timeout=120)

    with open(path, "rb") as f:
        file = client.files.create(file=f, purpose="batch")
    assert isinstance(file, FileObject)
    assert file.id.startswith("file-") and file.object == "file"
    assert file.purpose == "batch" and file.bytes == path.stat().st_size
    assert file.filename == "in.jsonl"
    assert client.files.retrieve(file.id) == file
    assert file.id in {f.id for f in client.files.list()}

    batch = client.batches.create(
        input_file_id=file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"run": "openai-client"},
    )
    assert isinstance(batch, Batch)
    assert batch.status == "in_progress" and batch.object == "batch"
    assert batch.input_file_id == file.id and batch.metadata == {"run": "openai-client"}
    assert batch.request_counts is not None and batch.request_counts.total == 25

    done = wait_status(client, batch.id, TERMINAL)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (25, 24)
    assert done.request_counts.failed == 1
    assert done.completed_at is not None and done.in_progress_at is not None
    assert done.output_file_id and done.error_file_id
    assert done.usage is not None and done.usage.input_tokens > 0
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens

    outputs = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    ids = [line["custom_id"] for line in outputs + errors]
    assert sorted(ids) == sorted(line["custom_id"] for line in lines)  # each exactly once
    assert [e["custom_id"] for e in errors] == ["bad-top-p"]
    assert errors[0]["error"]["param"] == "body.top_p"
    for line in outputs:
        assert line["error"] is None
        assert line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == "tiny"
        assert body["choices"][0]["message"]["role"] == "assistant"
    out_meta = client.files.retrieve(done.output_file_id)
    assert isinstance(out_meta, FileObject) and out_meta.purpose == "batch_output"

    # a second batch, cancelled: queued shards are dropped, running ones stop
    while int(time.time()) <= batch.created_at:  # listed strictly after the first
        time.sleep(0.1)
    second_lines = batch_lines(200, prefix="c", max_tokens=16)
    with open(write_jsonl(tmp_path / "second.jsonl", second_lines), "rb") as f:
        second_file = client.files.create(file=f, purpose="batch")
    second = client.batches.create(
        input_file_id=second_file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    cancelled = client.batches.cancel(second.id)
    assert isinstance(cancelled, Batch)
    assert cancelled.status in ("cancelling", "cancelled")
    assert cancelled.cancelling_at is not None
    final = wait_status(client, second.id, TERMINAL)
    assert final.status == "cancelled", final
    assert final.request_counts is not None and final.request_counts.total == 200
    # every request not run gets a `batch_cancelled` error line: each custom_id once in all
    assert final.request_counts.completed + final.request_counts.failed == 200
    assert final.request_counts.completed < 200
    assert final.cancelled_at is not None and final.error_file_id
    skipped = [json.loads(x) for x in client.files.content(final.error_file_id).text.splitlines()]
    assert len(skipped) == final.request_counts.failed
    assert {e["error"]["code"] for e in skipped} == {"batch_cancelled"}
    ran = []
    if final.output_file_id:
        ran = [json.loads(x) for x in client.files.content(final.output_file_id).text.splitlines()]
    ids = sorted(line["custom_id"] for line in ran + skipped)
    assert ids == sorted(line["custom_id"] for line in second_lines)

    # both batches are listed, newest first, and the list pages like OpenAI's
    listed = client.batches.list()
    assert all(isinstance(b, Batch) for b in listed.data)
    assert [b.id for b in listed.data] == [second.id, batch.id]
    page = client.batches.list(limit=1)
    assert [b.id for b in page.data] == [second.id] and page.has_more
    assert [b.id for b in client.batches.list(limit=1)] == [second.id, batch.id]  # auto-paging

    # a finished batch cannot be cancelled; unknown ids are NotFoundError
    with pytest.raises(openai.ConflictError) as err:
        client.batches.cancel(batch.id)
    assert err.value.status_code == 409
    assert err.value.code == "batch_not_cancellable"
    with pytest.raises(openai.NotFoundError) as err:
        client.batches.retrieve("batch_nope")
    assert err.value.code == "not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.batches.create(
            input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h"
        )
    assert err.value.param == "endpoint"

    deleted = client.files.delete(second_file.id)
    assert isinstance(deleted, FileDeleted) and deleted.deleted and deleted.id == second_file.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(second_file.id)


def test_openai_client_sees_a_failed_batch(stack: Stack, tmp_path: Path):
    """Validation errors come back as `Batch.errors` with line numbers (no worker needed)."""
    lines = batch_lines(3)
    lines[2]["custom_id"] = lines[0]["custom_id"]
    path = write_jsonl(tmp_path / "dup.jsonl", [*lines, "not json"])
    client = openai.OpenAI(base_url=stack.start_api() + "/v1", api_key="unused", max_retries=0)
    with open(path, "rb") as f:
        file = client.files.create(file=f, purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.errors is not None and batch.errors.data is not None
    assert [(e.code, e.line) for e in batch.errors.data] == [
        ("duplicate_custom_id", 3),
        ("invalid_json", 4),
    ]
    assert client.batches.retrieve(batch.id) == batch
