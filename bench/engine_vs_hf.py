"""Throughput of our paged-KV engine against transformers' static-batch `generate`.

Both run the same random-weight Llama (~56M parameters by default) on the same workload of
random-token prompts, greedily, in float32, in one process with the same torch thread count.
Every request generates exactly its own number of tokens (EOS is ignored on both sides). The
transformers baseline groups requests into static batches in input order, left-pads them, and
runs each batch until its longest request is done; only each request's own tokens count as
useful output.

Also measured: the machine's matmul ceiling for this model (F.linear at the model's decode
shapes) and our decode-only throughput as a fraction of it.

    python bench/engine_vs_hf.py            # full run: 256 requests, prompts 32-512, outputs 16-256
    python bench/engine_vs_hf.py --quick    # smoke run: 32 small requests

The last line printed is one JSON object with the headline numbers.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
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

# ---------------------------------------------------------------------------------------------
# workload


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        prompts.append([rng.randrange(3, vocab) for _ in range(plen)])  # skip ids 0..2 (specials)
        outs.append(rng.randint(*output_range))
    return Workload(prompts, outs)


# ---------------------------------------------------------------------------------------------
# matmul ceiling


def time_linear(
    m: int,
    k: int,
    n: int,
    min_time: float = 0.3,
    min_calls: int = 30,
    dtype: torch.dtype = torch.float32,
) -> float:
    """Seconds per F.linear of x[m, k] by W[n, k] (what nn.Linear runs), in `dtype`.

    Each call is timed on its own and the 20th percentile is kept: a ceiling should be
    optimistic, and on a shared machine a call that waited for a descheduled thread says
    nothing about the hardware.
    """
    x = torch.randn(m, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype)
    for _ in range(3):
        F.linear(x, w)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        F.linear(x, w)
        times.append(time.perf_counter() - t0)
        if len(times) >= 2000:
            break
    times.sort()
    return times[len(times) // 5]


@dataclass
class Ceiling:
    batch: int
    seconds_per_step: float  # all decode matmuls of one step at this batch
    flops_per_token: int

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.seconds_per_step

    @property
    def flops_per_s(self) -> float:
        return self.flops_per_token * self.batch / self.seconds_per_step


def measure_ceiling(shape: ModelShape, batches: list[int]) -> dict[int, Ceiling]:
    cache: dict[tuple[int, int, int], float] = {}
    out = {}
    for m in batches:
        total = 0.0
        for _, k, n, count in shape.linears():
            key = (m, k, n)
            if key not in cache:
                cache[key] = time_linear(m, k, n)
            total += cache[key] * count
        out[m] = Ceiling(m, total, shape.matmul_flops_per_token())
    return out


# ---------------------------------------------------------------------------------------------
# our engine


@dataclass
class StepLog:
    decode_time: float = 0.0
    decode_tokens: int = 0
    decode_steps: int = 0
    decode_batch_sum: int = 0
    decode_context_sum: int = 0
    other_time: float = 0.0
    other_tokens: int = 0
    other_steps: int = 0
    per_step: list[tuple[bool, int, float]] = field(default_factory=list)


def instrument_steps(llm: LLM) -> StepLog:
    """Time every `llm.step()`; a step is pure decode when it computed no prompt token."""
    log = StepLog()
    step = type(llm).step
    counters = llm.scheduler.counters

    def timed_step():
        p0, g0, pre0 = (
            counters.prompt_tokens_computed,
            llm.generation_tokens,
            counters.num_preemptions,
        )
        ctx = sum(s.num_tokens for s in llm.scheduler.running)
        t0 = time.perf_counter()
        finished = step(llm)
        dt = time.perf_counter() - t0
        new = llm.generation_tokens - g0
        pure = counters.prompt_tokens_computed == p0 and counters.num_preemptions == pre0 and new
        if pure:
            log.decode_time += dt
            log.decode_tokens += new
            log.decode_steps += 1
            log.decode_batch_sum += new
            log.decode_context_sum += ctx
        else:
            log.other_time += dt
            log.other_tokens += new
            log.other_steps += 1
        log.per_step.append((bool(pure), new, dt))
        return finished

    llm.step = timed_step  # generate() calls self.step()
    return log


def uninstrument(llm: LLM) -> None:
    llm.__dict__.pop("step", None)


def run_ours(llm: LLM, wl: Workload) -> tuple[float, list[list[int]], StepLog]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    log = instrument_steps(llm)
    t0 = time.perf_counter()
    outputs = llm.generate(wl.prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    uninstrument(llm)
    tokens = [o.outputs[0].token_ids for o in outputs]
    for t, n in zip(tokens, wl.output_lens, strict=True):
        assert len(t) == n, f"ours generated {len(t)} tokens, wanted {n}"
    return wall, tokens, log


def decode_probe(
    llm: LLM, batch: int, prompt_len: int, steps: int, vocab: int, seed: int
) -> StepLog:
    """Pure-decode throughput at `batch` sequences with short contexts."""
    wl = make_workload(batch, (prompt_len, prompt_len), (steps + 1, steps + 1), vocab, seed + 1)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    log = instrument_steps(llm)
    llm.generate(wl.prompts, params, use_tqdm=False)
    uninstrument(llm)
    return log


# ---------------------------------------------------------------------------------------------
# transformers baseline


@dataclass
class HFResult:
    wall: float
    tokens: list[list[int]]
    padded_prompt_tokens: int
    generated_tokens: int  # batch rows x steps, useful or not
    batch_times: list[float]


def run_hf(model, wl: Workload, batch_size: int, pad_id: int = 0) -> HFResult:
    tokens: list[list[int]] = []
    padded = generated = 0
    batch_times = []
    t0 = time.perf_counter()
    for start in range(0, len(wl.prompts), batch_size):
        prompts = wl.prompts[start : start + batch_size]
        lens = wl.output_lens[start : start + batch_size]
        tb = time.perf_counter()
        gen, width = hf_generate_batch(model, prompts, max(lens), pad_id)
        batch_times.append(time.perf_counter() - tb)
        padded += width * len(prompts)
        generated += gen.numel()
        tokens.extend(gen[i, :n].tolist() for i, n in enumerate(lens))
    return HFResult(time.perf_counter() - t0, tokens, padded, generated, batch_times)


# ---------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-requests", type=int, default=None, help="default 256 (32 with --quick)")
    ap.add_argument(
        "--prompt-len",
        type=int,
        nargs=2,
        default=None,
        metavar=("MIN", "MAX"),
        help="uniform prompt length range, default 32 512 (16 128 with --quick)",
    )
    ap.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        default=None,
        metavar=("MIN", "MAX"),
        help="uniform output length range, default 16 256 (8 64 with --quick)",
    )
    ap.add_argument("--quick", action="store_true", help="small workload for a smoke run")
    ap.add_argument(
        "--hf-batch-size",
        type=int,
        default=32,
        help="static batch size for transformers; 32 was its best on the 2-core "
        "dev box (8: 129, 16: 145, 32: 165, 64: 87 useful tok/s on the first 64 "
        "requests; see --hf-sweep)",
    )
    ap.add_argument(
        "--hf-sweep",
        type=int,
        nargs="*",
        default=None,
        metavar="BS",
        help="also time transformers on the first 64 requests at these batch sizes",
    )
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-decode-probe", action="store_true")
    ap.add_argument(
        "--decode-batch",
        type=int,
        default=None,
        help="sequences in the decode probe (default: min(num requests, 256))",
    )
    ap.add_argument("--decode-prompt-len", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=48)
    add_run_arguments(ap)
    # model shape: ~56M parameters
    add_model_arguments(ap, max_positions=1024)
    return with_defaults(ap.parse_args(argv))


def with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """The defaults that depend on --quick."""
    if args.num_requests is None:
        args.num_requests = 32 if args.quick else 256
    if args.prompt_len is None:
        args.prompt_len = [16, 128] if args.quick else [32, 512]
    if args.output_len is None:
        args.output_len = [8, 64] if args.quick else [16, 256]
    if args.decode_batch is None:
        args.decode_batch = min(args.num_requests, 256)
    if args.quick:
        args.decode_steps = min(args.decode_steps, 16)
    return args


# ---------------------------------------------------------------------------------------------
# the run, step by step


def describe(args: argparse.Namespace, m: BenchModel) -> Workload:
    """Print the model and the workload; returns the workload."""
    shape = m.shape
    n_embed = shape.vocab * shape.hidden
    print(
        f"model: llama hidden {shape.hidden}, intermediate {shape.inter}, layers {shape.layers}, "
        f"heads {shape.heads}/{shape.kv_heads} kv (head_dim {shape.head_dim}), "
        f"vocab {shape.vocab}"
    )
    print(
        f"parameters: {m.params:,} total = {m.params - 2 * n_embed:,} in layers + "
        f"{n_embed:,} embedding + {n_embed:,} lm_head (untied)"
    )
    wl = make_workload(
        args.num_requests, tuple(args.prompt_len), tuple(args.output_len), shape.vocab, args.seed
    )
    print(
        f"workload: {len(wl.prompts)} requests, seed {args.seed}, prompt len "
        f"{args.prompt_len[0]}-{args.prompt_len[1]} (total {wl.prompt_tokens:,}), output len "
        f"{args.output_len[0]}-{args.output_len[1]} (total {wl.output_tokens:,})"
    )
    return wl


def matmul_ceiling(args: argparse.Namespace, shape: ModelShape) -> tuple[dict[int, Ceiling], float]:
    """The matmul ceiling at the decode batches of interest, and the other processes' cores
    while it was measured."""
    rule("matmul ceiling (F.linear, fp32, at the model's decode shapes)")
    batches = sorted({1, 16, 64, 128, args.decode_batch, 256})
    meter = CpuMeter()
    ceilings = measure_ceiling(shape, batches)
    flops_tok = shape.matmul_flops_per_token()
    n_embed = shape.vocab * shape.hidden
    print(
        f"matmul FLOPs per generated token: {flops_tok / 1e6:.1f} MFLOP "
        f"(2 x {flops_tok // 2 - n_embed:,} layer weights + 2 x {n_embed:,} lm_head)"
    )
    big = time_linear(256, shape.hidden, shape.inter)
    big_flops = 2 * 256 * shape.hidden * shape.inter / big
    print(
        f"single GEMM [256, {shape.hidden}] x [{shape.hidden}, {shape.inter}]: "
        f"{big_flops / 1e9:.1f} GFLOP/s"
    )
    table(
        [
            (
                m,
                f"{c.seconds_per_step * 1e3:.2f}",
                f"{c.flops_per_s / 1e9:.1f}",
                f"{c.tokens_per_s:,.0f}",
            )
            for m, c in ceilings.items()
        ],
        ("decode batch", "matmul ms/step", "GFLOP/s", "ceiling tok/s"),
    )
    cores, line = meter.contention("ceiling")
    print(line)
    return ceilings, cores


@dataclass
class Ours:
    """Our engine on the workload, and on the decode probe."""

    wall: float
    tokens: list[list[int]]
    log: StepLog
    probe: StepLog | None
    contention: float

    @property
    def avg_batch(self) -> float:
        return self.log.decode_batch_sum / max(1, self.log.decode_steps)

    @property
    def avg_context(self) -> float:
        return self.log.decode_context_sum / max(1, self.log.decode_batch_sum)

    @property
    def decode_tps(self) -> float:
        log = self.log
        return log.decode_tokens / log.decode_time if log.decode_time else float("nan")

    @property
    def probe_tps(self) -> float | None:
        return self.probe.decode_tokens / self.probe.decode_time if self.probe else None


def run_ours_on(args: argparse.Namespace, m: BenchModel, wl: Workload, warm: Workload) -> Ours:
    rule("ours: engine.LLM")
    t = time.perf_counter()
    llm = LLM(
        str(m.path),
        device="cpu",
        dtype="float32",
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.attention_backend,
    )
    print(
        f"engine init {time.perf_counter() - t:.1f}s, attention {llm.runner.backend.name}, "
        f"{llm.stats().kv_blocks_total} KV blocks "
        f"of {args.block_size}, max_num_seqs {args.max_num_seqs}, "
        f"max_num_batched_tokens {args.max_num_batched_tokens}"
    )
    run_ours(llm, warm)
    meter = CpuMeter()
    wall, tokens, log = run_ours(llm, wl)
    cores, line = meter.contention("ours")
    print(line)
    ours = Ours(wall, tokens, log, None, cores)
    print(
        f"wall {wall:.2f}s, {wl.output_tokens / wall:,.1f} useful tok/s, "
        f"{(wl.prompt_tokens + wl.output_tokens) / wall:,.1f} total (prompt+gen) tok/s, "
        f"{len(log.per_step)} steps, preemptions {llm.stats().num_preemptions}"
    )
    print(
        f"  pure-decode steps: {log.decode_steps}, {log.decode_time:.2f}s, "
        f"{log.decode_tokens:,} tok -> {ours.decode_tps:,.1f} tok/s "
        f"(avg batch {ours.avg_batch:.1f}, avg context {ours.avg_context:.0f})"
    )
    print(
        f"  steps with prompt work: {log.other_steps}, {log.other_time:.2f}s, "
        f"{log.other_tokens:,} tok sampled"
    )
    if not args.skip_decode_probe:
        ours.probe = run_decode_probe(args, llm, m.shape.vocab)
    return ours


def run_decode_probe(args: argparse.Namespace, llm: LLM, vocab: int) -> StepLog:
    probe = decode_probe(
        llm, args.decode_batch, args.decode_prompt_len, args.decode_steps, vocab, args.seed
    )
    print(
        f"decode probe: batch {args.decode_batch}, context {args.decode_prompt_len}-"
        f"{args.decode_prompt_len + args.decode_steps}: {probe.decode_steps} steps, "
        f"{probe.decode_tokens / probe.decode_time:,.1f} tok/s "
        f"({probe.decode_time / probe.decode_steps * 1e3:.1f} ms/step)"
    )
    return probe


def run_transformers(
    args: argparse.Namespace, model, wl: Workload, warm: Workload
) -> tuple[HFResult, list[tuple], float]:
    """transformers on the workload (after the --hf-sweep, if asked): its result, the sweep's
    rows and the other processes' cores while it ran."""
    rule(f"transformers generate, static batches of {args.hf_batch_size} in input order")
    hf_generate_batch(model, warm.prompts[:2], 4, 0)  # warm-up
    sweep_rows = []
    if args.hf_sweep:
        sub = Workload(wl.prompts[:64], wl.output_lens[:64])
        for bs in args.hf_sweep:
            r = run_hf(model, sub, bs)
            sweep_rows.append((bs, f"{r.wall:.2f}", f"{sub.output_tokens / r.wall:,.1f}"))
            print(
                f"  sweep: batch {bs}: {r.wall:.2f}s, "
                f"{sub.output_tokens / r.wall:,.1f} useful tok/s",
                flush=True,
            )
    meter = CpuMeter()
    hf = run_hf(model, wl, args.hf_batch_size)
    cores, line = meter.contention("hf")
    print(line)
    print(
        f"wall {hf.wall:.2f}s, {wl.output_tokens / hf.wall:,.1f} useful tok/s; "
        f"{len(hf.batch_times)} batches; computed {hf.padded_prompt_tokens:,} padded prompt "
        f"tokens ({wl.prompt_tokens / hf.padded_prompt_tokens:.0%} real) and generated "
        f"{hf.generated_tokens:,} tokens ({wl.output_tokens / hf.generated_tokens:.0%} "
        f"useful)"
    )
    return hf, sweep_rows, cores


