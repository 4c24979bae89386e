"""Service limits: each exceeded limit is a clear 4xx or a per-line error, found before any
work starts, and the rest of the work goes on."""

from __future__ import annotations

from pathlib import Path

import httpx

from conveyor.testing import Stack, batch_lines, download, wait_for, write_jsonl


def upload(api: str, path: Path) -> httpx.Response:
    with open(path, "rb") as f:
        return httpx.post(
            f"{api}/v1/files", files={"file": (path.name, f)}, data={"purpose": "batch"}
        )


def create(api: str, file_id: str) -> httpx.Response:
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    return httpx.post(f"{api}/v1/batches", json=body, timeout=60)


def test_limits(stack: Stack, chat_model: Path, tmp_path: Path) -> None:
    stack.env.update(
        CONVEYOR_MAX_TOKENS="8",
        CONVEYOR_MAX_BATCHES_IN_FLIGHT="2",
        CONVEYOR_MAX_UPLOAD_BYTES="4096",
        CONVEYOR_MAX_BATCH_LINES="5",
        CONVEYOR_MAX_LINE_BYTES="1000",
    )
    api = stack.start_api()

    # upload size: 413 before anything is stored
    big = write_jsonl(tmp_path / "big.jsonl", batch_lines(40))
    assert big.stat().st_size > 4096
    r = upload(api, big)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "file_too_large" and "4096" in r.json()["error"]["message"]
    assert httpx.get(f"{api}/v1/files").json()["data"] == []

    # lines per batch and line size: 413 at upload, naming the limit and the line
    r = upload(api, write_jsonl(tmp_path / "many.jsonl", batch_lines(6)))
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "too_many_lines"
    assert "at most 5 lines" in r.json()["error"]["message"]
    long = batch_lines(3)
    long[1]["body"]["messages"][-1]["content"] = "x" * 1000
    r = upload(api, write_jsonl(tmp_path / "long.jsonl", long))
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "line_too_large"
    assert "line 2 " in r.json()["error"]["message"] and "1000" in r.json()["error"]["message"]
    assert httpx.get(f"{api}/v1/files").json()["data"] == []

    # batches in flight per project: the third unfinished one is a 429 until one ends
    lines = batch_lines(3)
    lines[0]["body"]["max_tokens"] = 50  # over the cap of 8
    del lines[1]["body"]["max_tokens"]  # no max_tokens: the cap applies
    file_id = upload(api, write_jsonl(tmp_path / "in.jsonl", lines)).json()["id"]
    first, second = (create(api, file_id).json() for _ in range(2))
    assert first["status"] == second["status"] == "in_progress"
    refused = create(api, file_id)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert (
        error["code"] == "too_many_batches" and "CONVEYOR_MAX_BATCHES_IN_FLIGHT" in error["message"]
    )
    assert len(httpx.get(f"{api}/v1/batches").json()["data"]) == 2  # nothing was made
    httpx.post(f"{api}/v1/batches/{second['id']}/cancel").raise_for_status()
    wait_for(api, second["id"], statuses=("cancelled",), timeout=30)
    assert create(api, file_id).status_code == 200

    # max_tokens: a line over the cap fails alone (422 in the error file); the others run,
    # and one that does not say gets the cap
    stack.start_worker("w1", chat_model)
    batch = wait_for(api, first["id"], statuses=("completed",), timeout=180)
    errors = download(api, batch["error_file_id"])
    assert batch["request_counts"] == {"total": 3, "completed": 2, "failed": 1, "reused": 0}, errors
    assert [e["custom_id"] for e in errors] == ["q-0"]
    assert errors[0]["response"]["status_code"] == 422
    body = errors[0]["response"]["body"]["error"]
    assert body["code"] == "max_tokens_too_large" and "limit of 8" in body["message"]
    outputs = download(api, batch["output_file_id"])
    usage = {o["custom_id"]: o["response"]["body"]["usage"]["completion_tokens"] for o in outputs}
    assert set(usage) == {"q-1", "q-2"}
    assert all(0 < n <= 8 for n in usage.values()), usage
