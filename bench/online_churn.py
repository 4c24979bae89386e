"""A batch while online clients come and go: the same batch runs once quietly and once while
50 clients open streamed completions and hang up after two chunks, in a loop (bounded in count
and time, loopback only). An aborted stream should cost the engine a prefill and a token or
two, so the goal is the batch's throughput within 10% of the quiet run's. Then the abort
latency: from a client's hang-up to its sequence gone from the engine (the worker's
`conveyor:num_requests_running` back to 0, polled every few milliseconds).

The quiet and the busy runs take turns (`--rounds` of each, quiet first), and each side's
throughput is its tokens over its time summed over its runs: a machine whose speed wanders
during the minutes of the bench (a shared host's does) then weighs on both sides alike.

Four ratios are printed: the batch's wall-clock throughput, its throughput over its time in
the worker (first request started to last result written), and that per core-second the
worker process had. The third is what the clients' requests cost the worker: where the API,
the clients, Redis and PostgreSQL cannot all be kept off the worker's cores (PostgreSQL runs
where the system puts it), the first two also count what they took from the worker. The
fourth is the engine's own share of the loss: the same batch on the engine alone, in this
process on the worker's cores once the service is stopped, quietly and with online streams
arriving as fast as the service's clients dropped them, each aborted after as many tokens as a
dropped stream generated there.
Each side also reports `submit_s`, its batches' upload and creation through the API: part of
the wall-clock time, and the part the clients slow most (they load the API's core).

    python bench/online_churn.py                  # 50 clients, a 2048-request batch
    python bench/online_churn.py --clients 20 --requests 256
    python bench/online_churn.py --online-rate-limit 10   # with CONVEYOR_ONLINE_RATE_LIMIT=10
    python bench/online_churn.py --urgent-share 0.025     # with CONVEYOR_URGENT_SHARE=0.025
    python bench/online_churn.py --model bench --requests 512   # the 56M benchmark Llama

Starts its own API and worker on a fresh PostgreSQL database (DATABASE_URL, default the local
server) and a throwaway redis-server. The worker serves `--model`: `tiny` (the default: the
random Llama of the tests, hidden size 64 in two layers, so cheap that what each request costs
besides its tokens weighs most), `bench` (the ~56M-parameter random Llama of `engine_vs_hf` and
`engine_ceiling`, in bfloat16 as checkpoints ship, with a tokenizer of its 32,000 tokens: a
model whose tokens cost the engine more than its bookkeeping does) or a checkpoint's directory.
On a machine of a few cores the worker gets cores of its own (`--worker-cpus`, default the
first half; one torch thread per core) and the API, Redis and the clients the others, as a
GPU worker has its host's cores to itself: otherwise what is measured is the clients and the
API taking the engine's cores, not what the clients' requests cost the engine.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time
from collections import Counter
from dataclasses import fields
from datetime import date
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import sqlalchemy as sa
from machine import cpu_isa, git_state, loadavg, process_cpu_seconds
from prometheus_client.parser import text_string_to_metric_families
from random_llama import BENCH_LLAMA, write_tokenizer
from report import print_result

from conveyor.demo_model import write_tiny_model
from conveyor.engine.config import EngineConfig
from conveyor.engine.sampling_params import SamplingParams
from conveyor.testing import (
    Stack,
    batch_lines,
    free_port,
    service_deployment,
    submit_batch,
    wait_for,
    write_jsonl,
)
from conveyor.worker.online import ONLINE_PRIORITY
from conveyor.worker.runtime import BATCH_PRIORITY

GOAL_RATIO = 0.9
RUNNING = "conveyor:num_requests_running"
ABORTS = "conveyor:online_aborts_total"
PREEMPTIONS = "conveyor:num_preemptions_total"
GENERATED = "conveyor:generation_tokens_total"
URGENT_SHARE = next(f.default for f in fields(EngineConfig) if f.name == "urgent_share")
STREAM_MAX_TOKENS = 500  # what a dropped stream asks for: what it would cost if never aborted
# the worker's metrics, read on one kept-alive connection: a new httpx client a read costs ~20 ms
# (its TLS context), which the abort latencies measured when each read made one (2026-11-30)
SCRAPER = httpx.Client(timeout=10)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model",
        default="tiny",
        help="tiny (default), bench (the 56M benchmark Llama) or a checkpoint's directory",
    )
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument(
        "--chunks", type=int, default=2, help="chunks a client reads before it hangs up"
    )
    ap.add_argument("--requests", type=int, default=2048, help="requests in the batch")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per batch request")
    ap.add_argument(
        "--max-drops", type=int, default=5000, help="hang-ups at most, all clients, a busy run"
    )
    ap.add_argument("--max-seconds", type=float, default=300, help="per run of the batch")
    ap.add_argument("--rounds", type=int, default=2, help="quiet and busy runs, taking turns")
    ap.add_argument("--latency-samples", type=int, default=20)
    ap.add_argument(
        "--online-rate-limit",
        type=float,
        default=0.0,
        help="the service's CONVEYOR_ONLINE_RATE_LIMIT (default 0: none, as configured out of "
        "the box); the clients retry a 429 at once, as a hostile client would",
    )
    ap.add_argument(
        "--urgent-share",
        type=float,
        default=URGENT_SHARE,
        help="the worker's CONVEYOR_URGENT_SHARE: the share of the engine's tokens online "
        f"requests may take while a batch runs (default {URGENT_SHARE}, the engine's own)",
    )
    ap.add_argument(
        "--worker-cpus",
        help="cores of the worker, e.g. 0 or 0-3 (default: the first half of this process's); "
        "'all' shares every core with the API and the clients",
    )
    return ap.parse_args(argv)


def split_cpus(spec: str | None) -> tuple[set[int], set[int]]:
    """(the worker's cores, everyone else's)."""
    mine = sorted(os.sched_getaffinity(0))
    if spec == "all" or len(mine) < 2:
        return set(mine), set(mine)
    if spec is None:
        worker = set(mine[: len(mine) // 2])
    else:
        worker = set()
        for part in spec.split(","):
            low, _, high = part.partition("-")
            worker.update(range(int(low), int(high or low) + 1))
    return worker, set(mine) - worker or worker


def scrape(url: str) -> dict[str, float]:
    """{sample name: value summed over its labels}"""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(SCRAPER.get(url).text):
        for s in family.samples:
            totals[s.name] = totals.get(s.name, 0.0) + s.value
    return totals


def stream_body(tag: str) -> dict:
    prompt = f"Client {tag}: tell a long story about the sea and the ships on it"
    return {"model": "tiny", "prompt": prompt, "max_tokens": STREAM_MAX_TOKENS,
            "ignore_eos": True, "stream": True}  # fmt: skip


class Refused(Exception):
    """The API answered a stream with an error status (429: over the project's limit)."""

    def __init__(self, status: int, retry_after: float) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.retry_after = status, retry_after


def drop_stream(api: str, tag: str, chunks: int = 2) -> float:
    """Opens a streamed completion on a new connection, reads `chunks` events (0: only the
    response's head), hangs up; the time of the hang-up.

    HTTP by hand on a socket: the clients share the API's cores on a small machine, and
    httpx's ~2 ms of CPU a stream (its connection, request and response objects) took a third
    of a core from the API at ~150 hang-ups a second, and slowed the hang-ups themselves
    (twice the tokens generated per dropped stream), where a real client's cost is on its own
    machine."""
    url = urlsplit(api)
    body = json.dumps(stream_body(tag)).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        sock.sendall(head.encode() + body)
        received = b""
        while b"\r\n\r\n" not in received:
            received += _recv(sock)
        lines = received.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        if status != 200:
            headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
            raise Refused(status, float(headers.get("retry-after", 1)))
        while received.count(b"\ndata: ") < chunks:  # each event's line follows a newline
            received += _recv(sock)
        return time.perf_counter()


def _recv(sock: socket.socket) -> bytes:
    data = sock.recv(65536)
    if not data:
        raise ConnectionError("the API closed the stream early")
    return data


class Churn:
    """`clients` threads that drop streams in a loop until stopped or `max_drops` in all."""

    def __init__(self, api: str, clients: int, max_drops: int, chunks: int) -> None:
        self.api, self.max_drops, self.chunks = api, max_drops, chunks
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        self.drops = self.refused = 0
        self.error_kinds: Counter[str] = Counter()  # the errors, counted by what they were
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(clients)]

    def errors(self) -> int:
        return sum(self.error_kinds.values())

    def _client(self, i: int) -> None:
        self._loop(i)

    def _loop(self, i: int) -> None:
        k = 0
        while not self.stopped.is_set():
            with self.lock:
                if self.drops + self.errors() >= self.max_drops:
                    return
            try:
                drop_stream(self.api, f"{i}-{k}", self.chunks)
                with self.lock:
                    self.drops += 1
            except Refused as err:
                with self.lock:
                    if err.status == 429:
                        self.refused += 1
                    else:
                        self.error_kinds[f"HTTP {err.status}"] += 1
            except OSError as err:  # refused, reset or closed early, timed out
                with self.lock:
                    self.error_kinds[str(err) or type(err).__name__] += 1
            k += 1

    def __enter__(self) -> Churn:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopped.set()
        for t in self.threads:
            t.join(timeout=60)


