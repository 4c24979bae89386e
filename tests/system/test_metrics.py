"""Prometheus metrics of a worker and of the API, and the Grafana dashboard that reads them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from conveyor.testing import Stack, batch_lines, free_port, submit_batch, wait_for, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "conveyor-dashboard.json"
SYSTEM = "You are a meticulous evaluation assistant. " * 12  # several shared KV blocks


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label items: value}}"""
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def total(samples: dict[str, dict[tuple, float]], name: str) -> float:
    return sum(samples.get(name, {}).values())


def test_worker_and_api_metrics_after_a_shared_prefix_batch(
    stack: Stack, chat_model: Path, tmp_path: Path
) -> None:
    api = stack.start_api()
    port = free_port()
    stack.start_worker("w1", chat_model, "--metrics-port", str(port))
    worker = f"http://127.0.0.1:{port}/metrics"
    before = scrape(worker)
    assert total(before, "conveyor:prefix_cache_hits_total") == 0
    assert total(before, "conveyor:e2e_request_latency_seconds_count") == 0

    n = 24
    lines = batch_lines(n, system=SYSTEM, max_tokens=6)
    batch = wait_for(api, submit_batch(api, write_jsonl(tmp_path / "in.jsonl", lines)))
    assert batch["status"] == "completed"

    after = scrape(worker)
    label = (("model_name", "tiny"),)
    hits = after["conveyor:prefix_cache_hits_total"][label]
    queries = after["conveyor:prefix_cache_queries_total"][label]
    assert 0 < hits < queries  # the shared system prompt came from the cache
    assert hits == batch["usage"]["input_tokens_details"]["cached_tokens"]
    assert after["conveyor:prompt_tokens_total"][label] == queries
    assert after["conveyor:generation_tokens_total"][label] == n * 6
    assert after["conveyor:num_requests_running"][label] == 0
    assert after["conveyor:num_requests_waiting"][label] == 0
    assert 0 <= after["conveyor:kv_cache_usage_perc"][label] <= 1
    # the tiny Llama: K and V of 2 layers x 2 KV heads x 16 dims, in float32 or bfloat16 (the
    # CPU decides)
    per_token = after["conveyor:kv_cache_bytes_per_token"][label]
    assert per_token in (2 * 2 * 2 * 16 * 4, 2 * 2 * 2 * 16 * 2)
    assert after["conveyor:num_preemptions_total"][label] == 0
    for name in (
        "conveyor:time_to_first_token_seconds",
        "conveyor:request_time_per_output_token_seconds",
        "conveyor:e2e_request_latency_seconds",
    ):
        assert after[f"{name}_count"][label] == n, name
        assert after[f"{name}_sum"][label] > 0, name
    ttft = after["conveyor:time_to_first_token_seconds_sum"][label]
    assert ttft <= after["conveyor:e2e_request_latency_seconds_sum"][label]
    assert total(after, "conveyor:result_writer_lag_seconds_count") == n

    # the API's view from the ledger
    api_metrics = scrape(f"{api}/metrics")
    statuses = {dict(k)["status"]: v for k, v in api_metrics["conveyor:batches"].items()}
    assert statuses["completed"] == 1
    assert sum(statuses.values()) == 1
    assert total(api_metrics, "conveyor:queue_depth") == 0

    # a batch no worker serves waits in the queue, and the API says how deep it is
    stack.kill("w1")
    pending = submit_batch(
        api, write_jsonl(tmp_path / "more.jsonl", batch_lines(10, prefix="more"))
    )
    api_metrics = scrape(f"{api}/metrics")
    assert api_metrics["conveyor:queue_depth"][(("model_name", "tiny"),)] == 10
    assert httpx.get(f"{api}/v1/batches/{pending}").json()["status"] == "in_progress"

    # every series the Grafana dashboard plots is one these endpoints export
    exported = set(after) | set(api_metrics)
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 11
    for expr in exprs:
        for name in re.findall(r"conveyor:[a-z0-9_]+", expr):
            assert name in exported, f"the dashboard plots {name}, which nothing exports"
