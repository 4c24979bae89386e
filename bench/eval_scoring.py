"""Scoring an MMLU-shaped evaluation: loglikelihood requests that share a long few-shot prefix,
with prefix caching on against caching off, and through the whole service.

The job: one 5-shot prefix of ~700 tokens, then `--questions` questions of 40-60 tokens, each
followed by each of 4 answer choices of 1-6 tokens (random token ids from a fixed seed). Every
request asks what lm-eval's loglikelihood asks a completions server: the prompt's logprobs with
the top alternative (`prompt_logprobs=1`) and one generated token. The model is the benchmarks'
random-weight ~56M-parameter Llama, in float32 so that logprobs can be compared exactly.

Runs, in one process with the same torch thread count:

  1. the engine, prefix caching on, every request;
  2. the engine, prefix caching off, on the first `--baseline-requests` requests (it computes
     every prefix again, so on a small CPU a subset); rates (requests per second) compare;
  3. with --service: the whole service (API, a worker on the same model, PostgreSQL, Redis) as
     one batch of completions lines (prompt as token ids, `echo`, `logprobs: 1`), then as online
     `POST /v1/completions` requests from 16 clients, each on a fresh worker.

Checked: the prompt logprobs of runs 1, 2 and 3 are equal (within 1e-5 of
max(1, |logprob|), float32 rounding) on every request they
share. Goals: >= 90% of prompt tokens from the cache and >= 4x the rate of caching off.

    python bench/eval_scoring.py                   # 1,000 requests (250 questions), engine only
    python bench/eval_scoring.py --service         # and through the service, batch and online
    python bench/eval_scoring.py --quick           # smoke run: 40 requests

The last line printed is one JSON object with the headline numbers.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from random_llama import BenchModel, add_model_arguments, add_run_arguments, set_up
from report import print_result, rule, table

from conveyor.engine import LLM, SamplingParams
from conveyor.settings import normalize_database_url
from conveyor.testing import Stack, download, service_env, submit_batch, wait_for, write_jsonl
from conveyor.testing.databases import migrate, random_redis_database, scratch_database
from conveyor.testing.servers import postgres_server, redis_server

GOAL_CACHED = 0.90
GOAL_VS_OFF = 4.0
TOLERANCE = 1e-5
CHOICES = 4
MODEL_NAME = "bench"
ONLINE_CLIENTS = 16

# ---------------------------------------------------------------------------------------------
# the job


@dataclass
class Job:
    prompts: list[list[int]]  # prefix + question + choice, question by question
    prefix_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_job(questions: int, prefix_tokens: int, vocab: int, seed: int) -> Job:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]  # no special ids

    prefix = tokens(prefix_tokens)
    prompts = []
    for _ in range(questions):
        question = tokens(rng.randint(40, 60))
        prompts += [prefix + question + tokens(rng.randint(1, 6)) for _ in range(CHOICES)]
    return Job(prompts, prefix_tokens)


PARAMS = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)

# ---------------------------------------------------------------------------------------------
# the engine


@dataclass
class ScoringRun:
    """One way of scoring the job (the engine, a batch, online requests): its time, what it
    scored and what it found cached."""

    seconds: float
    requests: int
    prompt_tokens: int
    cached_tokens: int
    logprobs: list[list[float]]  # each request's prompt logprobs of its own tokens

    @property
    def rate(self) -> float:
        return self.requests / self.seconds

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens


def engine(args: argparse.Namespace, m: BenchModel, caching: bool) -> LLM:
    return LLM(
        str(m.path),
        device="cpu",
        dtype="float32",
        enable_prefix_caching=caching,
        attention_backend=args.attention_backend,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
    )


def own_logprobs(prompt: list[int], entries: list) -> list[float]:
    return [entry[token] for token, entry in zip(prompt[1:], entries[1:], strict=True)]


def score_in_process(llm: LLM, prompts: list[list[int]], warm: list[list[int]]) -> ScoringRun:
    llm.generate(warm, PARAMS, use_tqdm=False)  # the one compile, before timing
    before = llm.stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.stats()
    computed = after.prompt_tokens_computed - before.prompt_tokens_computed
    cached = after.prompt_tokens_cached - before.prompt_tokens_cached
    return ScoringRun(
        seconds,
        len(prompts),
        computed + cached,
        cached,
        [own_logprobs(p, o.prompt_logprobs) for p, o in zip(prompts, outputs, strict=True)],
    )


def warm_up_prompts(vocab: int) -> list[list[int]]:
    """A few prompts unlike the job's (nothing of them is cached for it), to compile."""
    rng = random.Random(-1)
    return [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(2)]


