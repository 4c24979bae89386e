"""The job service end to end: real PostgreSQL and Redis, API and worker processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import sqlalchemy as sa

from conveyor.settings import normalize_database_url
from conveyor.testing import Stack, batch_lines, download, wait_for, write_jsonl


def submit(api: str, path: Path, endpoint: str = "/v1/chat/completions") -> dict:
    with open(path, "rb") as f:
        r = httpx.post(
            f"{api}/v1/files", files={"file": (path.name, f)}, data={"purpose": "batch"}, timeout=60
        )
    assert r.status_code == 200, r.text
    r = httpx.post(
        f"{api}/v1/batches",
        json={"input_file_id": r.json()["id"], "endpoint": endpoint, "completion_window": "24h"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def run_batch_offline(model: Path, path: Path, tmp: Path) -> dict[str, dict]:
    out = tmp / "offline.jsonl"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "conveyor",
            "run-batch",
            "-i",
            str(path),
            "-o",
            str(out),
            "--model",
            str(model),
            "--served-model-name",
            "tiny",
            "--no-progress",
            "--dtype",
            "float32",  # as the service's workers in the tests (tests/conftest.py)
        ],
        check=True,
        capture_output=True,
    )
    return {line["custom_id"]: line for line in map(json.loads, out.read_text().splitlines())}


def test_round_trip_matches_run_batch(stack: Stack, chat_model: Path, tmp_path: Path):
    lines = batch_lines(40, system="You are a careful assistant.", max_tokens=12)
    lines += batch_lines(20, system="Answer in French.", prefix="fr", max_tokens=6)
    bad = dict(lines[3])
    bad["custom_id"] = "bad-temperature"
    bad["body"] = {**bad["body"], "temperature": -1}
    lines.append(bad)
    path = write_jsonl(tmp_path / "in.jsonl", lines)

    api = stack.start_api()
    stack.start_worker("w1", chat_model)
    batch = submit(api, path)
    assert batch["status"] == "in_progress"
    assert batch["request_counts"]["total"] == 61
    done = wait_for(api, batch["id"])
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 61, "completed": 60, "failed": 1, "reused": 0}
    assert done["progress"] == 1.0
    outputs, errors = download(api, done["output_file_id"]), download(api, done["error_file_id"])
    ids = [line["custom_id"] for line in outputs + errors]
    assert sorted(ids) == sorted(line["custom_id"] for line in lines)  # each exactly once
    assert [e["custom_id"] for e in errors] == ["bad-temperature"]
    assert errors[0]["error"]["param"] == "body.temperature"

    offline = run_batch_offline(chat_model, path, tmp_path)
    usage_in = 0
    for line in outputs:
        body, ref = line["response"]["body"], offline[line["custom_id"]]["response"]["body"]
        assert body["choices"][0]["message"] == ref["choices"][0]["message"], line["custom_id"]
        assert body["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
        assert body["model"] == "tiny"
        usage_in += body["usage"]["prompt_tokens"]
    assert done["usage"]["input_tokens"] == usage_in
    assert done["usage"]["input_tokens_details"]["cached_tokens"] > 0  # shared system prompts
    assert done["cached_tokens"] == done["usage"]["input_tokens_details"]["cached_tokens"]

    # the results stream pages with ?after=
    first = httpx.get(f"{api}/v1/batches/{batch['id']}/results", params={"limit": 10}).text
    first_lines = [json.loads(x) for x in first.splitlines()]
    assert len(first_lines) == 10
    rest = httpx.get(
        f"{api}/v1/batches/{batch['id']}/results", params={"after": first_lines[-1]["id"]}
    ).text.splitlines()
    assert len(rest) == 51
    assert {x["custom_id"] for x in first_lines}.isdisjoint(
        json.loads(x)["custom_id"] for x in rest
    )


def test_models_lists_live_workers(stack: Stack, chat_model: Path):
    api = stack.start_api()
    assert httpx.get(f"{api}/v1/models").json()["data"] == []
    stack.start_worker("w1", chat_model)
    deadline = time.time() + 30
    while time.time() < deadline:
        ids = {m["id"] for m in httpx.get(f"{api}/v1/models").json()["data"]}
        if "tiny" in ids:
            break
        time.sleep(0.3)
    assert ids == {"tiny"}  # the served name; the worker's path is nobody's business
    ready = httpx.get(f"{api}/readyz")
    assert ready.status_code == 200 and ready.json()["checks"] == {"database": "ok", "broker": "ok"}


def ledger_engine(stack: Stack) -> sa.Engine:
    return sa.create_engine(normalize_database_url(stack.env["DATABASE_URL"]))