def run_batch(stack: Stack, tag: str, args: argparse.Namespace) -> dict:
    """The batch, submitted and waited for: its wall time and generated tokens per second, and
    the cores the API and the clients (this process) took from the machine meanwhile."""
    cpu = {name: process_cpu_seconds(pid) or 0.0 for name, pid in pids(stack).items()}
    lines = batch_lines(args.requests, prefix=tag, max_tokens=args.max_tokens)
    for line in lines:
        line["body"]["ignore_eos"] = True  # every run generates the same tokens
    path = write_jsonl(stack.root / f"{tag}.jsonl", lines)
    started = time.perf_counter()
    batch_id = submit_batch(stack.api_url, path)
    submitted = time.perf_counter() - started  # the upload and the batch's creation, via the API
    done = wait_for(stack.api_url, batch_id, timeout=args.max_seconds)
    wall = time.perf_counter() - started
    assert done["request_counts"]["completed"] == args.requests, done
    tokens = done["usage"]["output_tokens"]
    cores = {f"{name}_cores": round(((process_cpu_seconds(pid) or 0.0) - cpu[name]) / wall, 2)
             for name, pid in pids(stack).items()}  # fmt: skip
    run = run_seconds(stack, done["id"])
    return {"wall_s": round(wall, 2), "tok_s": round(tokens / wall, 1), "tokens": tokens,
            "submit_s": round(submitted, 2), "run_s": round(run, 2),
            "run_tok_s": round(tokens / run, 1), **cores}  # fmt: skip


