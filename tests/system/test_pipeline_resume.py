"""Pipeline restarts: `conveyor submit --resume` and `--idempotency-key` after the client was
killed mid-wait, and the API's `Idempotency-Key` on batch creation."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from conveyor.cli.common import EXIT_ERROR, EXIT_OK
from conveyor.testing import Stack, batch_lines, write_jsonl


def listed(api: str, what: str, **params: str) -> list[dict]:
    """The `data` of GET /v1/<what>, which must answer 200 (else the status and body say
    why)."""
    got = httpx.get(f"{api}/v1/{what}", params=params)
    assert got.status_code == 200, (got.status_code, got.text)
    return got.json()["data"]


def submit(api: str, *args: str | Path) -> list[str]:
    return [sys.executable, "-m", "conveyor", "submit", *map(str, args), "--url", api]


def start_and_kill_mid_wait(argv: list[str]) -> str:
    """Run a waiting submit, read the batch id it prints, and SIGKILL it while it still waits
    (no worker is running, so the batch cannot finish). Returns the batch id."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        batch_id = proc.stdout.readline().strip()
        assert batch_id.startswith("batch_"), proc.stderr.read() if proc.stderr else ""
        time.sleep(1.0)
        assert proc.poll() is None, "the client should still be waiting"
    finally:
        proc.kill()
        proc.wait(10)
    return batch_id


def custom_ids(path: Path) -> list[str]:
    return sorted(json.loads(x)["custom_id"] for x in path.read_text().splitlines())


def test_idempotency_key_reattaches_after_the_client_is_killed(
    stack: Stack, chat_model: Path, tmp_path: Path
) -> None:
    api = stack.start_api()
    lines = batch_lines(12, prefix="nightly")
    source = write_jsonl(tmp_path / "eval.jsonl", lines)
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    argv = submit(
        api, source, "--idempotency-key", "nightly-2026-11-22", "--wait", "--poll", "0.2",
        "-o", out, "--errors", err,
    )  # fmt: skip
    batch_id = start_and_kill_mid_wait(argv)

    stack.start_worker("w1", chat_model)
    rerun = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == EXIT_OK, rerun.stderr
    assert rerun.stdout.strip() == batch_id  # the same batch, not a second one
    assert f"reusing batch {batch_id}" in rerun.stderr
    assert custom_ids(out) == sorted(x["custom_id"] for x in lines)
    assert err.read_text() == ""

    batches = listed(api, "batches")
    assert [b["id"] for b in batches] == [batch_id]
    uploads = [f for f in listed(api, "files") if f["purpose"] == "batch"]
    assert len(uploads) == 1  # the re-run did not upload the file again

    # once more after it finished: attaches, downloads again, submits nothing
    out.unlink()
    again = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert again.returncode == EXIT_OK, again.stderr
    assert again.stdout.strip() == batch_id
    assert custom_ids(out) == sorted(x["custom_id"] for x in lines)
    assert len(listed(api, "batches")) == 1


def test_resume_reattaches_after_the_client_is_killed(
    stack: Stack, chat_model: Path, tmp_path: Path
) -> None:
    api = stack.start_api()
    lines = batch_lines(10, prefix="resume")
    source = write_jsonl(tmp_path / "eval.jsonl", lines)
    out = tmp_path / "out.jsonl"
    batch_id = start_and_kill_mid_wait(submit(api, source, "--wait", "--poll", "0.2", "-o", out))
    assert not out.exists()

    stack.start_worker("w1", chat_model)
    resumed = subprocess.run(
        submit(api, "--resume", batch_id, "--poll", "0.2", "-o", out),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == EXIT_OK, resumed.stderr
    assert resumed.stdout.strip() == batch_id
    assert custom_ids(out) == sorted(x["custom_id"] for x in lines)
    assert len(listed(api, "batches")) == 1

    unknown = subprocess.run(
        submit(api, "--resume", "batch_doesnotexist"), capture_output=True, text=True
    )
    assert unknown.returncode == EXIT_ERROR
    assert "batch_doesnotexist" in unknown.stderr and "404" in unknown.stderr


def test_api_idempotency_key_returns_the_first_batch(stack: Stack, tmp_path: Path) -> None:
    api = stack.start_api()
    source = write_jsonl(tmp_path / "in.jsonl", batch_lines(4))

    def upload() -> str:
        with open(source, "rb") as f:
            files = {"file": ("in.jsonl", f, "application/jsonl")}
            r = httpx.post(f"{api}/v1/files", files=files, data={"purpose": "batch"})
        assert r.status_code == 200, r.text
        return r.json()["id"]

    def create(file_id: str, key: str | None) -> httpx.Response:
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
        headers = {"Idempotency-Key": key} if key else {}
        return httpx.post(f"{api}/v1/batches", json=body, headers=headers, timeout=60)

    first = create(upload(), "k-1")
    assert first.status_code == 200, first.text
    repeat = create(first.json()["input_file_id"], "k-1")  # the same again: the first batch
    assert repeat.status_code == 200
    assert repeat.json()["id"] == first.json()["id"]
    reused = create(upload(), "k-1")  # another file, same key: a conflict naming the file
    assert reused.status_code == 409, reused.text
    assert reused.json()["error"]["code"] == "idempotency_key_reused"
    assert reused.json()["error"]["param"] == "input_file_id"
    other = create(upload(), "k-2")
    assert other.json()["id"] != first.json()["id"]
    plain = [create(upload(), None).json()["id"] for _ in range(2)]
    assert plain[0] != plain[1]  # without a key every create is a new batch

    # racing creates with one key make one batch: the same request gets it every time, and
    # the others (another file each) a conflict
    files = [upload() for _ in range(6)]
    with ThreadPoolExecutor(6) as pool:
        racing = list(pool.map(lambda f: create(f, "k-race"), [files[0]] * 6))
        mixed = list(pool.map(lambda f: create(f, "k-mixed"), files))
    assert {r.status_code for r in racing} == {200}
    assert len({r.json()["id"] for r in racing}) == 1
    assert sorted(r.status_code for r in mixed) == [200] + [409] * 5

    found = listed(api, "batches", idempotency_key="k-race")
    assert [b["id"] for b in found] == [racing[0].json()["id"]]
    assert listed(api, "batches", idempotency_key="none") == []
    assert len(listed(api, "batches")) == 6
    too_long = create(files[0], "x" * 256)
    assert too_long.status_code == 400, too_long.text
    assert "idempotency-key" in too_long.json()["error"]["param"]
