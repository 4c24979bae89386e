"""A worker's Prometheus metrics, named as vLLM names the same things (`vllm:` -> `conveyor:`).

Engine counters and gauges are read from the engine's own stats at scrape time; request
latencies are observed as each request finishes; the result writer reports how long rows wait
before they are committed; the online server counts the requests it aborts.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from conveyor.engine.outputs import RequestOutput
from conveyor.engine.protocol import Engine

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

# one per process, as the online server is: counted from its threads, served by the registry of
# the process's worker
ONLINE_ABORTS = Counter(
    "conveyor:online_aborts",
    "Online requests stopped in the engine before they finished: their client went away "
    "(reason=disconnect) or their deadline passed (reason=deadline).",
    ["model_name", "reason"],
    registry=None,
)


class EngineCollector(Collector):
    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()

        def get(name: str) -> float:  # the echo engine has only some of the stats
            return getattr(stats, name, 0)

        total, used = get("kv_blocks_total"), get("kv_blocks_used")
        computed, cached = get("prompt_tokens_computed"), get("prompt_tokens_cached")
        gauges = [
            ("conveyor:num_requests_running", "Requests in the running batch.",
             get("num_running")),
            ("conveyor:num_requests_waiting", "Requests waiting to be admitted.",
             get("num_waiting")),
            ("conveyor:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).",
             used / total if total else 0.0),
            ("conveyor:kv_cache_bytes_per_token",
             "KV cache bytes one more token of a long context takes (global layers only where "
             "sliding-window layers give theirs back).",
             get("kv_bytes_per_token")),
        ]  # fmt: skip
        counters = [
            ("conveyor:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             computed + cached),
            ("conveyor:prefix_cache_hits", "Prompt tokens served from the prefix cache.", cached),
            ("conveyor:num_preemptions", "Sequences preempted (KV freed, recomputed later).",
             get("num_preemptions")),
            ("conveyor:prompt_tokens", "Prompt tokens of admitted requests, computed or cached.",
             computed + cached),
            ("conveyor:generation_tokens", "Tokens generated.", get("generation_tokens")),
        ]  # fmt: skip
        for kind, rows in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, doc, value in rows:
                family = kind(name, doc, labels=["model_name"])
                family.add_metric([self.model_name], value)
                yield family


class WorkerMetrics:
    """The worker's registry: engine state plus latency histograms fed by the runtime."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.engine_collector = EngineCollector(engine, model_name)
        self.registry.register(self.engine_collector)
        self.registry.register(ONLINE_ABORTS)
        labels = ["model_name"]
        self.ttft = Histogram(
            "conveyor:time_to_first_token_seconds",
            "Time from a request's arrival in the engine to its first output token.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "conveyor:request_time_per_output_token_seconds",
            "A request's mean time between output tokens (inter-token latency).",
            labels,
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "conveyor:e2e_request_latency_seconds",
            "Time from a request's arrival in the engine to its finish.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.writer_lag = Histogram(
            "conveyor:result_writer_lag_seconds",
            "Time from a request's finish to the commit of its result row.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def use_engine(self, engine: Engine) -> None:
        """Read the engine's stats from `engine` from now on (a new one after a failure)."""
        self.engine_collector.engine = engine

    def observe_request(self, output: RequestOutput) -> None:
        metrics = output.metrics
        if metrics is None:
            return
        model = self.model_name
        if (ttft := metrics.time_to_first_token) is not None:
            self.ttft.labels(model).observe(ttft)
        if (e2e := metrics.e2e_latency) is not None:
            self.e2e.labels(model).observe(e2e)
        tokens = max((len(c.token_ids) for c in output.outputs), default=0)
        if tokens > 1 and metrics.first_token_time is not None and metrics.finished_time:
            self.tpot.labels(model).observe(
                (metrics.finished_time - metrics.first_token_time) / (tokens - 1)
            )

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """`/metrics` on `port` from a daemon thread."""
        start_http_server(port, addr=host, registry=self.registry)