def run_seconds(stack: Stack, batch_id: str) -> float:
    """From the batch's first request started in the engine to its last result, in the
    ledger: the batch's time in the worker, without the upload and the polling (which go
    through the API, on the clients' cores here)."""
    engine = sa.create_engine(stack.env["DATABASE_URL"])
    with engine.connect() as conn:
        first = conn.execute(
            sa.text("SELECT min(started_at) FROM requests WHERE batch_id = :b"), {"b": batch_id}
        ).scalar_one()
        last = conn.execute(
            sa.text("SELECT max(created_at) FROM results WHERE batch_id = :b"), {"b": batch_id}
        ).scalar_one()
    engine.dispose()
    return last - first


def pids(stack: Stack) -> dict[str, int]:
    return {"api": stack.named["api"].pid, "worker": stack.named["w1"].pid, "clients": os.getpid()}


def abort_latencies(api: str, metrics: str, samples: int) -> list[float]:
    """Seconds from a hang-up to its sequence leaving the engine, one stream at a time."""
    found = []
    for i in range(samples):
        while True:
            try:
                hung_up = drop_stream(api, f"latency-{i}")
                break
            except Refused as err:  # over the rate limit: wait as told
                if err.status != 429:
                    raise
                time.sleep(err.retry_after)
        while scrape(metrics)[RUNNING] > 0:
            time.sleep(0.002)
        found.append(time.perf_counter() - hung_up)
    return found


