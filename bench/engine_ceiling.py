"""How near the machine's limit the engine runs on its defaults: in one process, the best
matrix-product rate of this machine at the model's shapes, the FLOPs a mixed evaluation
workload needs (`workload_flops`), the engine's time for it with no options given, and
transformers' `generate` in the dtype the engine chose.

The workload: `--requests` (128) prompts of 32-400 random tokens, 16-128 generated tokens each
(EOS ignored, so every request generates its count), greedy. The model is the benchmarks'
random ~56M-parameter Llama. The engine is `LLM(path)`: dtype, attention backend, batch sizes
are its defaults (bfloat16 and the compiled attention on a CPU with fast bfloat16), warmed up
with `warm_up()` as a worker is before it takes work.

The ceiling: `F.linear` timed at every projection's shape at 64, 256 and 2,048 rows in the
engine's dtype; the best rate of all is the machine's ceiling. The workload's FLOPs: the
projections for every prompt and generated token (of the last layer, only q/k/v for a prompt
token before the last, whose hidden state nobody reads), the output layer for the rows sampled,
and attention over each token's context. Goals: >= 50% of the ceiling on defaults, and >= 5x
transformers `generate` at the same dtype on the same requests: static batches of `--hf-batch`
(32, its best here: on 128 of these requests in bfloat16, batches of 16 and 32 tied at 421
tok/s, 64 gave 416, 128 gave 275, and 8 ran 10-30% slower than 32), left-padded, each batch
generating its longest request's count; only each request's own tokens count.

The VM's speed drifts by tens of percent within minutes, and transformers' rate (small batches,
more memory-bound) drifts with it differently from ours. So the comparison runs in `--rounds`
(3) rounds, each on new prompts: the engine, then transformers on the same requests. Each
round gives a ratio under the same conditions; the headline is the median.

    python bench/engine_ceiling.py           # ~2.5 minutes
    python bench/engine_ceiling.py --quick   # 32 requests, one round

The last line printed is one JSON object with the headline numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from datetime import date

import torch
from engine_vs_hf import Workload, make_workload, run_hf, time_linear
from machine import cpu_isa, git_state, loadavg
from random_llama import BenchModel, ModelShape, parse_rounds, rounds_parser, set_up
from report import print_result, rule, table

from conveyor.engine import LLM, SamplingParams

GOAL_CEILING = 0.5
GOAL_VS_HF = 5.0
ROWS = (64, 256, 2048)


def best_rate(shape: ModelShape, dtype: torch.dtype) -> tuple[float, list[tuple]]:
    """The best FLOP/s of F.linear at the model's shapes, and the table of all of them."""
    rows, best = [], 0.0
    for name, k, n, _ in shape.linears():
        rates = [2 * m * k * n / time_linear(m, k, n, dtype=dtype) for m in ROWS]
        best = max(best, *rates)
        rows.append((name, f"{k} x {n}", *(f"{r / 1e9:,.0f}" for r in rates)))
    return best, rows


def workload_flops(shape: ModelShape, prompts: list[list[int]], counts: list[int]) -> float:
    """What the answer needs: the projections for every token, except that a token whose
    hidden state nobody reads (a prompt token before the last) needs of the last layer only
    its q/k/v (its K/V); the output layer for each sampled row; attention over each token's
    context (causal)."""
    lm_head = 2 * shape.hidden * shape.vocab
    per_layer = (shape.matmul_flops_per_token() - lm_head) / shape.layers
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    last_layer_unread = per_layer - 2 * shape.hidden * (q + 2 * kv)  # o_proj and the MLP
    flops = 0.0
    for prompt, count in zip(prompts, counts, strict=True):
        tokens = len(prompt) + count - 1  # the last token is sampled, never computed
        unread = len(prompt) - 1  # prompt tokens before the one whose row is sampled
        flops += tokens * per_layer * shape.layers - unread * last_layer_unread
        flops += count * lm_head
        mean_context = (tokens + 1) / 2
        flops += tokens * shape.attention_flops_per_token(mean_context)
    return flops


def start_engine(path: str) -> tuple[LLM, float]:
    """The engine on its defaults, warmed up as a worker warms it up before taking work (its
    kernels built for every decode batch size): (engine, seconds)."""
    start = time.perf_counter()
    llm = LLM(path)
    llm.warm_up()
    return llm, time.perf_counter() - start