def max_difference(a: list[list[float]], b: list[list[float]]) -> tuple[float, float]:
    """The largest absolute difference, and the largest relative to max(1, |logprob|): float32
    keeps about 7 digits, so a logprob near -10 is only known to ~1e-6 and one computed in a
    batch of another shape (different summation order) differs by a few times that."""
    pairs = [(x, y) for ra, rb in zip(a, b, strict=False) for x, y in zip(ra, rb, strict=True)]
    absolute = max((abs(x - y) for x, y in pairs), default=0.0)
    relative = max((abs(x - y) / max(1.0, abs(y)) for x, y in pairs), default=0.0)
    return absolute, relative


# ---------------------------------------------------------------------------------------------
# the service


def body(prompt: list[int]) -> dict:
    """What lm-eval's local-completions sends to score one prompt."""
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "echo": True,
    }


def prompt_logprobs_of(answer: dict, prompt: list[int]) -> list[float]:
    values = answer["choices"][0]["logprobs"]["token_logprobs"]
    return values[1 : len(prompt)]


@contextmanager
def deployment(args: argparse.Namespace, m: BenchModel) -> Iterator[tuple[Stack, str]]:
    """An API on a scratch database and a Redis database, torn down at exit."""
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-scoring-"))
    with ExitStack() as on_exit:
        server = on_exit.enter_context(postgres_server())
        redis_url = random_redis_database(on_exit.enter_context(redis_server()))
        db_url = on_exit.enter_context(scratch_database(server, "conveyor_bench_"))
        migrate(db_url)
        stack = Stack(env=service_env(normalize_database_url(db_url), redis_url, root), root=root)
        on_exit.callback(stack.stop)
        yield stack, stack.start_api()


def start_worker(stack: Stack, args: argparse.Namespace, m: BenchModel, name: str) -> None:
    stack.start_worker(
        name,
        m.path,
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--attention-backend",
        args.attention_backend,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--block-size",
        str(args.block_size),
        served=MODEL_NAME,
    )


def as_batch(stack: Stack, api: str, job: Job) -> ScoringRun:
    lines = [
        {"custom_id": str(i), "method": "POST", "url": "/v1/completions", "body": body(p)}
        for i, p in enumerate(job.prompts)
    ]
    path = write_jsonl(stack.root / "scoring.jsonl", lines)
    start = time.perf_counter()
    batch_id = submit_batch(api, path, endpoint="/v1/completions")
    done = wait_for(api, batch_id, timeout=3600)
    seconds = time.perf_counter() - start
    assert done["request_counts"]["failed"] == 0, done
    answers = {x["custom_id"]: x["response"]["body"] for x in download(api, done["output_file_id"])}
    usage = done["usage"]
    return ScoringRun(
        seconds,
        len(job.prompts),
        usage["input_tokens"],
        usage["input_tokens_details"]["cached_tokens"],
        [prompt_logprobs_of(answers[str(i)], p) for i, p in enumerate(job.prompts)],
    )


def as_online(api: str, job: Job) -> ScoringRun:
    with httpx.Client(base_url=api, timeout=600) as client:

        def ask(prompt: list[int]) -> dict:
            answer = client.post("/v1/completions", json=body(prompt))
            answer.raise_for_status()
            return answer.json()

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(ONLINE_CLIENTS) as pool:
            answers = list(pool.map(ask, job.prompts))
        seconds = time.perf_counter() - start
    usages = [a["usage"] for a in answers]
    return ScoringRun(
        seconds,
        len(job.prompts),
        sum(u["prompt_tokens"] for u in usages),
        sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages),
        [prompt_logprobs_of(a, p) for a, p in zip(answers, job.prompts, strict=True)],
    )


def through_service(
    args: argparse.Namespace, m: BenchModel, job: Job
) -> tuple[ScoringRun, ScoringRun]:
    with deployment(args, m) as (stack, api):
        start_worker(stack, args, m, "scoring-batch")
        batch = as_batch(stack, api, job)
        stack.kill("scoring-batch", signal.SIGTERM)
        start_worker(stack, args, m, "scoring-online")  # a cold cache, as the batch had
        online = as_online(api, job)
    return batch, online