def print_throughput(args: argparse.Namespace, wl: Workload, ours: Ours, hf: HFResult | None):
    """The summary's first table; returns transformers' useful tok/s and the ratio (NaN
    without transformers)."""
    rule("summary")
    ours_tps = wl.output_tokens / ours.wall
    hf_tps = wl.output_tokens / hf.wall if hf else float("nan")
    ratio = ours_tps / hf_tps if hf else float("nan")
    rows = [("ours (engine.LLM)", f"{ours.wall:.2f}", f"{ours_tps:,.1f}", "")]
    if hf:
        rows.append(
            (
                f"transformers generate (bs {args.hf_batch_size})",
                f"{hf.wall:.2f}",
                f"{hf_tps:,.1f}",
                "",
            )
        )
        rows.append(
            (
                "ratio ours / transformers",
                "",
                f"{ratio:.2f}x",
                "goal >= 3x: " + ("met" if ratio >= 3 else "NOT met"),
            )
        )
    table(rows, ("", "wall s", "useful gen tok/s", ""))
    return hf_tps, ratio


def ceiling_for(ceilings: dict[int, Ceiling], batch: float) -> Ceiling:
    nearest = min(ceilings, key=lambda m: abs(math.log(m) - math.log(max(batch, 1))))
    return ceilings[nearest]


