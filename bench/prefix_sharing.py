"""Prefix sharing: our engine with prefix caching against itself without it and transformers.

The workload is few-shot batch inference: 4 batches of 256 requests, every request of a batch
starting with the same 1,024-token system prompt (4 different ones, random token ids from a fixed
seed), followed by its own 32-128-token question; each request generates 32 tokens greedily
(EOS ignored). All requests go to one engine at once, batch after batch. The model is the same
random-weight ~56M-parameter Llama as bench/engine_vs_hf.py (float32, CPU), with room for
positions past 1,024.

Runs, in one process with the same torch thread count:

  1. ours, prefix caching on and cache-aware admission, on every request;
  2. ours, prefix caching on, on the baseline subset (like-for-like with 3 and 4);
  3. ours, prefix caching off, on the baseline subset;
  4. transformers `generate`, static left-padded batches in input order, on the baseline subset.

Caching off and transformers recompute every system prompt, so on a small CPU they are run on a
subset (`--baseline-requests`, default 128): the first requests of each batch in equal shares,
in the same batch-after-batch order. Throughput is generated tokens per second throughout, so a
subset's rate compares with the full run's; run 2 gives the same comparison on equal work.

Also checked and reported: greedy outputs with caching on and off are identical on every request
both ran; prompt tokens computed versus submitted (engine stats); KV memory in use, as the peak of
KV blocks held (sampled right after every scheduling decision) times the bytes per block, against
a contiguous allocation of max_model_len tokens for each sequence in flight.

    python bench/prefix_sharing.py                 # 1,024 requests; baselines on 128
    python bench/prefix_sharing.py --quick         # smoke run: 64 small requests
    python bench/prefix_sharing.py --baseline-requests 1024   # baselines on everything (slow)

The last line printed is one JSON object with the headline numbers.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from machine import CpuMeter, allocator
from random_llama import (
    BenchModel,
    ModelShape,
    add_model_arguments,
    add_run_arguments,
    hf_generate_batch,
    set_up,
)
from report import print_result, rule, table

from conveyor.engine import LLM, SamplingParams

MIB = 1 << 20

GOAL_CACHED = 0.90
GOAL_VS_OFF = 4.0
GOAL_VS_HF = 10.0

# ---------------------------------------------------------------------------------------------
# workload


@dataclass
class Request:
    request_id: str
    batch: int
    prompt: list[int]


@dataclass
class Workload:
    system_prompts: list[list[int]]
    requests: list[Request]
    output_len: int

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return self.output_len * len(self.requests)

    @property
    def max_prompt_len(self) -> int:
        return max(len(r.prompt) for r in self.requests)

    def subset(self, n: int) -> Workload:
        """The first requests of every batch, an equal share each, in the same batch order."""
        num_batches = len(self.system_prompts)
        if n >= len(self.requests):
            return self
        per = max(1, n // num_batches)
        taken: dict[int, int] = {}
        picked = []
        for r in self.requests:
            if taken.get(r.batch, 0) < per:
                taken[r.batch] = taken.get(r.batch, 0) + 1
                picked.append(r)
        return Workload(self.system_prompts, picked, self.output_len)


def make_workload(
    num_batches: int,
    per_batch: int,
    system_len: int,
    question_range: tuple[int, int],
    output_len: int,
    vocab: int,
    seed: int,
) -> Workload:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]  # skip ids 0..2 (specials)

    systems = [tokens(system_len) for _ in range(num_batches)]
    requests = [
        Request(f"b{b}-q{i}", b, systems[b] + tokens(rng.randint(*question_range)))
        for b in range(num_batches)
        for i in range(per_batch)
    ]
    return Workload(systems, requests, output_len)


# ---------------------------------------------------------------------------------------------
# our engine


@dataclass
class StepTimes:
    """Wall time of `llm.step()`, split by whether the step computed any prompt token."""

    prompt_steps: int = 0
    prompt_time: float = 0.0
    prompt_tokens: int = 0  # prompt tokens computed in those steps
    prompt_step_gen: int = 0  # tokens generated in those steps (decodes riding along)
    decode_steps: int = 0
    decode_time: float = 0.0
    decode_tokens: int = 0
    decode_context_sum: int = 0  # sum over decoded tokens of their context length

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_time if self.decode_time else float("nan")

    @property
    def decode_batch(self) -> float:
        return self.decode_tokens / max(1, self.decode_steps)

    @property
    def decode_context(self) -> float:
        return self.decode_context_sum / max(1, self.decode_tokens)


@dataclass
class Throughput:
    """What every run reports: requests, wall time, tokens, and the rates derived from them."""

    num_requests: int
    wall: float
    outputs: dict[str, list[int]]
    prompt_tokens: int
    output_tokens: int

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall

    @property
    def req_s(self) -> float:
        return self.num_requests / self.wall

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall


@dataclass(kw_only=True)
class EngineRun(Throughput):
    label: str
    prompt_tokens_computed: int
    prompt_tokens_cached: int
    kv_blocks_saved: int
    num_deferred: int
    num_preemptions: int
    num_steps: int
    peak_blocks_used: int
    running_at_peak: int
    max_running: int
    contention: float
    steps: StepTimes = field(default_factory=lambda: StepTimes())
    block_samples: list[int] = field(default_factory=list, repr=False)

    @property
    def cached_fraction(self) -> float:
        """Share of the submitted prompt tokens not computed (0 when preemptions recomputed)."""
        return max(0.0, 1.0 - self.prompt_tokens_computed / self.prompt_tokens)

    def prefill_line(self) -> str:
        line = (
            f"{self.prompt_tokens_computed:,} prompt tokens computed of {self.prompt_tokens:,} "
            f"submitted -> {self.cached_fraction:.1%} served from the prefix cache"
        )
        extra = self.prompt_tokens_computed - self.prompt_tokens
        if extra > 0:
            line += f" ({extra:,} recomputed after {self.num_preemptions} preemptions)"
        return line

    def time_line(self) -> str:
        st = self.steps
        return (
            f"steps computing prompt tokens: {st.prompt_steps}, {st.prompt_time:.1f}s "
            f"({st.prompt_tokens:,} prompt tokens, {st.prompt_step_gen:,} generated alongside); "
            f"pure-decode steps: {st.decode_steps}, {st.decode_time:.1f}s, "
            f"{st.decode_tokens:,} tokens -> {st.decode_tok_s:,.1f} tok/s "
            f"(avg batch {st.decode_batch:.0f}, avg context {st.decode_context:.0f})"
        )


def build_engine(model_dir: Path, args: argparse.Namespace, caching: bool, max_model_len: int):
    return LLM(
        str(model_dir),
        device="cpu",
        dtype="float32",
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=caching,
        admission_policy="cache_aware" if caching else "fcfs",
        attention_backend=args.attention_backend,
    )


def warm_up(llm: LLM, vocab: int, seed: int) -> None:
    rng = random.Random(seed + 7)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 64))] for _ in range(4)]
    llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )


class KvSampler:
    """KV blocks in use right after every scheduling decision of `llm`, and their peak."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.samples: list[int] = []
        self.peak_blocks = self.running_at_peak = self.max_running = 0
        self.schedule = llm.scheduler.schedule
        llm.scheduler.schedule = self.sampled_schedule

    def sampled_schedule(self):
        scheduled = self.schedule()
        s = self.llm.stats()
        self.samples.append(s.kv_blocks_used)
        if s.kv_blocks_used > self.peak_blocks:
            self.peak_blocks, self.running_at_peak = s.kv_blocks_used, s.num_running
        self.max_running = max(self.max_running, s.num_running)
        return scheduled

    def remove(self) -> None:
        self.llm.scheduler.__dict__.pop("schedule", None)


