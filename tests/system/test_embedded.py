"""Embedded mode: `conveyor serve` with neither DATABASE_URL nor REDIS_URL runs the API and an
in-process worker on SQLite under CONVEYOR_DATA_DIR, serving a demo model as `demo`; `conveyor
submit` drives a batch through it end to end."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conveyor.testing import (
    batch_lines,
    serve_on_free_port,
    stop_group,
    submit_batch,
    wait_for,
    write_jsonl,
)

EXIT_BATCH_FAILED = 3
EXIT_TOO_MANY_FAILED = 6
EXIT_RUNS_DIFFER = 7
SIGTERM_SECONDS = 3.0  # an idle service stops within a second; the rest is room for a slow VM


@contextlib.contextmanager
def serving(python: str, root: Path, env: dict[str, str]) -> Iterator[tuple[str, subprocess.Popen]]:
    """`PYTHON -m conveyor serve` on embedded defaults in `root`; yields its URL and process
    once it serves."""
    log_path = root / "serve.log"
    log_path.write_bytes(b"")

    def launch(port: int) -> subprocess.Popen:
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                [python, "-m", "conveyor", "serve", "--port", str(port)],
                env=env,
                cwd=root,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    proc, port = serve_on_free_port(launch, lambda: log_path.read_text(errors="replace"), 180)
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        stop_group(proc)


def embedded_env(data_dir: Path) -> dict[str, str]:
    """This environment without DATABASE_URL and REDIS_URL, its data under `data_dir`."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    return env | {"CONVEYOR_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """(URL of a running embedded service, the environment it and its clients use)."""
    env = embedded_env(tmp_path / "data")
    with serving(sys.executable, tmp_path, env) as (url, _):
        yield url, env