def print_decode(
    args: argparse.Namespace, shape: ModelShape, ours: Ours, ceilings: dict[int, Ceiling]
) -> Ceiling:
    """Our decode-only throughput against the matmul ceiling; returns the ceiling at the
    workload's average decode batch."""
    ceil_max = ceilings[max(ceilings)]
    ceil_wl = ceiling_for(ceilings, ours.avg_batch)
    print()
    drows = [
        (
            "decode steps inside the workload",
            f"{ours.avg_batch:.0f}",
            f"{ours.avg_context:.0f}",
            f"{ours.decode_tps:,.1f}",
            f"{ceil_wl.tokens_per_s:,.0f} @bs{ceil_wl.batch}",
            f"{ours.decode_tps / ceil_wl.tokens_per_s:.1%}",
            f"{ours.decode_tps / ceil_max.tokens_per_s:.1%}",
        )
    ]
    if ours.probe is not None:
        probe_tps = ours.probe_tps
        ctx = ours.probe.decode_context_sum / ours.probe.decode_batch_sum
        c = ceiling_for(ceilings, args.decode_batch)
        drows.append(
            (
                "decode probe (short context)",
                f"{args.decode_batch}",
                f"{ctx:.0f}",
                f"{probe_tps:,.1f}",
                f"{c.tokens_per_s:,.0f} @bs{c.batch}",
                f"{probe_tps / c.tokens_per_s:.1%}",
                f"{probe_tps / ceil_max.tokens_per_s:.1%}",
            )
        )
    header = ("ours, decode only", "batch", "ctx", "tok/s", "matmul ceiling", "of ceiling")
    table(drows, (*header, f"of bs{ceil_max.batch} ceiling"))
    print(
        f"(ceiling = measured matmul FLOP/s / {shape.matmul_flops_per_token() / 1e6:.1f} MFLOP "
        f"per token; attention would add "
        f"{shape.attention_flops_per_token(ours.avg_context) / 1e6:.1f} MFLOP/token at "
        f"context {ours.avg_context:.0f})"
    )
    return ceil_wl


