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
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_vs_hf import (  # noqa: E402
    CpuMeter,
    ModelShape,
    add_model_arguments,
    allocator,
    hf_generate_batch,
    load_hf,
    model_overrides,
    prepare_model,
    print_setup,
)
from report import rule, table  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402

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


def run_engine(llm: LLM, wl: Workload, label: str, progress_s: float) -> EngineRun:
    """Submit every request, then step until all finish, sampling KV use after each schedule."""
    params = SamplingParams(temperature=0, max_tokens=wl.output_len, ignore_eos=True)
    peak = {"blocks": 0, "running_at_peak": 0, "max_running": 0}
    samples: list[int] = []
    schedule = llm.scheduler.schedule

    def sampled_schedule():
        scheduled = schedule()
        s = llm.stats()
        samples.append(s.kv_blocks_used)
        if s.kv_blocks_used > peak["blocks"]:
            peak["blocks"], peak["running_at_peak"] = s.kv_blocks_used, s.num_running
        peak["max_running"] = max(peak["max_running"], s.num_running)
        return scheduled

    llm.scheduler.schedule = sampled_schedule
    before = llm.stats()
    outputs: dict[str, list[int]] = {}
    meter = CpuMeter().start()
    t0 = last_report = time.perf_counter()
    for r in wl.requests:
        llm.add_request(f"{label}/{r.request_id}", r.prompt, params)
    counters, st = llm.scheduler.counters, StepTimes()
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
    wall = time.perf_counter() - t0
    meter_line = meter.stop()
    llm.scheduler.__dict__.pop("schedule", None)
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
        peak_blocks_used=peak["blocks"],
        running_at_peak=peak["running_at_peak"],
        max_running=peak["max_running"],
        contention=meter.other_cores,
        steps=st,
        block_samples=samples,
    )
    print(meter_line)
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
        f"peak KV blocks used {run.peak_blocks_used:,} of {after.kv_blocks_total:,} "
        f"({run.running_at_peak} sequences running then; at most {run.max_running} at once)",
        flush=True,
    )
    return run


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
    meter = CpuMeter().start()
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
    meter_line = meter.stop()
    run = HFRun(
        batch_size=batch_size,
        num_requests=len(wl.requests),
        wall=wall,
        outputs=outputs,
        prompt_tokens=wl.prompt_tokens,
        output_tokens=wl.output_tokens,
        padded_prompt_tokens=padded,
        contention=meter.other_cores,
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


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="small workload for a smoke run")
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
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's default, the core count)",
    )
    ap.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="write (or reuse) the checkpoint here instead of a temp dir",
    )
    ap.add_argument("--progress", type=float, default=30.0, help="seconds between progress lines")
    # engine knobs
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV pool blocks for every engine run; default: enough for all system prompts "
        "plus max_num_seqs sequences' own blocks (4096 = 1 GiB at the defaults)",
    )
    # model shape: ~56M parameters, as in bench/engine_vs_hf.py but with 2,048 positions
    add_model_arguments(ap, max_positions=2048)
    args = ap.parse_args(argv)
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


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    torch.manual_seed(args.seed)

    rule("setup")
    print_setup(threads)
    tmp, model_dir = prepare_model(args, model_overrides(args))

    from transformers import AutoConfig

    shape = ModelShape.from_config(AutoConfig.from_pretrained(str(model_dir)))
    hf_model = None if args.skip_hf else load_hf(model_dir)
    if hf_model is not None:
        n_params = sum(p.numel() for p in hf_model.parameters())
    else:
        n_params = (
            shape.matmul_flops_per_token() // 2
            + shape.vocab * shape.hidden
            + shape.layers * 2 * shape.hidden
            + shape.hidden
        )
    print(
        f"model: llama hidden {shape.hidden}, intermediate {shape.inter}, layers {shape.layers}, "
        f"heads {shape.heads}/{shape.kv_heads} kv (head_dim {shape.head_dim}), vocab "
        f"{shape.vocab}; {n_params:,} parameters; float32"
    )

    wl = make_workload(
        args.num_batches,
        args.requests_per_batch,
        args.system_len,
        tuple(args.question_len),
        args.output_len,
        shape.vocab,
        args.seed,
    )
    base = wl.subset(args.baseline_requests)
    subset = base is not wl
    max_model_len = args.system_len + args.question_len[1] + args.output_len
    if max_model_len > args.max_position_embeddings:
        raise SystemExit(
            f"requests need {max_model_len} positions; raise --max-position-embeddings"
        )
    kv_token_bytes = 2 * shape.layers * shape.kv_heads * shape.head_dim * 4  # float32
    block_bytes = kv_token_bytes * args.block_size
    system_blocks = args.num_batches * (args.system_len // args.block_size)
    own_blocks = cdiv(max_model_len, args.block_size) - args.system_len // args.block_size
    if args.num_kv_blocks is None:
        need = system_blocks + args.max_num_seqs * own_blocks
        args.num_kv_blocks = max(need, 1024) if args.quick else max(need, 4096)
    if args.num_kv_blocks < system_blocks + own_blocks:
        raise SystemExit(
            f"--num-kv-blocks {args.num_kv_blocks} cannot hold the {args.num_batches} system "
            f"prompts ({system_blocks} blocks) and one request's own blocks"
        )
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
        + ("" if subset else " (the whole workload)")
    )
    print(
        f"KV pool: {args.num_kv_blocks} blocks x {block_bytes / MIB:.2f} MiB = "
        f"{args.num_kv_blocks * block_bytes / MIB:,.0f} MiB for each engine run (the system "
        f"prompts take {system_blocks} blocks); max_model_len {max_model_len}",
        flush=True,
    )

    vocab = shape.vocab
    contention: dict[str, float] = {}

    # ---- 1. ours, caching on, everything
    rule(f"1. ours: prefix caching + cache-aware admission, all {len(wl.requests)} requests")
    on = engine_run(model_dir, args, wl, True, max_model_len, "on", vocab)
    contention["on"] = round(on.contention, 2)

    # ---- 2. ours, caching on, the subset
    on_sub = None
    if subset and not args.skip_subset_on:
        rule(f"2. ours: prefix caching + cache-aware admission, subset of {len(base.requests)}")
        on_sub = engine_run(model_dir, args, base, True, max_model_len, "on-subset", vocab)
        contention["on_subset"] = round(on_sub.contention, 2)

    # ---- 3. ours, caching off, the subset
    tag = f"subset of {len(base.requests)}" if subset else f"all {len(base.requests)} requests"
    rule(f"3. ours: prefix caching off, {tag}")
    off = engine_run(model_dir, args, base, False, max_model_len, "off", vocab)
    contention["off"] = round(off.contention, 2)

    # ---- 4. transformers, the subset
    hf = None
    sweep = []
    if hf_model is not None:
        rule(f"4. transformers generate, static batches of {args.hf_batch_size}, {tag}")
        hf_generate_batch(hf_model, [r.prompt[:32] for r in base.requests[:2]], 4, 0)  # warm-up
        if args.hf_sweep:
            n = args.hf_sweep_requests
            sweep_wl = Workload(wl.system_prompts, base.requests[:n], wl.output_len)
            for bs in args.hf_sweep:
                r = run_hf(hf_model, sweep_wl, bs, 0, quiet=True)
                sweep.append({"bs": bs, "wall_s": round(r.wall, 3), "tok_s": round(r.tok_s, 2)})
                print(
                    f"  sweep: batch {bs}: {r.wall:.2f}s, {r.tok_s:,.1f} generated tok/s on "
                    f"{len(sweep_wl.requests)} requests (other processes {r.contention:.2f} cores)",
                    flush=True,
                )
        hf = run_hf(hf_model, base, args.hf_batch_size, args.progress)
        contention["hf"] = round(hf.contention, 2)

    # ---- correctness
    rule("correctness")
    ids = [r.request_id for r in base.requests]
    same_off = sum(on.outputs[i] == off.outputs[i] for i in ids)
    print(f"caching on (run 1) vs off (run 3), greedy outputs identical: {same_off}/{len(ids)}")
    same_sub = None
    if on_sub is not None:
        same_sub = sum(on.outputs[i] == on_sub.outputs[i] for i in ids)
        print(f"caching on, run 1 vs run 2: identical {same_sub}/{len(ids)}")
    same_hf = None
    if hf is not None:
        same_hf = sum(on.outputs[i] == hf.outputs[i] for i in ids)
        print(
            f"ours vs transformers (informational; float32 rounding differs): identical "
            f"{same_hf}/{len(ids)}"
        )

    # ---- summary
    rule("summary")

    def sub_note(n: int) -> str:
        return f"{n} (subset)" if n < len(wl.requests) else f"{n} (all)"

    def row(name: str, run, n: int) -> tuple:
        return (
            name,
            sub_note(n),
            f"{run.wall:.1f}",
            f"{run.tok_s:,.1f}",
            f"{run.req_s:.2f}",
            f"{run.total_tok_s:,.0f}",
        )

    rows = [row("ours, prefix caching + cache-aware admission", on, on.num_requests)]
    if on_sub is not None:
        rows.append(
            row("ours, prefix caching + cache-aware admission", on_sub, on_sub.num_requests)
        )
    rows.append(row("ours, prefix caching off", off, off.num_requests))
    if hf is not None:
        rows.append(
            row(f"transformers generate (static batches of {hf.batch_size})", hf, hf.num_requests)
        )
    table(rows, ("run", "requests", "wall s", "gen tok/s", "req/s", "total tok/s"))
    print("(gen tok/s = generated tokens / wall seconds; total counts prompt tokens too)")

    print()
    peak_mib = on.peak_blocks_used * block_bytes / MIB
    in_flight = on.max_running
    contiguous_mib = in_flight * max_model_len * kv_token_bytes / MIB
    contiguous_max_mib = args.max_num_seqs * max_model_len * kv_token_bytes / MIB
    off_peak_mib = off.peak_blocks_used * block_bytes / MIB
    print(
        f"prefill (run 1): {on.prefill_line()} (KV blocks saved {on.kv_blocks_saved:,}, "
        f"deferred admissions {on.num_deferred:,}, preemptions {on.num_preemptions})"
    )
    print(f"prefill (run 3, caching off): {off.prefill_line()}")
    print(f"time (run 1): {on.time_line()}")
    print(f"time (run 3): {off.time_line()}")
    print(
        f"KV memory (run 1): peak {on.peak_blocks_used:,} blocks x {block_bytes / MIB:.2f} MiB = "
        f"{peak_mib:,.1f} MiB in use, with {on.running_at_peak} sequences running then and at "
        f"most {in_flight} at once"
    )
    print(
        f"  vs contiguous max-length allocation: {in_flight} sequences x {max_model_len} tokens x "
        f"{kv_token_bytes / 1024:.0f} KiB = {contiguous_mib:,.1f} MiB -> "
        f"{contiguous_mib / peak_mib:.1f}x more "
        f"(at max_num_seqs {args.max_num_seqs}: {contiguous_max_mib:,.1f} MiB)"
    )
    print(
        f"  caching off (run 3): peak {off.peak_blocks_used:,} blocks = {off_peak_mib:,.1f} MiB "
        f"with at most {off.max_running} sequences at once"
    )

    print()
    vs_off = on.tok_s / off.tok_s
    vs_hf = on.tok_s / hf.tok_s if hf else float("nan")

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    note = f" ({len(base.requests)}-request subset)" if subset else ""
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
    if on_sub is not None:
        goals.append(
            (
                "  same subset, run 2 vs caching off",
                f"{on_sub.tok_s / off.tok_s:.2f}x",
                "(like-for-like check)",
                "",
            )
        )
        if hf:
            goals.append(
                (
                    "  same subset, run 2 vs transformers",
                    f"{on_sub.tok_s / hf.tok_s:.2f}x",
                    "(like-for-like check)",
                    "",
                )
            )
    goals.append(
        (
            "KV memory, contiguous / paged peak",
            f"{contiguous_mib / peak_mib:.1f}x",
            f"{peak_mib:,.0f} vs {contiguous_mib:,.0f} MiB",
            "",
        )
    )
    table(goals, ("goal", "measured", "target", ""))
    print(
        f"(ratios are generated tok/s of run 1, all {len(wl.requests)} requests, over the "
        f"baseline's generated tok/s{note})"
    )
    print(
        f"other processes' CPU use (cores): {contention}; correctness: outputs identical: "
        f"{same_off}/{len(ids)}"
    )

    result = {
        "bench": "prefix_sharing",
        "quick": args.quick,
        "seed": args.seed,
        "threads": threads,
        "params": n_params,
        "num_requests": len(wl.requests),
        "baseline_requests": len(base.requests),
        "system_len": args.system_len,
        "question_len": list(args.question_len),
        "output_len": args.output_len,
        "prompt_tokens": wl.prompt_tokens,
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
        "goals_met": {
            "cached_90pct": on.cached_fraction >= GOAL_CACHED,
            "vs_off_4x": vs_off >= GOAL_VS_OFF,
            "vs_hf_10x": (vs_hf >= GOAL_VS_HF) if hf else None,
        },
        "on_prompt_step_s": round(on.steps.prompt_time, 2),
        "on_decode_step_s": round(on.steps.decode_time, 2),
        "on_decode_tok_s": round(on.steps.decode_tok_s, 2),
        "on_decode_avg_batch": round(on.steps.decode_batch, 1),
        "on_decode_avg_context": round(on.steps.decode_context, 1),
        "off_prompt_step_s": round(off.steps.prompt_time, 2),
        "off_decode_step_s": round(off.steps.decode_time, 2),
        "kv_peak_blocks": on.peak_blocks_used,
        "kv_peak_mib": round(peak_mib, 1),
        "kv_contiguous_mib": round(contiguous_mib, 1),
        "kv_max_in_flight": in_flight,
        "max_model_len": max_model_len,
        "outputs_identical": f"{same_off}/{len(ids)}",
        "other_process_cores": contention,
        "hf_sweep": sweep,
        "allocator": allocator(),
    }
    print(json.dumps(result), flush=True)
    if tmp is not None:
        tmp.cleanup()
    assert same_off == len(ids), f"caching on and off disagree on {len(ids) - same_off} requests"
    return result


if __name__ == "__main__":
    main()