# ---------------------------------------------------------------------------------------------
# report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=250, help="4 requests each (default 250)")
    ap.add_argument("--prefix-tokens", type=int, default=700)
    ap.add_argument(
        "--baseline-requests",
        type=int,
        default=200,
        help="requests caching off runs (the first ones; default 200)",
    )
    ap.add_argument("--service", action="store_true", help="also run through the service")
    ap.add_argument("--quick", action="store_true", help="10 questions, a smaller prefix")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true", default=True, help=argparse.SUPPRESS)
    add_model_arguments(ap, max_positions=1024)
    add_run_arguments(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.questions, args.prefix_tokens, args.baseline_requests = 10, 200, 20
    return args


def report(
    job: Job, on: ScoringRun, off: ScoringRun, service: tuple[ScoringRun, ScoringRun] | None
) -> dict:
    rule("results")
    rows = [
        ("engine, caching on", on.requests, f"{on.seconds:.2f}", f"{on.rate:,.1f}",
         f"{on.cached_share:.1%}"),
        ("engine, caching off (subset)", off.requests, f"{off.seconds:.2f}", f"{off.rate:,.1f}",
         f"{off.cached_share:.1%}"),
    ]  # fmt: skip
    for name, run in zip(("service, one batch", "service, online"), service or (), strict=False):
        rows.append((name, run.requests, f"{run.seconds:.2f}", f"{run.rate:,.1f}",
                     f"{run.cached_share:.1%}"))  # fmt: skip
    table(rows, ("run", "requests", "seconds", "requests/s", "prompt tokens from cache"))
    speedup = on.rate / off.rate
    diffs = {"off": max_difference(on.logprobs, off.logprobs)}
    if service is not None:
        diffs["batch"] = max_difference(on.logprobs, service[0].logprobs)
        diffs["online"] = max_difference(on.logprobs, service[1].logprobs)
    equal = all(relative <= TOLERANCE for _, relative in diffs.values())
    print(
        f"\nprompt tokens from the cache: {on.cached_share:.1%} (goal >= {GOAL_CACHED:.0%}): "
        f"{'MET' if on.cached_share >= GOAL_CACHED else 'NOT met'}"
    )
    print(
        f"caching on vs off: {speedup:.2f}x (goal >= {GOAL_VS_OFF:.0f}x): "
        f"{'MET' if speedup >= GOAL_VS_OFF else 'NOT met'}"
    )
    print(
        "largest logprob difference from caching on, absolute / relative to max(1, |logprob|): "
        + ", ".join(f"{k} {a:.2e} / {r:.2e}" for k, (a, r) in diffs.items())
        + f" (tolerance {TOLERANCE:.0e} relative): {'equal' if equal else 'NOT equal'}"
    )
    result = {
        "bench": "eval_scoring",
        "requests": on.requests,
        "prefix_tokens": job.prefix_tokens,
        "cached_share": round(on.cached_share, 4),
        "on_seconds": round(on.seconds, 3),
        "off_requests": off.requests,
        "off_seconds": round(off.seconds, 3),
        "speedup_vs_off": round(speedup, 2),
        "max_logprob_difference": {k: float(f"{a:.3g}") for k, (a, _) in diffs.items()},
        "max_logprob_relative_difference": {k: float(f"{r:.3g}") for k, (_, r) in diffs.items()},
        "logprobs_equal": equal,
        "goal_cached_met": on.cached_share >= GOAL_CACHED,
        "goal_speedup_met": speedup >= GOAL_VS_OFF,
    }
    if service is not None:
        for name, run in zip(("batch", "online"), service, strict=True):
            result[f"{name}_seconds"] = round(run.seconds, 3)
            result[f"{name}_cached_share"] = round(run.cached_share, 4)
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    m = set_up(args)
    try:
        job = make_job(args.questions, args.prefix_tokens, m.shape.vocab, args.seed)
        warm = warm_up_prompts(m.shape.vocab)
        rule("job")
        print(
            f"{len(job.prompts)} requests ({args.questions} questions x {CHOICES} choices), "
            f"prefix {job.prefix_tokens} tokens, {job.prompt_tokens:,} prompt tokens"
        )
        rule("engine")
        on = score_in_process(engine(args, m, caching=True), job.prompts, warm)
        subset = job.prompts[: args.baseline_requests]
        off = score_in_process(engine(args, m, caching=False), subset, warm)
        service = through_service(args, m, job) if args.service else None
        result = report(job, on, off, service)
    finally:
        m.cleanup()
    print_result(result)
    return result


if __name__ == "__main__":
    main()
