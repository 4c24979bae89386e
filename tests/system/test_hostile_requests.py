"""One request can no longer kill the engine: numbers out of any range are refused where they
enter, each as its own error line (or 400) naming the field, in the embedded layout and in
production; a line that kills the engine anyway is run alone after the first failure and
quarantined after the second, while the other lines of its batch complete."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from conveyor.testing import Stack, download, embedded_serve, submit_batch, wait_for, write_jsonl
from conveyor.worker.runtime import ENGINE_FAILED_EXIT

FAULTY_WORKER = str(Path(__file__).with_name("faulty_worker.py"))
MODEL = "tiny"

# the three single requests that each killed the server, and the field each is refused for:
# past any range at the door, past the model's vocabulary by the worker that serves it
HOSTILE = {
    "top-k": ({"top_k": 10_000_000_000_000_000_000, "temperature": 1}, "body.top_k"),
    "seed": ({"seed": 18446744073709551615, "n": 2, "temperature": 1}, "body.seed"),
    "stop-id": ({"min_tokens": 1, "stop_token_ids": [100000]}, "body.stop_token_ids"),
}
CODES = {
    "top-k": "invalid_request",
    "seed": "invalid_request",
    "stop-id": "invalid_sampling_params",
}


def completion(custom_id: str, **fields) -> dict:
    body = {"model": MODEL, "prompt": f"Hello {custom_id}", "max_tokens": 2, **fields}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def submit(api: str, path: Path, lines: list[dict]) -> str:
    return submit_batch(api, write_jsonl(path, lines), endpoint="/v1/completions")


def hostile_batch() -> list[dict]:
    """Five ordinary lines and the three hostile ones among them."""
    good = [completion(f"good-{i}") for i in range(5)]
    bad = [completion(name, **fields) for name, (fields, _) in HOSTILE.items()]
    return [good[0], bad[0], good[1], good[2], bad[1], good[3], bad[2], good[4]]


def assert_five_answers_and_three_errors(api: str, batch_id: str) -> None:
    batch = wait_for(api, batch_id, timeout=120)
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 8, "completed": 5, "failed": 3, "reused": 0}
    answers = download(api, batch["output_file_id"])
    assert sorted(a["custom_id"] for a in answers) == [f"good-{i}" for i in range(5)]
    errors = {e["custom_id"]: e for e in download(api, batch["error_file_id"])}
    for name, (_, param) in HOSTILE.items():
        error = errors[name]["error"]
        assert error["code"] == CODES[name], error
        assert error["param"] == param, error
        assert errors[name]["response"]["status_code"] == 400


def assert_refused_online(api: str) -> None:
    for name, (fields, param) in HOSTILE.items():
        body = completion(name, **fields)["body"]
        answer = httpx.post(f"{api}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 400, (name, answer.text)
        error = answer.json()["error"]
        assert error["param"] == param.removeprefix("body."), error
        assert error["param"] in error["message"], error
    ok = httpx.post(f"{api}/v1/completions", json=completion("after")["body"], timeout=60)
    assert ok.status_code == 200, ok.text  # the engine lives on


def test_hostile_numbers_fail_alone_in_the_embedded_layout(
    chat_model: Path, tmp_path: Path
) -> None:
    with embedded_serve(tmp_path, chat_model, MODEL) as api:
        assert_refused_online(api)
        batch_id = submit(api, tmp_path / "in.jsonl", hostile_batch())
        assert_five_answers_and_three_errors(api, batch_id)


def test_hostile_numbers_fail_alone_in_production(
    stack: Stack, chat_model: Path, tmp_path: Path
) -> None:
    api = stack.start_api()
    worker = stack.start_worker("w1", str(chat_model), "--served-model-name", MODEL)
    assert_refused_online(api)
    batch_id = submit(api, tmp_path / "in.jsonl", hostile_batch())
    assert_five_answers_and_three_errors(api, batch_id)
    assert worker.poll() is None  # never went down


# ---- a line that kills the engine whatever is checked ----------------------------------------


def poisoned_batch() -> list[dict]:
    lines = [completion(f"c-{i}") for i in range(8)]
    lines[2]["body"]["prompt"] += " KILLS-THE-ENGINE"
    return lines


def assert_only_the_poison_quarantined(api: str, batch_id: str) -> None:
    batch = wait_for(api, batch_id, timeout=180)
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 8, "completed": 7, "failed": 1, "reused": 0}
    (error,) = download(api, batch["error_file_id"])
    assert error["custom_id"] == "c-2"
    assert error["error"]["code"] == "request_quarantined"
    assert "CONVEYOR_MAX_REQUEST_FAILURES=2" in error["error"]["message"]
    assert error["response"]["status_code"] == 500


def test_a_line_that_kills_the_engine_twice_is_quarantined_alone_embedded(
    tmp_path: Path,
) -> None:
    """The embedded service builds a new engine in its own process after each failure."""
    launcher = [FAULTY_WORKER, "--fail-while-in-flight", "KILLS-THE-ENGINE", "--"]
    env = {"CONVEYOR_ECHO_STEP_SECONDS": "0.05", "CONVEYOR_RECONCILE_INTERVAL": "1"}
    with embedded_serve(tmp_path, "echo", MODEL, launcher=launcher, env=env) as api:
        batch_id = submit(api, tmp_path / "in.jsonl", poisoned_batch())
        assert_only_the_poison_quarantined(api, batch_id)
        log = (tmp_path / "serve.log").read_text(errors="replace")
        assert "runs a new engine (restart 2)" in log, log[-3000:]
        assert "restart 3" not in log
        # the service stayed up throughout, and serves the next batch at once
        again = submit(api, tmp_path / "again.jsonl", [completion("next")])
        assert wait_for(api, again, timeout=60)["request_counts"]["completed"] == 1


def test_a_line_that_kills_the_engine_twice_is_quarantined_alone_in_production(
    stack: Stack, tmp_path: Path
) -> None:
    """The worker exits and its supervisor restarts it (compose: unless-stopped); the poisoned
    line's second run is alone, so the innocent lines of its step are never blamed, with
    several shards in flight (tests/system/test_isolation.py has one at a time)."""
    concurrency = "4"
    stack.env["CONVEYOR_ECHO_STEP_SECONDS"] = "0.05"
    api = stack.start_api()
    launcher = [FAULTY_WORKER, "--fail-while-in-flight", "KILLS-THE-ENGINE", "--"]
    args = ("w1", "echo", "--served-model-name", MODEL, "--concurrency", concurrency)
    w1 = stack.start_worker(*args, launcher=launcher)
    batch_id = submit(api, tmp_path / "in.jsonl", poisoned_batch())
    exits = []
    deadline = time.time() + 180
    while httpx.get(f"{api}/v1/batches/{batch_id}", timeout=10).json()["status"] != "completed":
        if w1.poll() is not None:  # the supervisor's restart
            exits.append(w1.returncode)
            w1 = stack.start_worker(*args, launcher=launcher, wait=False)
        assert time.time() < deadline, (exits, stack.log("w1")[-3000:])
        time.sleep(0.2)
    assert exits == [ENGINE_FAILED_EXIT] * 2
    assert_only_the_poison_quarantined(api, batch_id)


def test_online_requests_in_a_failed_engine_are_answered_at_once(tmp_path: Path) -> None:
    """Their client is told to retry (503) when the engine fails under them, not left to wait
    for its timeout; the next request runs on the new engine."""
    launcher = [FAULTY_WORKER, "--fail-while-in-flight", "KILLS-THE-ENGINE", "--"]
    env = {"CONVEYOR_ECHO_STEP_SECONDS": "0.05"}
    with embedded_serve(tmp_path, "echo", MODEL, launcher=launcher, env=env) as api:
        body = completion("x")["body"] | {"prompt": "KILLS-THE-ENGINE"}
        started = time.monotonic()
        answer = httpx.post(f"{api}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "model_unavailable"
        assert "retry" in answer.json()["error"]["message"]
        assert time.monotonic() - started < 10
        deadline = time.monotonic() + 60
        while True:  # the new engine comes up within seconds
            ok = httpx.post(f"{api}/v1/completions", json=completion("y")["body"], timeout=60)
            if ok.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert ok.status_code == 200, ok.text


def test_a_grammar_past_its_time_limit_is_a_400_and_stalls_no_one(
    chat_model: Path, tmp_path: Path
) -> None:
    """Grammars compile off the engine's thread: one that takes longer than --grammar-timeout
    is its request's 400, and a request beside it is answered meanwhile."""
    properties = {f"field_{i}": {"type": "string", "pattern": f"^a{i}[b-z]+$"} for i in range(400)}
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    body = completion("schema")["body"] | {
        "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
    }
    with embedded_serve(tmp_path, chat_model, MODEL, "--grammar-timeout", "0.001") as api:
        answer = httpx.post(f"{api}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["code"] == "invalid_response_format", error
        assert error["param"] == "response_format", error
        assert "grammar_timeout" in error["message"], error
        ok = httpx.post(f"{api}/v1/completions", json=completion("plain")["body"], timeout=60)
        assert ok.status_code == 200, ok.text