def write_model(root: Path, choice: str) -> Path:
    """The checkpoint `--model` names: written under `root` unless it is a directory."""
    if choice == "tiny":
        return write_tiny_model(root / "model", "llama")
    if choice == "bench":
        path = write_tiny_model(root / "model", "llama", dtype="bfloat16", **BENCH_LLAMA)
        # a tokenizer of the model's whole vocabulary: with the tiny one's few hundred tokens,
        # most tokens drawn would have no text, and a stream's first chunk would come late
        write_tokenizer(path, BENCH_LLAMA["vocab_size"])
        return path
    path = Path(choice)
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model: {choice!r} is neither tiny, bench nor a checkpoint directory")
    return path


def measure(stack: Stack, args: argparse.Namespace, worker_cpus: set[int]) -> dict:
    stack.start_api()
    port = free_port()
    model = write_model(stack.root, args.model)
    others = os.sched_getaffinity(0)
    os.sched_setaffinity(0, worker_cpus)  # the worker and its threads start on its cores
    stack.env["OMP_NUM_THREADS"] = str(len(worker_cpus))
    try:
        stack.start_worker("w1", model, "--metrics-port", str(port))
    finally:
        os.sched_setaffinity(0, others)
    metrics = f"http://127.0.0.1:{port}/metrics"
    run_batch(stack, "warm", argparse.Namespace(**{**vars(args), "requests": 32}))
    quiet_runs, busy_runs = [], []
    drops = refused = 0
    error_kinds: Counter[str] = Counter()
    aborts = online_tokens = preempted_quiet = preempted_busy = 0.0
    for i in range(args.rounds):
        before = scrape(metrics)
        quiet_runs.append(run_batch(stack, f"quiet{i}", args))
        between = scrape(metrics)
        with Churn(stack.api_url, args.clients, args.max_drops, args.chunks) as churn:
            busy_runs.append(run_batch(stack, f"churn{i}", args))
        time.sleep(1)  # the last hang-ups reach the worker
        after = scrape(metrics)
        drops, refused = drops + churn.drops, refused + churn.refused
        error_kinds += churn.error_kinds
        aborts += after.get(ABORTS, 0.0) - between.get(ABORTS, 0.0)
        # tokens generated for the dropped streams: what the clients read (two chunks) and
        # what was in flight when the abort came, where without aborts it would be
        # STREAM_MAX_TOKENS
        online_tokens += after[GENERATED] - between[GENERATED] - args.requests * args.max_tokens
        preempted_quiet += between[PREEMPTIONS] - before[PREEMPTIONS]
        preempted_busy += after[PREEMPTIONS] - between[PREEMPTIONS]
    quiet, busy = summed(quiet_runs), summed(busy_runs)
    busy["tokens_per_drop"] = round(online_tokens / max(1, drops), 2)
    quiet["preemptions"], busy["preemptions"] = int(preempted_quiet), int(preempted_busy)
    latencies = abort_latencies(stack.api_url, metrics, args.latency_samples)
    return {"model_dir": model, "quiet": quiet, "churn": busy, "drops": drops,
            "drop_errors": sum(error_kinds.values()),
            "drop_error_kinds": dict(error_kinds),
            "refused": refused, "aborts_counted": int(aborts), "latencies": latencies,
            "quiet_runs_tok_s": [r["tok_s"] for r in quiet_runs],
            "churn_runs_tok_s": [r["tok_s"] for r in busy_runs]}  # fmt: skip