def step_until_done(
    llm: LLM, wl: Workload, label: str, progress_s: float
) -> tuple[dict[str, list[int]], StepTimes]:
    """Step until every request finished: their outputs, and the steps' times."""
    outputs: dict[str, list[int]] = {}
    counters, st = llm.scheduler.counters, StepTimes()
    t0 = last_report = time.perf_counter()
    while llm.has_unfinished():
        p0, g0 = counters.prompt_tokens_computed, llm.generation_tokens
        context = sum(seq.num_tokens for seq in llm.scheduler.running)
        ts = time.perf_counter()
        finished = llm.step()
        dt = time.perf_counter() - ts
        computed, generated = counters.prompt_tokens_computed - p0, llm.generation_tokens - g0
        if computed:
            st.prompt_steps += 1
            st.prompt_time += dt
            st.prompt_tokens += computed
            st.prompt_step_gen += generated
        elif generated:
            st.decode_steps += 1
            st.decode_time += dt
            st.decode_tokens += generated
            st.decode_context_sum += context
        for out in finished:
            outputs[out.request_id.split("/", 1)[1]] = out.outputs[0].token_ids
        now = time.perf_counter()
        if progress_s and now - last_report >= progress_s:
            last_report = now
            s = llm.stats()
            print(
                f"  [{label}] {now - t0:6.0f}s  finished {len(outputs)}/{len(wl.requests)}  "
                f"running {s.num_running}  waiting {s.num_waiting}  "
                f"KV blocks used {s.kv_blocks_used}/{s.kv_blocks_total}",
                flush=True,
            )
    return outputs, st


