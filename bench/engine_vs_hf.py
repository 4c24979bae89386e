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
import json
import math
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from report import rule, table  # noqa: E402

from conveyor.demo_model import write_tiny_model  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

# ---------------------------------------------------------------------------------------------
# model and workload


def model_overrides(args: argparse.Namespace) -> dict:
    return dict(
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_position_embeddings,
    )


def add_model_arguments(ap: argparse.ArgumentParser, max_positions: int) -> None:
    """The shape of the ~56M-parameter benchmark Llama (see `model_overrides`)."""
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--intermediate-size", type=int, default=1408)
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--num-heads", type=int, default=8)
    ap.add_argument("--num-kv-heads", type=int, default=4)
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--max-position-embeddings", type=int, default=max_positions)
    ap.add_argument(
        "--attention-backend",
        default="compiled",
        help="our engine's attention: compiled (decode compiled by torch.compile, the fastest "
        "on a CPU; its one compile happens in the warm-up) or torch (eager)",
    )


def write_model(path: Path, seed: int, overrides: dict) -> None:
    write_tiny_model(path, "llama", with_tokenizer=False, seed=seed, **overrides)


@dataclass
class ModelShape:
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, cfg) -> ModelShape:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            head_dim,
            cfg.vocab_size,
        )

    def linears(self) -> list[tuple[str, int, int, int]]:
        """(name, in_features, out_features, count per model) of every decode matmul."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        n = self.layers
        return [
            ("q_proj", h, q, n),
            ("k_proj", h, kv, n),
            ("v_proj", h, kv, n),
            ("o_proj", q, h, n),
            ("gate_proj", h, self.inter, n),
            ("up_proj", h, self.inter, n),
            ("down_proj", self.inter, h, n),
            ("lm_head", h, self.vocab, 1),
        ]

    def matmul_flops_per_token(self) -> int:
        return sum(2 * i * o * c for _, i, o, c in self.linears())

    def attention_flops_per_token(self, context: float) -> float:
        # q.k and p.v for every head over `context` cached positions
        return 4.0 * self.layers * self.heads * self.head_dim * context


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
# CPU contention: on a shared machine other processes steal cores and wreck the timings


class CpuMeter:
    """CPU seconds used by other processes between `start()` and `stop()` (Linux /proc/stat)."""

    def __init__(self) -> None:
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.t0 = self.wall0 = None
        self.other_cores = float("nan")

    def _read(self) -> tuple[float, float] | None:
        try:
            with open("/proc/stat") as f:
                vals = [int(v) for v in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        busy = (sum(vals) - vals[3] - vals[4]) / self.hz  # minus idle and iowait
        own = os.times()
        return busy, own.user + own.system

    def start(self) -> CpuMeter:
        self.t0, self.wall0 = self._read(), time.perf_counter()
        return self

    def stop(self) -> str:
        t1 = self._read()
        if self.t0 is None or t1 is None:
            return "other processes: unknown"
        wall = time.perf_counter() - self.wall0
        other = max(0.0, (t1[0] - self.t0[0]) - (t1[1] - self.t0[1]))
        self.other_cores = other / max(wall, 1e-9)
        warn = "  << CONTENDED, timings unreliable" if self.other_cores > 0.15 else ""
        return f"other processes used {self.other_cores:.2f} cores on average{warn}"


def allocator() -> str:
    """Which malloc serves torch's CPU tensors; it matters, since large per-step temporaries
    are mmapped and page-faulted afresh by glibc but kept for reuse by a tuned jemalloc."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "unknown"
    for name in ("jemalloc", "tcmalloc", "mimalloc"):
        if name in maps:
            conf = os.environ.get("MALLOC_CONF") or os.environ.get("TCMALLOC_RELEASE_RATE") or ""
            return f"{name} {conf}".strip()
    return "glibc malloc"


# ---------------------------------------------------------------------------------------------
# matmul ceiling