def print_agreement(ours: Ours, hf: HFResult) -> None:
    same = sum(a == b for a, b in zip(ours.tokens, hf.tokens, strict=True))
    prefix = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a)) / len(a)
        for a, b in zip(ours.tokens, hf.tokens, strict=True)
    ]
    print(
        f"\noutputs identical to transformers: {same}/{len(ours.tokens)} requests; "
        f"mean agreeing prefix {sum(prefix) / len(prefix):.1%} of each output"
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    m = set_up(args, f"  interop {torch.get_num_interop_threads()}")
    wl = describe(args, m)
    ceilings, ceiling_cores = matmul_ceiling(args, m.shape)
    contention = {"ceiling": round(ceiling_cores, 2)}

    warm = make_workload(4, (8, 64), (4, 8), m.shape.vocab, args.seed + 7)
    ours = run_ours_on(args, m, wl, warm)
    contention["ours"] = round(ours.contention, 2)
    hf, sweep_rows = None, []
    if m.hf is not None:
        hf, sweep_rows, hf_cores = run_transformers(args, m.hf, wl, warm)
        contention["hf"] = round(hf_cores, 2)

    hf_tps, ratio = print_throughput(args, wl, ours, hf)
    ceil_wl = print_decode(args, m.shape, ours, ceilings)
    if hf:
        print_agreement(ours, hf)
    ours_tps = wl.output_tokens / ours.wall
    result = {
        "bench": "engine_vs_hf",
        "quick": args.quick,
        "seed": args.seed,
        "threads": m.threads,
        "num_requests": len(wl.prompts),
        "params": m.params,
        "prompt_tokens": wl.prompt_tokens,
        "useful_output_tokens": wl.output_tokens,
        "ours_wall_s": round(ours.wall, 3),
        "ours_tok_s": round(ours_tps, 2),
        "hf_batch_size": args.hf_batch_size if hf else None,
        "hf_wall_s": round(hf.wall, 3) if hf else None,
        "hf_tok_s": round(hf_tps, 2) if hf else None,
        "ratio": round(ratio, 3) if hf else None,
        "ours_decode_tok_s_in_workload": round(ours.decode_tps, 2),
        "ours_decode_avg_batch": round(ours.avg_batch, 1),
        "ours_decode_probe_tok_s": round(ours.probe_tps, 2) if ours.probe_tps else None,
        "ceiling_tok_s_at_avg_batch": round(ceil_wl.tokens_per_s, 1),
        "ceiling_tok_s_bs256": round(ceilings[256].tokens_per_s, 1),
        "matmul_gflops_bs256": round(ceilings[256].flops_per_s / 1e9, 2),
        "decode_frac_of_ceiling": round(ours.decode_tps / ceil_wl.tokens_per_s, 4),
        "other_process_cores": contention,
        "allocator": allocator(),
        "hf_sweep": [
            {"bs": int(b), "wall_s": float(w), "tok_s": float(t.replace(",", ""))}
            for b, w, t in sweep_rows
        ],
    }
    print_result(result)
    m.cleanup()
    return result


if __name__ == "__main__":
    main()