def run_engine(llm: LLM, wl: Workload, label: str, progress_s: float) -> EngineRun:
    """Submit every request, then step until all finish, sampling KV use after each schedule."""
    params = SamplingParams(temperature=0, max_tokens=wl.output_len, ignore_eos=True)
    kv = KvSampler(llm)
    before = llm.stats()
    meter = CpuMeter()
    t0 = time.perf_counter()
    for r in wl.requests:
        llm.add_request(f"{label}/{r.request_id}", r.prompt, params)
    outputs, st = step_until_done(llm, wl, label, progress_s)
    wall = time.perf_counter() - t0
    cores, meter_line = meter.contention(label)
    kv.remove()
    after = llm.stats()
    for r in wl.requests:
        got = outputs[r.request_id]
        assert len(got) == wl.output_len, f"{r.request_id}: {len(got)} tokens generated"
    run = EngineRun(
        label=label,
        num_requests=len(wl.requests),
        wall=wall,
        outputs=outputs,
        prompt_tokens=wl.prompt_tokens,
        output_tokens=wl.output_tokens,
        prompt_tokens_computed=after.prompt_tokens_computed - before.prompt_tokens_computed,
        prompt_tokens_cached=after.prompt_tokens_cached - before.prompt_tokens_cached,
        kv_blocks_saved=after.kv_blocks_saved - before.kv_blocks_saved,
        num_deferred=after.num_deferred - before.num_deferred,
        num_preemptions=after.num_preemptions - before.num_preemptions,
        num_steps=after.num_steps - before.num_steps,
        peak_blocks_used=kv.peak_blocks,
        running_at_peak=kv.running_at_peak,
        max_running=kv.max_running,
        contention=cores,
        steps=st,
        block_samples=kv.samples,
    )
    print(meter_line)
    print_engine_run(run, after.kv_blocks_total)
    return run


def print_engine_run(run: EngineRun, kv_blocks_total: int) -> None:
    print(
        f"wall {run.wall:.2f}s: {run.tok_s:,.1f} generated tok/s, {run.req_s:.2f} req/s, "
        f"{run.total_tok_s:,.1f} total (prompt+gen) tok/s; {run.num_steps} steps"
    )
    print(
        f"{run.prefill_line()}; stats: {run.prompt_tokens_cached:,} cached; KV blocks saved "
        f"{run.kv_blocks_saved:,}; deferred admissions {run.num_deferred:,}; preemptions "
        f"{run.num_preemptions}"
    )
    print(run.time_line())
    print(
        f"peak KV blocks used {run.peak_blocks_used:,} of {kv_blocks_total:,} "
        f"({run.running_at_peak} sequences running then; at most {run.max_running} at once)",
        flush=True,
    )


def engine_run(
    model_dir: Path,
    args: argparse.Namespace,
    wl: Workload,
    caching: bool,
    max_model_len: int,
    label: str,
    vocab: int,
) -> EngineRun:
    t = time.perf_counter()
    llm = build_engine(model_dir, args, caching, max_model_len)
    print(
        f"engine init {time.perf_counter() - t:.1f}s: prefix caching "
        f"{'on, cache-aware admission' if caching else 'off, fcfs admission'}; "
        f"{llm.stats().kv_blocks_total} KV blocks of {args.block_size}, max_model_len "
        f"{llm.max_model_len}, max_num_seqs {args.max_num_seqs}, max_num_batched_tokens "
        f"{args.max_num_batched_tokens}; {len(wl.requests)} requests",
        flush=True,
    )
    warm_up(llm, vocab, args.seed)
    run = run_engine(llm, wl, label, args.progress)
    del llm
    gc.collect()
    return run