def engine_share(stack: Stack, seen: dict, args: argparse.Namespace, cpus: set[int]) -> dict:
    """`engine_alone` at the service's rate of drops and tokens per drop, the service
    stopped first so that the engine has the worker's cores to itself."""
    stack.stop()
    rate = seen["drops"] / seen["churn"]["wall_s"]
    keep = max(1, round(seen["churn"]["tokens_per_drop"]))
    ratio = engine_alone(seen.pop("model_dir"), args, cpus, rate, keep)
    return {"engine_alone_drops_per_s": round(rate, 1), "engine_alone_tokens_per_drop": keep,
            "engine_alone_ratio": round(ratio, 3)}  # fmt: skip


def engine_alone(
    model: Path, args: argparse.Namespace, cpus: set[int], rate: float, keep: int
) -> float:
    """The ratio of the engine alone: the same batch, in this process on the worker's cores,
    quietly and with online streams arriving at `rate` a second (the service's drops), each
    aborted once it has `keep` tokens (what a dropped stream generated there): what the churn
    costs the engine itself, without the worker's other threads and the API, the clients,
    Redis and PostgreSQL beside it."""
    import torch

    from conveyor import LLM

    others, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))  # as the worker's OMP_NUM_THREADS
    try:
        llm = LLM(str(model), EngineConfig(urgent_share=args.urgent_share))
        llm.warm_up()
        quiet = busy = 0.0
        for i in range(args.rounds):  # taking turns, on lines of their own, as the service's
            quiet += engine_run(llm, prompts(llm, f"quiet{i}", args), args.max_tokens, 0.0, keep)
            churn = prompts(llm, f"churn{i}", args)
            busy += engine_run(llm, churn, args.max_tokens, rate, keep)
    finally:
        os.sched_setaffinity(0, others)
        torch.set_num_threads(threads)
    return quiet / busy


def prompts(llm: Any, tag: str, args: argparse.Namespace) -> list[list[int]]:
    """The prompts of the batch lines of the service's run `tag`, as its worker makes them."""
    lines = batch_lines(args.requests, prefix=tag, max_tokens=args.max_tokens)
    return [llm.apply_chat_template(line["body"]["messages"]) for line in lines]