def run_engine(llm: LLM, wl: Workload) -> float:
    """Seconds for the workload (its prompts are new to the engine's prefix cache)."""
    params = [SamplingParams(temperature=0, max_tokens=c, ignore_eos=True) for c in wl.output_lens]
    start = time.perf_counter()
    outputs = llm.generate(wl.prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == wl.output_lens
    return seconds


@dataclass
class Round:
    seed: int
    flops: float
    engine_seconds: float
    engine_rate: float  # generated tokens/s
    hf_rate: float


def run_round(args, m: BenchModel, llm: LLM, hf, seed: int) -> Round:
    """The engine on `--requests` new requests, then transformers on the same requests, one
    after the other: both under the VM's speed of the moment."""
    wl = make_workload(args.requests, (32, 400), (16, 128), m.shape.vocab, seed)
    seconds = run_engine(llm, wl)
    hf_result = run_hf(hf, wl, args.hf_batch)
    r = Round(seed, workload_flops(m.shape, wl.prompts, wl.output_lens), seconds,
              wl.output_tokens / seconds, wl.output_tokens / hf_result.wall)  # fmt: skip
    number = (seed - args.seed) // 10
    print(f"round {number}: {args.requests} requests ({wl.prompt_tokens:,} prompt, "
          f"{wl.output_tokens:,} generated tokens): engine {seconds:.2f} s, "
          f"{r.engine_rate:,.0f} tok/s; transformers {r.hf_rate:,.0f} tok/s: "
          f"{r.engine_rate / r.hf_rate:.2f}x", flush=True)  # fmt: skip
    return r


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = rounds_parser(__doc__.split("\n\n")[0], rounds=3)
    ap.add_argument("--hf-batch", type=int, default=32)
    return parse_rounds(ap, argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    m: BenchModel = set_up(args)
    try:
        rule("engine, on its defaults")
        llm, warm_seconds = start_engine(str(m.path))
        dtype = llm.dtype
        name = str(dtype).removeprefix("torch.")
        print(f"dtype {name}, attention {llm.runner.backend.name}; start and warm-up "
              f"{warm_seconds:.1f} s")  # fmt: skip
        rule(f"matrix products in {name}")
        ceiling, rows = best_rate(m.shape, dtype)
        table(rows, ("product", "in x out", *(f"GFLOP/s at {r} rows" for r in ROWS)))
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(m.path), dtype=dtype).eval()
        hf.generation_config.eos_token_id = None
        rule(f"rounds: the engine, then transformers generate ({args.hf_batch} a batch)")
        rounds = [run_round(args, m, llm, hf, args.seed + 10 * (i + 1)) for i in range(args.rounds)]
        return report(args, rounds, ceiling, dtype)
    finally:
        m.cleanup()


def report(args, rounds: list[Round], ceiling: float, dtype) -> dict:
    rule("results")
    shares = [r.flops / ceiling / r.engine_seconds for r in rounds]
    ratios = [r.engine_rate / r.hf_rate for r in rounds]
    share, vs_hf = statistics.median(shares), statistics.median(ratios)
    print(f"ceiling {ceiling / 1e9:,.0f} GFLOP/s; per round: share of it "
          f"{', '.join(f'{x:.1%}' for x in shares)}; vs transformers "
          f"{', '.join(f'{x:.2f}x' for x in ratios)} (medians below)")  # fmt: skip
    for name, value, goal, unit in (("share of the ceiling", share, GOAL_CEILING, "%"),
                                    ("vs transformers", vs_hf, GOAL_VS_HF, "x")):  # fmt: skip
        shown = f"{value:.1%}" if unit == "%" else f"{value:.2f}x"
        target = f"{goal:.0%}" if unit == "%" else f"{goal:.0f}x"
        print(f"{name}: {shown} (goal >= {target}): {'MET' if value >= goal else 'NOT met'}")
    result = {
        "bench": "engine_ceiling",
        "requests": args.requests,
        "rounds": len(rounds),
        "dtype": str(dtype).removeprefix("torch."),
        "workload_tflop": round(statistics.median(r.flops for r in rounds) / 1e12, 3),
        "ceiling_gflops": round(ceiling / 1e9, 1),
        "engine_seconds": [round(r.engine_seconds, 2) for r in rounds],
        "engine_tokens_per_s": [round(r.engine_rate, 1) for r in rounds],
        "hf_tokens_per_s": [round(r.hf_rate, 1) for r in rounds],
        "share_of_ceiling": round(share, 4),
        "vs_transformers": round(vs_hf, 2),
        "vs_transformers_rounds": [round(x, 2) for x in ratios],
        "goal_ceiling_met": share >= GOAL_CEILING,
        "goal_vs_hf_met": vs_hf >= GOAL_VS_HF,
        "cpu_isa": cpu_isa(),
        "loadavg": loadavg(),
        "date": date.today().isoformat(),
        "code": git_state(),
    }
    print_result(result)
    return result


if __name__ == "__main__":
    main()