# ---------------------------------------------------------------------------------------------
# transformers baseline


@dataclass(kw_only=True)
class HFRun(Throughput):
    batch_size: int
    padded_prompt_tokens: int
    contention: float


def run_hf(model, wl: Workload, batch_size: int, progress_s: float, quiet: bool = False) -> HFRun:
    outputs: dict[str, list[int]] = {}
    padded = 0
    meter = CpuMeter()
    t0 = last_report = time.perf_counter()
    for start in range(0, len(wl.requests), batch_size):
        batch = wl.requests[start : start + batch_size]
        gen, width = hf_generate_batch(model, [r.prompt for r in batch], wl.output_len, 0)
        padded += width * len(batch)
        for i, r in enumerate(batch):
            outputs[r.request_id] = gen[i].tolist()
        now = time.perf_counter()
        if not quiet and progress_s and now - last_report >= progress_s:
            last_report = now
            print(
                f"  [transformers] {now - t0:6.0f}s  finished {len(outputs)}/{len(wl.requests)}",
                flush=True,
            )
    wall = time.perf_counter() - t0
    cores, meter_line = meter.contention("transformers")
    run = HFRun(
        batch_size=batch_size,
        num_requests=len(wl.requests),
        wall=wall,
        outputs=outputs,
        prompt_tokens=wl.prompt_tokens,
        output_tokens=wl.output_tokens,
        padded_prompt_tokens=padded,
        contention=cores,
    )
    if not quiet:
        print(meter_line)
        print(
            f"wall {run.wall:.2f}s: {run.tok_s:,.1f} generated tok/s, {run.req_s:.2f} req/s, "
            f"{run.total_tok_s:,.1f} total (prompt+gen) tok/s; computed {padded:,} padded "
            f"prompt tokens for {run.prompt_tokens:,} real ones",
            flush=True,
        )
    return run


# ---------------------------------------------------------------------------------------------


def add_workload_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--num-batches", type=int, default=4, help="system prompts (batches)")
    ap.add_argument(
        "--requests-per-batch", type=int, default=None, help="default 256 (16 with --quick)"
    )
    ap.add_argument(
        "--system-len", type=int, default=None, help="system prompt tokens, default 1024 (256)"
    )
    ap.add_argument(
        "--question-len",
        type=int,
        nargs=2,
        default=None,
        metavar=("MIN", "MAX"),
        help="uniform question length range, default 32 128 (16 64 with --quick)",
    )
    ap.add_argument(
        "--output-len", type=int, default=None, help="generated tokens each, default 32 (8)"
    )
    ap.add_argument(
        "--baseline-requests",
        type=int,
        default=None,
        help="requests for the caching-off and transformers runs: the first of each batch "
        "in equal shares (default 128, 16 with --quick; >= the total runs them on all)",
    )


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="small workload for a smoke run")
    add_workload_arguments(ap)
    ap.add_argument(
        "--hf-batch-size",
        type=int,
        default=8,
        help="static batch size for transformers. With ~1,100-token prompts and 32 new "
        "tokens, batch sizes 1-16 were within noise of each other on the 2-core dev box "
        "(first 16 requests, uncontended: 1: 22.4, 2: 25.7, 4: 23.7, 8: 27.7 and 38.0, "
        "16: 27.1 generated tok/s); see --hf-sweep",
    )
    ap.add_argument(
        "--hf-sweep",
        type=int,
        nargs="*",
        default=None,
        metavar="BS",
        help="first time transformers on the first requests of the subset at these batch sizes",
    )
    ap.add_argument("--hf-sweep-requests", type=int, default=32)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--skip-subset-on",
        action="store_true",
        help="skip run 2 (caching on, baseline subset)",
    )
    ap.add_argument("--progress", type=float, default=30.0, help="seconds between progress lines")
    add_run_arguments(ap)
    ap.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV pool blocks for every engine run; default: enough for all system prompts "
        "plus max_num_seqs sequences' own blocks (4096 = 1 GiB at the defaults)",
    )
    # model shape: ~56M parameters, as in bench/engine_vs_hf.py but with 2,048 positions
    add_model_arguments(ap, max_positions=2048)
    return with_defaults(ap.parse_args(argv))