def submit(url: str, env: dict[str, str], path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "conveyor", "submit", str(path), "--url", url, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def diff(url: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "conveyor", "diff", *args, "--url", url],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_embedded_serve_and_submit(embedded: tuple[str, dict[str, str]], tmp_path: Path):
    url, env = embedded
    lines = batch_lines(12, max_tokens=6)
    lines += batch_lines(4, system="Answer in French.", prefix="fr", max_tokens=4)
    for line in lines:
        del line["body"]["model"]  # `submit --model demo` fills it in
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"

    wait = ("--model", "demo", "--wait", "--poll", "0.3", "-o", str(out), "--errors", str(err))
    done = submit(url, env, path, *wait)
    assert done.returncode == 0, done.stderr
    batch_id = done.stdout.split()[0]
    assert batch_id.startswith("batch_")
    assert "16 completed, 0 failed of 16" in done.stderr
    assert err.read_text() == ""

    outputs = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(o["custom_id"] for o in outputs) == sorted(x["custom_id"] for x in lines)
    for o in outputs:
        assert o["error"] is None and o["response"]["status_code"] == 200, o
        body = o["response"]["body"]
        assert body["model"] == "demo"
        assert 1 <= body["usage"]["completion_tokens"] <= 6
        assert body["choices"][0]["message"]["role"] == "assistant"

    # the ledger and broker are SQLite files under the data directory, and the API says so
    data = tmp_path / "data"
    assert (data / "conveyor.db").is_file() and (data / "broker.db").is_file()
    assert (data / "demo-model" / "config.json").is_file()
    models = {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]}
    assert "demo" in models
    batch = httpx.get(f"{url}/v1/batches/{batch_id}").json()
    assert batch["status"] == "completed" and batch["model"] == "demo"
    assert batch["request_counts"] == {"total": 16, "completed": 16, "failed": 0, "reused": 0}
    # the web page, at the root, and what it reads beside the batches, on the SQLite ledger
    page = httpx.get(url + "/", follow_redirects=True)
    assert page.status_code == 200 and '<script type="module" src="app.js">' in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    series = httpx.get(f"{url}/v1/batches/{batch_id}/throughput").json()
    assert sum(p["requests"] for p in series["data"]) == 16
    # nothing configured that the embedded broker then ignores with a warning
    assert "Ignoring" not in (tmp_path / "serve.log").read_text()
    (worker,) = httpx.get(url + "/v1/workers").json()["data"]
    assert worker["models"] == ["demo"] and worker["device"] == "cpu"
    assert 0 <= worker["kv_cache_usage"] < 1 and worker["running_shards"] == 0
    assert worker["fingerprint"].startswith("fp-")
    (model,) = [m for m in httpx.get(url + "/v1/models").json()["data"] if m["id"] == "demo"]
    assert model["fingerprints"] == [worker["fingerprint"]]
    (run,) = httpx.get(f"{url}/v1/batches/{batch_id}").json()["reproducibility"]
    assert (run["worker"], run["fingerprint"]) == (worker["id"], worker["fingerprint"])
    assert run["engine"]["plan"]["device"] == "cpu" and run["conveyor"]

    # with --reuse, the same greedy lines are answered from the first run's results, exactly;
    # a sampled line without a seed is computed
    sampled = {**lines[0], "custom_id": "sampled",
               "body": {**lines[0]["body"], "temperature": 1.0}}  # fmt: skip
    reuse_path = write_jsonl(tmp_path / "reuse.jsonl", [*lines, sampled])
    reused_out = tmp_path / "reused.jsonl"
    again = submit(url, env, reuse_path, "--model", "demo", "--wait", "--poll", "0.3",
                   "-o", str(reused_out), "--reuse")  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "17 completed (16 reused), 0 failed of 17" in again.stderr, again.stderr
    reused = {o["custom_id"]: o for o in map(json.loads, reused_out.read_text().splitlines())}
    first = {o["custom_id"]: o for o in outputs}
    for custom_id, line in first.items():
        assert reused[custom_id]["reused_from"]["batch_id"] == batch_id
        assert reused[custom_id]["reused_from"]["line_id"] == line["id"]
        assert reused[custom_id]["response"]["body"] == line["response"]["body"]
    assert "reused_from" not in reused["sampled"]
    counts = httpx.get(f"{url}/v1/batches/{again.stdout.split()[0]}").json()["request_counts"]
    assert counts == {"total": 17, "completed": 17, "failed": 0, "reused": 16}

    # the same lines again answer the same; an edited and an added line are what `diff` names
    again = submit(url, env, path, *wait)
    assert again.returncode == 0, again.stderr
    same = diff(url, env, batch_id, again.stdout.split()[0])
    assert same.returncode == 0 and "16 lines the same, 0 changed" in same.stdout, same.stdout
    assert "what ran them: the same model fingerprint" in same.stdout, same.stdout
    from_file = diff(url, env, str(out), batch_id)  # a results file of the rerun, kept locally
    assert from_file.returncode == 0, from_file.stdout + from_file.stderr
    assert "what ran them: the same" in from_file.stdout  # from out.jsonl.meta.json
    bare = tmp_path / "bare.jsonl"  # the lines without the record of what ran them
    bare.write_text(out.read_text())
    unknown = diff(url, env, str(bare), batch_id)
    assert unknown.returncode == 0, unknown.stdout + unknown.stderr
    assert "what ran them: not known for A (no bare.jsonl.meta.json beside it)" in unknown.stdout
    # a record that says another engine ran it is named, with the answers still the same
    record = json.loads((tmp_path / "out.jsonl.meta.json").read_text())
    record["reproducibility"][0]["engine"]["block_size"] = 1024
    (tmp_path / "bare.jsonl.meta.json").write_text(json.dumps(record))
    other_engine = diff(url, env, str(bare), batch_id, "--json")
    assert other_engine.returncode == 0, other_engine.stdout + other_engine.stderr
    (change,) = json.loads(other_engine.stdout)["what_ran_changed"]
    assert change["name"] == "engine.block_size" and change["before"] == [1024]
    edited = [*lines[:15], *batch_lines(2, prefix="edit", max_tokens=6)]
    edited[0] = {**lines[0], "body": {**lines[0]["body"], "max_tokens": 1}}
    for line in edited[15:]:
        del line["body"]["model"]
    other = submit(url, env, write_jsonl(tmp_path / "edited.jsonl", edited), *wait)
    changed = diff(url, env, batch_id, other.stdout.split()[0], "--json")
    assert changed.returncode == EXIT_RUNS_DIFFER, changed.stderr
    report = json.loads(changed.stdout)
    assert [c["custom_id"] for c in report["changed"]] == [lines[0]["custom_id"]]
    assert report["new"] == ["edit-0", "edit-1"] and report["gone"] == [lines[15]["custom_id"]]
    assert report["same"] == 14
    # the same through the API (the web page's and a pipeline's way)
    other_id = other.stdout.split()[0]
    served = httpx.get(f"{url}/v1/batches/{other_id}/diff", params={"against": batch_id}).json()
    assert served["differs"] and served["same"] == 14 and served["new"] == ["edit-0", "edit-1"]
    assert served["changed"] == report["changed"]
    assert served["what_ran_changed"] == report["what_ran_changed"] == []

    # a line that fails alone lands in --errors; with --max-failed 1 that is still success
    bad = [*lines[:3], {**lines[3], "body": {**lines[3]["body"], "temperature": -1}}]
    bad_path = write_jsonl(tmp_path / "bad.jsonl", bad)
    done = submit(url, env, bad_path, *wait)
    assert done.returncode == EXIT_TOO_MANY_FAILED, done.stderr  # over --max-failed 0
    done = submit(url, env, bad_path, *wait, "--max-failed", "1")
    assert done.returncode == 0, done.stderr
    assert sorted(json.loads(x)["custom_id"] for x in out.read_text().splitlines()) == [
        x["custom_id"] for x in lines[:3]
    ]
    errors = [json.loads(x) for x in err.read_text().splitlines()]
    assert [(e["custom_id"], e["error"]["line"]) for e in errors] == [(lines[3]["custom_id"], 4)]
    batch_id = done.stdout.split()[0]
    groups = httpx.get(f"{url}/v1/batches/{batch_id}/error_groups").json()["data"]
    assert [(g["code"], g["count"], g["examples"][0]["custom_id"]) for g in groups] == [
        (errors[0]["error"]["code"], 1, lines[3]["custom_id"])
    ]

    # a file that fails validation: exit code 3 and the line named on stderr
    dup = write_jsonl(tmp_path / "dup.jsonl", [lines[0], lines[1], lines[0]])
    done = submit(url, env, dup, "--model", "demo", "--wait")
    assert done.returncode == EXIT_BATCH_FAILED, done.stderr
    assert "line 3: duplicate_custom_id" in done.stderr