def time_linear(m: int, k: int, n: int, min_time: float = 0.3, min_calls: int = 30) -> float:
    """Seconds per F.linear of x[m, k] by W[n, k] (what nn.Linear runs), fp32.

    Each call is timed on its own and the 20th percentile is kept: a ceiling should be
    optimistic, and on a shared machine a call that waited for a descheduled thread says
    nothing about the hardware.
    """
    x = torch.randn(m, k)
    w = torch.randn(n, k)
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


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    # generate exactly max_new_tokens: no EOS at all, rather than suppressing it with
    # min_new_tokens (which would change greedy picks compared with ignore_eos on our side)
    model.generation_config.eos_token_id = None
    return model


def hf_generate_batch(model, prompts: list[list[int]], max_new: int, pad_id: int):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad_id,
        )
    gen = out[:, width:]
    assert gen.shape[1] == max_new, f"transformers generated {gen.shape[1]} of {max_new} tokens"
    return gen, width


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
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for both (default: torch's default, the core count)",
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
    ap.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="write (or reuse) the checkpoint here instead of a temp dir",
    )
    # engine knobs
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    # model shape: ~56M parameters
    add_model_arguments(ap, max_positions=1024)
    args = ap.parse_args(argv)
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


def print_setup(threads: int, extra: str = "") -> None:
    """The lines every benchmark starts with: machine load, allocator, versions, threads."""
    if hasattr(os, "getloadavg"):
        print(f"load average at start: {os.getloadavg()[0]:.2f} (1 min)")
    print(f"allocator: {allocator()}")
    print(
        f"python {platform.python_version()}  torch {torch.__version__}  "
        f"cpu {platform.processor() or platform.machine()}  cores {os.cpu_count()}  "
        f"torch threads {threads}{extra}"
    )