def engine_run(llm: Any, batch_prompts: list, max_tokens: int, rate: float, keep: int) -> float:
    """Seconds the engine takes to finish the batch while online streams arrive at `rate` a
    second (none at 0), each aborted once it has `keep` tokens."""
    batch = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    online = SamplingParams(max_tokens=STREAM_MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(batch_prompts):
        llm.add_request(f"batch-{i}", prompt, batch, priority=BATCH_PRIORITY)
    left, streams = len(batch_prompts), set()
    started = next_at = time.perf_counter()
    while left:
        while rate and time.perf_counter() >= next_at:
            stream = f"online-{next_at}"
            prompt = stream_body(stream)["prompt"]
            llm.add_request(stream, prompt, online, priority=ONLINE_PRIORITY, stream=True)
            streams.add(stream)
            next_at += 1 / rate
        for out in llm.step():
            if out.request_id not in streams:
                left -= out.finished
            elif len(out.outputs[0].token_ids) >= keep:
                llm.abort(out.request_id)
                streams.discard(out.request_id)
    elapsed = time.perf_counter() - started
    for stream in streams:
        llm.abort(stream)
    return elapsed


def summed(runs: list[dict]) -> dict:
    """One side's runs as one: its tokens over its time, its cores averaged over its time."""
    wall, run = sum(r["wall_s"] for r in runs), sum(r["run_s"] for r in runs)
    tokens = sum(r["tokens"] for r in runs)
    cores = {k: round(sum(r[k] * r["wall_s"] for r in runs) / wall, 2)
             for k in runs[0] if k.endswith("_cores")}  # fmt: skip
    submit = sum(r["submit_s"] for r in runs)
    return {"wall_s": round(wall, 2), "tok_s": round(tokens / wall, 1),
            "submit_s": round(submit, 2), "run_s": round(run, 2),
            "run_tok_s": round(tokens / run, 1), **cores}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    worker_cpus, other_cpus = split_cpus(args.worker_cpus)
    os.sched_setaffinity(0, other_cpus)  # what this process starts runs there too
    env = {"CONVEYOR_SHARD_SIZE": "32", "CONVEYOR_VISIBILITY_TIMEOUT": "600",
           "CONVEYOR_ONLINE_RATE_LIMIT": str(args.online_rate_limit),
           "CONVEYOR_URGENT_SHARE": str(args.urgent_share)}  # fmt: skip
    with service_deployment("churn", **env) as stack:
        seen = measure(stack, args, worker_cpus)
        alone = engine_share(stack, seen, args, worker_cpus)
    ratio = seen["churn"]["tok_s"] / seen["quiet"]["tok_s"]
    run_ratio = seen["churn"]["run_tok_s"] / seen["quiet"]["run_tok_s"]
    # per core-second the worker had: what the clients' requests cost the engine, without what
    # the API, the clients, Redis and PostgreSQL took of the worker's core on a small machine
    engine_ratio = (seen["churn"]["run_tok_s"] / max(seen["churn"]["worker_cores"], 0.01)) / (
        seen["quiet"]["run_tok_s"] / max(seen["quiet"]["worker_cores"], 0.01)
    )
    lat_ms = sorted(x * 1000 for x in seen.pop("latencies"))
    report = {
        "bench": "online_churn",
        "model": args.model,
        "clients": args.clients,
        "chunks_read": args.chunks,
        "online_rate_limit": args.online_rate_limit,
        "urgent_share": args.urgent_share,
        "worker_cpus": sorted(worker_cpus),
        "other_cpus": sorted(other_cpus),
        "batch_requests": args.requests,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        **{f"quiet_{k}": v for k, v in seen.pop("quiet").items()},
        **{f"churn_{k}": v for k, v in seen.pop("churn").items()},
        **seen,
        "ratio_vs_quiet": round(ratio, 3),
        "run_ratio_vs_quiet": round(run_ratio, 3),
        "engine_ratio_vs_quiet": round(engine_ratio, 3),
        **alone,
        "goal_met": ratio >= GOAL_RATIO,
        "abort_latency_ms_p50": round(statistics.median(lat_ms), 1),
        "abort_latency_ms_max": round(lat_ms[-1], 1),
        "loadavg": loadavg(),
        "cpu_isa": cpu_isa(),
        "date": date.today().isoformat(),
        "code": git_state(),
    }
    print(
        f"batch of {args.requests}: {report['quiet_tok_s']} tok/s quiet, "
        f"{report['churn_tok_s']} tok/s while {args.clients} clients dropped "
        f"{report['drops']} streams and were refused {report['refused']} times (ratio {ratio:.3f}, "
        f"goal >= {GOAL_RATIO}; {run_ratio:.3f} counting only the batch's time in the worker, "
        f"{engine_ratio:.3f} per core-second the worker had; the engine alone "
        f"{alone['engine_alone_ratio']:.3f} with {alone['engine_alone_drops_per_s']:.0f} drops "
        f"a second of {alone['engine_alone_tokens_per_drop']} tokens); "
        "abort latency "
        f"p50 {report['abort_latency_ms_p50']} ms, max {report['abort_latency_ms_max']} ms; "
        f"{report['churn_tokens_per_drop']} tokens generated per dropped stream (of "
        f"{STREAM_MAX_TOKENS} asked)"
    )
    print_result(report)
    return report


if __name__ == "__main__":
    main()
