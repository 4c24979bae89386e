"""Hypothesis against the running service with a real model: thousands of completion and chat
bodies with numbers of every size in them, online (streamed or not; eight clients at once, so
that hostile requests share the engine's steps with others) and then all together as one
batch. The bar: no 5xx, every refusal a 4xx naming a field, no internal_error line, and no
engine death (the service's one engine is never rebuilt)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from conveyor.testing import download, embedded_serve, submit_batch, wait_for
from tests.request_strategies import CHATS, COMPLETIONS

MODEL = "tiny"
ONLINE_CASES = 1200  # completions; chats a third of that; then the completions as a batch
CLIENTS = 8  # requests in flight at once, as many as the engine's batch takes
ENGINE = ("--max-model-len", "64", "--max-num-seqs", str(CLIENTS))


def body_of(url: str, fields: dict, stream: bool) -> dict:
    body = {"model": MODEL, **fields}
    if url.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    if stream:
        body["stream"] = True
    return body


def assert_answered_or_refused(answer: httpx.Response, body: dict) -> bool:
    """True for an answer, False for a refusal."""
    assert answer.status_code < 500, (answer.status_code, answer.text, body)
    if answer.status_code >= 400:
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error", error
        assert error["param"] or answer.status_code == 429, (error, body)
        return False
    if body.get("stream"):  # an error after the stream began is one more event
        assert answer.text.rstrip().endswith("data: [DONE]"), answer.text[-300:]
        assert "server_error" not in answer.text, answer.text[-500:]
    return True


def fuzz(
    client: httpx.Client, url: str, strategy: st.SearchStrategy, cases: int, sent: list
) -> None:
    """`cases` bodies drawn from `strategy`, each sent to `url` (and kept in `sent`), up to
    CLIENTS at a time: the engine's steps mix them as they mix any clients' requests."""
    drawn: list[dict] = []

    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate],
    )
    @given(fields=strategy, stream=st.booleans())
    def draw(fields: dict, stream: bool) -> None:
        drawn.append(body_of(url, fields, stream))

    draw()

    def send(body: dict) -> tuple[str, dict, bool]:
        answered = assert_answered_or_refused(client.post(url, json=body), body)
        return url, {k: v for k, v in body.items() if k != "stream"}, answered

    with ThreadPoolExecutor(CLIENTS) as pool:
        sent.extend(pool.map(send, drawn))


def test_hostile_numbers_never_reach_a_5xx_or_kill_the_engine(
    chat_model: Path, tmp_path: Path
) -> None:
    sent: list[tuple[str, dict]] = []
    with (
        embedded_serve(tmp_path, chat_model, MODEL, *ENGINE) as api,
        httpx.Client(base_url=api, timeout=120) as client,
    ):
        fuzz(client, "/v1/completions", COMPLETIONS, ONLINE_CASES, sent)
        fuzz(client, "/v1/chat/completions", CHATS, ONLINE_CASES // 3, sent)
        answered = sum(ok for _, _, ok in sent)
        print(f"{len(sent)} online cases, {answered} answered")
        assert len(sent) >= ONLINE_CASES and answered >= len(sent) // 5

        # the same bodies as batch lines, every one in the engine's continuous batches at once
        completions = [b for url, b, _ in sent if url == "/v1/completions"]
        lines = [
            {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body}
            for i, body in enumerate(completions)
        ]
        path = tmp_path / "fuzz.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        batch_id = submit_batch(api, path, endpoint="/v1/completions")
        batch = wait_for(api, batch_id, timeout=600)
        assert batch["status"] == "completed", batch
        counts = batch["request_counts"]
        assert counts["total"] == len(lines) and counts["completed"] > 0, counts
        errors = download(api, batch["error_file_id"])
        assert len(errors) == counts["failed"]
        for line in errors:
            assert line["error"]["code"] != "internal_error", line
            assert line["response"]["status_code"] < 500, line
            assert line["error"]["param"], line
        assert client.get("/readyz").status_code == 200
    log = (tmp_path / "serve.log").read_text(errors="replace")
    assert "the engine failed" not in log and "new engine" not in log, log[-3000:]
    assert "Traceback" not in log, log[log.index("Traceback") - 500 :][:4000]