def prepare_model(
    args: argparse.Namespace, overrides: dict
) -> tuple[tempfile.TemporaryDirectory | None, Path]:
    """The checkpoint directory (a temp dir unless --model-dir), written if not there yet."""
    tmp = None
    if args.model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="conveyor-bench-")
        model_dir = Path(tmp.name) / "llama"
    else:
        model_dir = args.model_dir
    if not (model_dir / "config.json").exists():
        t = time.perf_counter()
        write_model(model_dir, args.seed, overrides)
        print(f"wrote random-weight llama to {model_dir} in {time.perf_counter() - t:.1f}s")
    return tmp, model_dir


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    torch.manual_seed(args.seed)

    rule("setup")
    print_setup(threads, f"  interop {torch.get_num_interop_threads()}")
    tmp, model_dir = prepare_model(args, model_overrides(args))

    hf_model = None if args.skip_hf else load_hf(model_dir)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_dir))
    shape = ModelShape.from_config(cfg)
    if hf_model is not None:
        n_params = sum(p.numel() for p in hf_model.parameters())
    else:
        n_params = (
            shape.matmul_flops_per_token() // 2
            + shape.vocab * shape.hidden
            + shape.layers * 2 * shape.hidden
            + shape.hidden
        )
    n_embed = shape.vocab * shape.hidden
    print(
        f"model: llama hidden {shape.hidden}, intermediate {shape.inter}, layers {shape.layers}, "
        f"heads {shape.heads}/{shape.kv_heads} kv (head_dim {shape.head_dim}), "
        f"vocab {shape.vocab}"
    )
    print(
        f"parameters: {n_params:,} total = {n_params - 2 * n_embed:,} in layers + "
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

    # ---- matmul ceiling
    rule("matmul ceiling (F.linear, fp32, at the model's decode shapes)")
    batches = sorted({1, 16, 64, 128, args.decode_batch, 256})
    meter = CpuMeter().start()
    ceilings = measure_ceiling(shape, batches)
    flops_tok = shape.matmul_flops_per_token()
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
    print(meter.stop())
    contention = {"ceiling": round(meter.other_cores, 2)}

    # ---- ours
    rule("ours: engine.LLM")
    t = time.perf_counter()
    llm = LLM(
        str(model_dir),
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
    warm = make_workload(4, (8, 64), (4, 8), shape.vocab, args.seed + 7)
    run_ours(llm, warm)
    meter = CpuMeter().start()
    ours_wall, ours_tokens, log = run_ours(llm, wl)
    print(meter.stop())
    contention["ours"] = round(meter.other_cores, 2)
    ours_tps = wl.output_tokens / ours_wall
    stats = llm.stats()
    print(
        f"wall {ours_wall:.2f}s, {wl.output_tokens / ours_wall:,.1f} useful tok/s, "
        f"{(wl.prompt_tokens + wl.output_tokens) / ours_wall:,.1f} total (prompt+gen) tok/s, "
        f"{len(log.per_step)} steps, preemptions {stats.num_preemptions}"
    )
    avg_b = log.decode_batch_sum / max(1, log.decode_steps)
    avg_ctx = log.decode_context_sum / max(1, log.decode_batch_sum)
    wl_decode_tps = log.decode_tokens / log.decode_time if log.decode_time else float("nan")
    print(
        f"  pure-decode steps: {log.decode_steps}, {log.decode_time:.2f}s, "
        f"{log.decode_tokens:,} tok -> {wl_decode_tps:,.1f} tok/s "
        f"(avg batch {avg_b:.1f}, avg context {avg_ctx:.0f})"
    )
    print(
        f"  steps with prompt work: {log.other_steps}, {log.other_time:.2f}s, "
        f"{log.other_tokens:,} tok sampled"
    )

    probe = None
    if not args.skip_decode_probe:
        probe = decode_probe(
            llm,
            args.decode_batch,
            args.decode_prompt_len,
            args.decode_steps,
            shape.vocab,
            args.seed,
        )
        probe_tps = probe.decode_tokens / probe.decode_time
        print(
            f"decode probe: batch {args.decode_batch}, context {args.decode_prompt_len}-"
            f"{args.decode_prompt_len + args.decode_steps}: {probe.decode_steps} steps, "
            f"{probe_tps:,.1f} tok/s "
            f"({probe.decode_time / probe.decode_steps * 1e3:.1f} ms/step)"
        )

    # ---- transformers
    hf = None
    sweep_rows = []
    if hf_model is not None:
        rule(f"transformers generate, static batches of {args.hf_batch_size} in input order")
        hf_generate_batch(hf_model, warm.prompts[:2], 4, 0)  # warm-up
        if args.hf_sweep:
            sub = Workload(wl.prompts[:64], wl.output_lens[:64])
            for bs in args.hf_sweep:
                r = run_hf(hf_model, sub, bs)
                sweep_rows.append((bs, f"{r.wall:.2f}", f"{sub.output_tokens / r.wall:,.1f}"))
                print(
                    f"  sweep: batch {bs}: {r.wall:.2f}s, "
                    f"{sub.output_tokens / r.wall:,.1f} useful tok/s",
                    flush=True,
                )
        meter = CpuMeter().start()
        hf = run_hf(hf_model, wl, args.hf_batch_size)
        print(meter.stop())
        contention["hf"] = round(meter.other_cores, 2)
        print(
            f"wall {hf.wall:.2f}s, {wl.output_tokens / hf.wall:,.1f} useful tok/s; "
            f"{len(hf.batch_times)} batches; computed {hf.padded_prompt_tokens:,} padded prompt "
            f"tokens ({wl.prompt_tokens / hf.padded_prompt_tokens:.0%} real) and generated "
            f"{hf.generated_tokens:,} tokens ({wl.output_tokens / hf.generated_tokens:.0%} "
            f"useful)"
        )

    # ---- summary
    rule("summary")
    hf_tps = wl.output_tokens / hf.wall if hf else float("nan")
    ratio = ours_tps / hf_tps if hf else float("nan")
    rows = [("ours (engine.LLM)", f"{ours_wall:.2f}", f"{ours_tps:,.1f}", "")]
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

    def ceiling_for(batch: float) -> Ceiling:
        nearest = min(ceilings, key=lambda m: abs(math.log(m) - math.log(max(batch, 1))))
        return ceilings[nearest]

    ceil_max = ceilings[max(ceilings)]
    ceil_wl = ceiling_for(avg_b)
    print()
    drows = [
        (
            "decode steps inside the workload",
            f"{avg_b:.0f}",
            f"{avg_ctx:.0f}",
            f"{wl_decode_tps:,.1f}",
            f"{ceil_wl.tokens_per_s:,.0f} @bs{ceil_wl.batch}",
            f"{wl_decode_tps / ceil_wl.tokens_per_s:.1%}",
            f"{wl_decode_tps / ceil_max.tokens_per_s:.1%}",
        )
    ]
    probe_tps = None
    if probe is not None:
        probe_tps = probe.decode_tokens / probe.decode_time
        ctx = probe.decode_context_sum / probe.decode_batch_sum
        c = ceiling_for(args.decode_batch)
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
    table(
        drows,
        (
            "ours, decode only",
            "batch",
            "ctx",
            "tok/s",
            "matmul ceiling",
            "of ceiling",
            f"of bs{ceil_max.batch} ceiling",
        ),
    )
    print(
        f"(ceiling = measured matmul FLOP/s / {flops_tok / 1e6:.1f} MFLOP per token; attention "
        f"would add {shape.attention_flops_per_token(avg_ctx) / 1e6:.1f} MFLOP/token at "
        f"context {avg_ctx:.0f})"
    )

    if hf:
        same = sum(a == b for a, b in zip(ours_tokens, hf.tokens, strict=True))
        prefix = [
            next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a)) / len(a)
            for a, b in zip(ours_tokens, hf.tokens, strict=True)
        ]
        print(
            f"\noutputs identical to transformers: {same}/{len(ours_tokens)} requests; "
            f"mean agreeing prefix {sum(prefix) / len(prefix):.1%} of each output"
        )

    result = {
        "bench": "engine_vs_hf",
        "quick": args.quick,
        "seed": args.seed,
        "threads": threads,
        "num_requests": len(wl.prompts),
        "params": n_params,
        "prompt_tokens": wl.prompt_tokens,
        "useful_output_tokens": wl.output_tokens,
        "ours_wall_s": round(ours_wall, 3),
        "ours_tok_s": round(ours_tps, 2),
        "hf_batch_size": args.hf_batch_size if hf else None,
        "hf_wall_s": round(hf.wall, 3) if hf else None,
        "hf_tok_s": round(hf_tps, 2) if hf else None,
        "ratio": round(ratio, 3) if hf else None,
        "ours_decode_tok_s_in_workload": round(wl_decode_tps, 2),
        "ours_decode_avg_batch": round(avg_b, 1),
        "ours_decode_probe_tok_s": round(probe_tps, 2) if probe_tps else None,
        "ceiling_tok_s_at_avg_batch": round(ceil_wl.tokens_per_s, 1),
        "ceiling_tok_s_bs256": round(ceilings[256].tokens_per_s, 1),
        "matmul_gflops_bs256": round(ceilings[256].flops_per_s / 1e9, 2),
        "decode_frac_of_ceiling": round(wl_decode_tps / ceil_wl.tokens_per_s, 4),
        "other_process_cores": contention,
        "allocator": allocator(),
        "hf_sweep": [
            {"bs": int(b), "wall_s": float(w), "tok_s": float(t.replace(",", ""))}
            for b, w, t in sweep_rows
        ],
    }
    print(json.dumps(result), flush=True)
    if tmp is not None:
        tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