def test_sigterm_stops_an_idle_serve_at_once_keeping_its_work(tmp_path: Path) -> None:
    """SIGTERM (`docker stop`, a supervisor) to an idle `conveyor serve` ends it with exit 0
    within a second or so, where Celery's poll of the SQLite broker and the interpreter's
    teardown of the model took 4-6 s; its batch stays done and its worker is withdrawn."""
    env = embedded_env(tmp_path / "data")
    path = write_jsonl(tmp_path / "in.jsonl", batch_lines(2, model="demo", max_tokens=4))
    with serving(sys.executable, tmp_path, env) as (url, proc):
        batch_id = submit_batch(url, path)
        assert wait_for(url, batch_id, timeout=120)["status"] == "completed"
        (first,) = httpx.get(url + "/v1/workers").json()["data"]
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        took = time.monotonic() - started
    log = (tmp_path / "serve.log").read_text(errors="replace")
    assert proc.returncode == 0, log[-3000:]
    assert took < SIGTERM_SECONDS, f"serve took {took:.1f} s to stop after SIGTERM"

    with serving(sys.executable, tmp_path, env) as (url, _):
        batch = httpx.get(f"{url}/v1/batches/{batch_id}").json()
        assert batch["status"] == "completed"
        assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0, "reused": 0}
        output = httpx.get(f"{url}/v1/files/{batch['output_file_id']}/content").text
        assert len(output.splitlines()) == 2
        (worker,) = httpx.get(url + "/v1/workers").json()["data"]  # the first one withdrew
        assert worker["id"] != first["id"]


@pytest.mark.parametrize("layout", ["embedded", "service"])
def test_serve_refuses_a_port_in_use_at_once(
    layout: str, tmp_path: Path, database_url: str, redis_url: str
) -> None:
    """A port another server listens on: `conveyor serve` says so and exits 1 before loading
    anything (in the embedded layout its worker used to run on without an API, the API's
    thread having ended quietly)."""
    env = embedded_env(tmp_path / "data")
    if layout == "service":
        env |= {"DATABASE_URL": database_url, "REDIS_URL": redis_url}
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "conveyor", "serve", "--port", str(port)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"serve: error: cannot listen on 127.0.0.1:{port}: Address already in use" in (
        done.stderr
    )
    assert not (tmp_path / "data").exists()  # nothing made: no ledger, no demo model
