"""An online client that goes away stops its work: its sequences leave the engine within a step
or so and their KV blocks are freed, through Redis (API and worker apart) and in one process
(the embedded `conveyor serve`), streamed or not."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conveyor.testing import Stack, embedded_serve, free_port

MODEL = "tiny"
# far more tokens than the test waits for: only an abort ends these sequences in time
LONG = {"model": MODEL, "max_tokens": 900, "ignore_eos": True, "temperature": 0}
STREAMS = 5


def scrape(url: str) -> dict[str, float]:
    """{sample name with its labels: value}"""
    samples = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def drop_stream(url: str, body: dict) -> None:
    """Opens a streamed completion, reads two chunks, and hangs up."""
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        next(lines), next(lines)


def drop_plain(url: str, body: dict) -> None:
    """A plain completion whose client gives up waiting before the answer."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=1.0))


def wait_until(check, timeout: float, every: float = 0.01) -> float:
    """Seconds until `check()` holds; fails after `timeout`."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, "it did not happen in time"
        time.sleep(every)
    return time.monotonic() - start


def test_dropped_clients_free_their_sequences_through_redis(stack: Stack, chat_model: Path):
    api = stack.start_api()
    port = free_port()
    stack.start_worker("w1", chat_model, "--metrics-port", str(port))
    metrics = f"http://127.0.0.1:{port}/metrics"
    running = "conveyor:num_requests_running{model_name=tiny}"
    usage = "conveyor:kv_cache_usage_perc{model_name=tiny}"

    latencies = []
    for i in range(STREAMS):
        drop_stream(api, {**LONG, "prompt": f"Stream number {i}"})
        latencies.append(wait_until(lambda: scrape(metrics)[running] == 0, timeout=3))
    drop_plain(api, {**LONG, "prompt": ["A plain one", "and its second prompt"], "n": 2})
    latencies.append(wait_until(lambda: scrape(metrics)[running] == 0, timeout=3))

    after = scrape(metrics)
    assert after[usage] == 0  # every KV block is free again
    aborts = after["conveyor:online_aborts_total{model_name=tiny,reason=disconnect}"]
    assert aborts == STREAMS + 1
    generated = "conveyor:generation_tokens_total{model_name=tiny}"
    assert after[generated] < 0.5 * (STREAMS + 4) * LONG["max_tokens"]
    time.sleep(0.5)
    assert scrape(metrics)[generated] == after[generated]  # nothing runs on
    print(f"abort latency, disconnect to sequences freed: max {max(latencies) * 1000:.0f} ms")


def test_dropped_clients_free_their_sequences_in_one_process(
    chat_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("CONVEYOR_HEARTBEAT_INTERVAL", "0.1")  # fresh stats in /v1/workers
    with embedded_serve(tmp_path, chat_model, MODEL) as url:

        def engine() -> dict:
            (worker,) = httpx.get(url + "/v1/workers").json()["data"]
            return worker

        for i in range(STREAMS):
            drop_stream(url, {**LONG, "prompt": f"Stream number {i}"})
        drop_plain(url, {**LONG, "prompt": "A plain one", "n": 3})
        dropped = time.time()

        def idle() -> bool:
            w = engine()
            return w["last_seen"] > dropped and w["in_flight_requests"] == 0

        wait_until(idle, timeout=3, every=0.05)
        state = engine()
        assert state["kv_cache_usage"] == 0
        assert state["generation_tokens"] < 0.5 * (STREAMS + 3) * LONG["max_tokens"]