def with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """The defaults that depend on --quick."""
    q = args.quick
    if args.requests_per_batch is None:
        args.requests_per_batch = 16 if q else 256
    if args.system_len is None:
        args.system_len = 256 if q else 1024
    if args.question_len is None:
        args.question_len = [16, 64] if q else [32, 128]
    if args.output_len is None:
        args.output_len = 8 if q else 32
    if args.baseline_requests is None:
        args.baseline_requests = 16 if q else 128
    if args.quick:
        args.progress = 0.0
    return args


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
# the run, step by step


@dataclass
class Plan:
    """The workload, its baseline subset, and the KV pool every engine run gets."""

    wl: Workload
    base: Workload
    max_model_len: int
    kv_token_bytes: int
    block_bytes: int
    system_blocks: int

    @property
    def subset(self) -> bool:
        return self.base is not self.wl

    @property
    def tag(self) -> str:
        n = len(self.base.requests)
        return f"subset of {n}" if self.subset else f"all {n} requests"


def plan(args: argparse.Namespace, shape: ModelShape) -> Plan:
    """Make the workload and size the KV pool (setting --num-kv-blocks when not given);
    prints both."""
    wl = make_workload(
        args.num_batches,
        args.requests_per_batch,
        args.system_len,
        tuple(args.question_len),
        args.output_len,
        shape.vocab,
        args.seed,
    )
    max_model_len = args.system_len + args.question_len[1] + args.output_len
    if max_model_len > args.max_position_embeddings:
        raise SystemExit(
            f"requests need {max_model_len} positions; raise --max-position-embeddings"
        )
    kv_token_bytes = 2 * shape.layers * shape.kv_heads * shape.head_dim * 4  # float32
    p = Plan(
        wl,
        wl.subset(args.baseline_requests),
        max_model_len,
        kv_token_bytes,
        kv_token_bytes * args.block_size,
        args.num_batches * (args.system_len // args.block_size),
    )
    own_blocks = cdiv(max_model_len, args.block_size) - args.system_len // args.block_size
    if args.num_kv_blocks is None:
        need = p.system_blocks + args.max_num_seqs * own_blocks
        args.num_kv_blocks = max(need, 1024) if args.quick else max(need, 4096)
    if args.num_kv_blocks < p.system_blocks + own_blocks:
        raise SystemExit(
            f"--num-kv-blocks {args.num_kv_blocks} cannot hold the {args.num_batches} system "
            f"prompts ({p.system_blocks} blocks) and one request's own blocks"
        )
    print_plan(args, p)
    return p


def print_plan(args: argparse.Namespace, p: Plan) -> None:
    wl, base = p.wl, p.base
    print(
        f"workload: {args.num_batches} batches x {args.requests_per_batch} requests = "
        f"{len(wl.requests)}, seed {args.seed}; system prompt {args.system_len} tokens (one per "
        f"batch), question {args.question_len[0]}-{args.question_len[1]} tokens, "
        f"{args.output_len} generated each; prompt tokens {wl.prompt_tokens:,}, generated "
        f"{wl.output_tokens:,}"
    )
    print(
        f"baseline subset: {len(base.requests)} requests ({len(base.requests) // args.num_batches}"
        f" per batch), prompt tokens {base.prompt_tokens:,}, generated {base.output_tokens:,}"
        + ("" if p.subset else " (the whole workload)")
    )
    print(
        f"KV pool: {args.num_kv_blocks} blocks x {p.block_bytes / MIB:.2f} MiB = "
        f"{args.num_kv_blocks * p.block_bytes / MIB:,.0f} MiB for each engine run (the system "
        f"prompts take {p.system_blocks} blocks); max_model_len {p.max_model_len}",
        flush=True,
    )


@dataclass
class Runs:
    on: EngineRun
    on_sub: EngineRun | None
    off: EngineRun
    hf: HFRun | None
    sweep: list[dict]
    contention: dict[str, float]


def run_all(args: argparse.Namespace, m: BenchModel, p: Plan) -> Runs:
    """Runs 1 to 4 (2 only on a subset, 4 unless --skip-hf)."""
    vocab, n = m.shape.vocab, len(p.base.requests)
    rule(f"1. ours: prefix caching + cache-aware admission, all {len(p.wl.requests)} requests")
    on = engine_run(m.path, args, p.wl, True, p.max_model_len, "on", vocab)
    contention = {"on": round(on.contention, 2)}

    on_sub = None
    if p.subset and not args.skip_subset_on:
        rule(f"2. ours: prefix caching + cache-aware admission, subset of {n}")
        on_sub = engine_run(m.path, args, p.base, True, p.max_model_len, "on-subset", vocab)
        contention["on_subset"] = round(on_sub.contention, 2)

    rule(f"3. ours: prefix caching off, {p.tag}")
    off = engine_run(m.path, args, p.base, False, p.max_model_len, "off", vocab)
    contention["off"] = round(off.contention, 2)

    hf, sweep = None, []
    if m.hf is not None:
        rule(f"4. transformers generate, static batches of {args.hf_batch_size}, {p.tag}")
        hf_generate_batch(m.hf, [r.prompt[:32] for r in p.base.requests[:2]], 4, 0)  # warm-up
        if args.hf_sweep:
            sweep = hf_sweep(args, m.hf, p)
        hf = run_hf(m.hf, p.base, args.hf_batch_size, args.progress)
        contention["hf"] = round(hf.contention, 2)
    return Runs(on, on_sub, off, hf, sweep, contention)


def hf_sweep(args: argparse.Namespace, model, p: Plan) -> list[dict]:
    n = args.hf_sweep_requests
    sweep_wl = Workload(p.wl.system_prompts, p.base.requests[:n], p.wl.output_len)
    sweep = []
    for bs in args.hf_sweep:
        r = run_hf(model, sweep_wl, bs, 0, quiet=True)
        sweep.append({"bs": bs, "wall_s": round(r.wall, 3), "tok_s": round(r.tok_s, 2)})
        print(
            f"  sweep: batch {bs}: {r.wall:.2f}s, {r.tok_s:,.1f} generated tok/s on "
            f"{len(sweep_wl.requests)} requests (other processes {r.contention:.2f} cores)",
            flush=True,
        )
    return sweep


def check_outputs(p: Plan, runs: Runs) -> int:
    """How many of the baseline's requests caching on and off answered identically (and the
    other comparisons, printed)."""
    rule("correctness")
    ids = [r.request_id for r in p.base.requests]
    on = runs.on
    same_off = sum(on.outputs[i] == runs.off.outputs[i] for i in ids)
    print(f"caching on (run 1) vs off (run 3), greedy outputs identical: {same_off}/{len(ids)}")
    if runs.on_sub is not None:
        same_sub = sum(on.outputs[i] == runs.on_sub.outputs[i] for i in ids)
        print(f"caching on, run 1 vs run 2: identical {same_sub}/{len(ids)}")
    if runs.hf is not None:
        same_hf = sum(on.outputs[i] == runs.hf.outputs[i] for i in ids)
        print(
            f"ours vs transformers (informational; float32 rounding differs): identical "
            f"{same_hf}/{len(ids)}"
        )
    return same_off


def print_runs(p: Plan, runs: Runs) -> None:
    rule("summary")

    def row(name: str, run: Throughput) -> tuple:
        n = run.num_requests
        return (
            name,
            f"{n} (subset)" if n < len(p.wl.requests) else f"{n} (all)",
            f"{run.wall:.1f}",
            f"{run.tok_s:,.1f}",
            f"{run.req_s:.2f}",
            f"{run.total_tok_s:,.0f}",
        )

    rows = [row("ours, prefix caching + cache-aware admission", runs.on)]
    if runs.on_sub is not None:
        rows.append(row("ours, prefix caching + cache-aware admission", runs.on_sub))
    rows.append(row("ours, prefix caching off", runs.off))
    if runs.hf is not None:
        rows.append(row(f"transformers generate (static batches of {runs.hf.batch_size})", runs.hf))
    table(rows, ("run", "requests", "wall s", "gen tok/s", "req/s", "total tok/s"))
    print("(gen tok/s = generated tokens / wall seconds; total counts prompt tokens too)")


@dataclass
class KvMemory:
    """Run 1's peak of KV memory in use, against a contiguous max-length allocation."""

    peak_mib: float
    contiguous_mib: float
    in_flight: int


def print_prefill_and_memory(args: argparse.Namespace, p: Plan, runs: Runs) -> KvMemory:
    on, off = runs.on, runs.off
    print()
    mem = KvMemory(
        on.peak_blocks_used * p.block_bytes / MIB,
        on.max_running * p.max_model_len * p.kv_token_bytes / MIB,
        on.max_running,
    )
    contiguous_max_mib = args.max_num_seqs * p.max_model_len * p.kv_token_bytes / MIB
    print(
        f"prefill (run 1): {on.prefill_line()} (KV blocks saved {on.kv_blocks_saved:,}, "
        f"deferred admissions {on.num_deferred:,}, preemptions {on.num_preemptions})"
    )
    print(f"prefill (run 3, caching off): {off.prefill_line()}")
    print(f"time (run 1): {on.time_line()}")
    print(f"time (run 3): {off.time_line()}")
    print(
        f"KV memory (run 1): peak {on.peak_blocks_used:,} blocks x {p.block_bytes / MIB:.2f} "
        f"MiB = {mem.peak_mib:,.1f} MiB in use, with {on.running_at_peak} sequences running "
        f"then and at most {mem.in_flight} at once"
    )
    print(
        f"  vs contiguous max-length allocation: {mem.in_flight} sequences x "
        f"{p.max_model_len} tokens x {p.kv_token_bytes / 1024:.0f} KiB = "
        f"{mem.contiguous_mib:,.1f} MiB -> {mem.contiguous_mib / mem.peak_mib:.1f}x more "
        f"(at max_num_seqs {args.max_num_seqs}: {contiguous_max_mib:,.1f} MiB)"
    )
    print(
        f"  caching off (run 3): peak {off.peak_blocks_used:,} blocks = "
        f"{off.peak_blocks_used * p.block_bytes / MIB:,.1f} MiB "
        f"with at most {off.max_running} sequences at once"
    )
    return mem


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def print_goals(p: Plan, runs: Runs, mem: KvMemory, same_off: int) -> tuple[float, float]:
    """The goals table; returns run 1's throughput over caching off's and transformers'."""
    on, off, hf = runs.on, runs.off, runs.hf
    print()
    vs_off = on.tok_s / off.tok_s
    vs_hf = on.tok_s / hf.tok_s if hf else float("nan")
    note = f" ({len(p.base.requests)}-request subset)" if p.subset else ""
    goals = [
        (
            "prompt tokens served from cache",
            f"{on.cached_fraction:.1%}",
            f">= {GOAL_CACHED:.0%}",
            verdict(on.cached_fraction >= GOAL_CACHED),
        ),
        (
            f"throughput vs caching off{note}",
            f"{vs_off:.2f}x",
            f">= {GOAL_VS_OFF:g}x",
            verdict(vs_off >= GOAL_VS_OFF),
        ),
    ]
    if hf:
        goals.append(
            (
                f"throughput vs transformers{note}",
                f"{vs_hf:.2f}x",
                f">= {GOAL_VS_HF:g}x",
                verdict(vs_hf >= GOAL_VS_HF),
            )
        )
    goals += like_for_like(runs)
    goals.append(
        (
            "KV memory, contiguous / paged peak",
            f"{mem.contiguous_mib / mem.peak_mib:.1f}x",
            f"{mem.peak_mib:,.0f} vs {mem.contiguous_mib:,.0f} MiB",
            "",
        )
    )
    table(goals, ("goal", "measured", "target", ""))
    print(
        f"(ratios are generated tok/s of run 1, all {len(p.wl.requests)} requests, over the "
        f"baseline's generated tok/s{note})"
    )
    print(
        f"other processes' CPU use (cores): {runs.contention}; correctness: outputs identical: "
        f"{same_off}/{len(p.base.requests)}"
    )
    return vs_off, vs_hf


def like_for_like(runs: Runs) -> list[tuple]:
    """Run 2 (caching on, the subset) against the baselines, where it ran."""
    if runs.on_sub is None:
        return []
    rows = [
        (
            "  same subset, run 2 vs caching off",
            f"{runs.on_sub.tok_s / runs.off.tok_s:.2f}x",
            "(like-for-like check)",
            "",
        )
    ]
    if runs.hf:
        rows.append(
            (
                "  same subset, run 2 vs transformers",
                f"{runs.on_sub.tok_s / runs.hf.tok_s:.2f}x",
                "(like-for-like check)",
                "",
            )
        )
    return rows


def goals_met(on: EngineRun, vs_off: float, vs_hf: float | None) -> dict:
    return {
        "cached_90pct": on.cached_fraction >= GOAL_CACHED,
        "vs_off_4x": vs_off >= GOAL_VS_OFF,
        "vs_hf_10x": (vs_hf >= GOAL_VS_HF) if vs_hf is not None else None,
    }


def result_json(
    args: argparse.Namespace,
    m: BenchModel,
    p: Plan,
    runs: Runs,
    mem: KvMemory,
    ratios: tuple[float, float],
    same_off: int,
) -> dict:
    on, on_sub, off, hf = runs.on, runs.on_sub, runs.off, runs.hf
    vs_off, vs_hf = ratios
    return {
        "bench": "prefix_sharing",
        "quick": args.quick,
        "seed": args.seed,
        "threads": m.threads,
        "params": m.params,
        "num_requests": len(p.wl.requests),
        "baseline_requests": len(p.base.requests),
        "system_len": args.system_len,
        "question_len": list(args.question_len),
        "output_len": args.output_len,
        "prompt_tokens": p.wl.prompt_tokens,
        "prompt_tokens_computed": on.prompt_tokens_computed,
        "cached_fraction": round(on.cached_fraction, 4),
        "kv_blocks_saved": on.kv_blocks_saved,
        "num_deferred": on.num_deferred,
        "on_wall_s": round(on.wall, 3),
        "on_tok_s": round(on.tok_s, 2),
        "on_req_s": round(on.req_s, 3),
        "on_total_tok_s": round(on.total_tok_s, 1),
        "on_subset_tok_s": round(on_sub.tok_s, 2) if on_sub else None,
        "off_wall_s": round(off.wall, 3),
        "off_tok_s": round(off.tok_s, 2),
        "hf_batch_size": hf.batch_size if hf else None,
        "hf_wall_s": round(hf.wall, 3) if hf else None,
        "hf_tok_s": round(hf.tok_s, 2) if hf else None,
        "ratio_vs_off": round(vs_off, 3),
        "ratio_vs_hf": round(vs_hf, 3) if hf else None,
        "goals_met": goals_met(on, vs_off, vs_hf if hf else None),
        "on_prompt_step_s": round(on.steps.prompt_time, 2),
        "on_decode_step_s": round(on.steps.decode_time, 2),
        "on_decode_tok_s": round(on.steps.decode_tok_s, 2),
        "on_decode_avg_batch": round(on.steps.decode_batch, 1),
        "on_decode_avg_context": round(on.steps.decode_context, 1),
        "off_prompt_step_s": round(off.steps.prompt_time, 2),
        "off_decode_step_s": round(off.steps.decode_time, 2),
        "kv_peak_blocks": on.peak_blocks_used,
        "kv_peak_mib": round(mem.peak_mib, 1),
        "kv_contiguous_mib": round(mem.contiguous_mib, 1),
        "kv_max_in_flight": mem.in_flight,
        "max_model_len": p.max_model_len,
        "outputs_identical": f"{same_off}/{len(p.base.requests)}",
        "other_process_cores": runs.contention,
        "hf_sweep": runs.sweep,
        "allocator": allocator(),
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    m = set_up(args)
    shape = m.shape
    print(
        f"model: llama hidden {shape.hidden}, intermediate {shape.inter}, layers {shape.layers}, "
        f"heads {shape.heads}/{shape.kv_heads} kv (head_dim {shape.head_dim}), vocab "
        f"{shape.vocab}; {m.params:,} parameters; float32"
    )
    p = plan(args, shape)
    runs = run_all(args, m, p)
    same_off = check_outputs(p, runs)
    print_runs(p, runs)
    mem = print_prefill_and_memory(args, p, runs)
    ratios = print_goals(p, runs, mem, same_off)
    result = result_json(args, m, p, runs, mem, ratios, same_off)
    print_result(result)
    m.cleanup()
    n = len(p.base.requests)
    assert same_off == n, f"caching on and off disagree on {n - same_off} requests"
    return result


if __name__ == "__main__":
    main()
