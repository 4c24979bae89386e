"""How near the machine's limit the engine runs on its defaults: in one process, the best
matrix-product rate of this machine at the model's shapes, the FLOPs a mixed evaluation
workload needs, the engine's time for it with no options given, and transformers' `generate`
in the dtype the engine chose.

The workload: `--requests` (128) prompts of 32-400 random tokens, 16-128 generated tokens each
(EOS ignored, so every request generates its count), greedy. The model is the benchmarks'
random ~56M-parameter Llama. The engine is `LLM(path)`: dtype, attention backend, batch sizes
are its defaults (bfloat16 and the compiled attention on a CPU with fast bfloat16).

The ceiling: `F.linear` timed at every projection's shape at 64, 256 and 2,048 rows in the
engine's dtype; the best rate of all is the machine's ceiling. The workload's FLOPs: the
projections for every prompt and generated token, the output layer for the rows sampled, and
attention over each token's context. Goals: >= 25% of the ceiling on defaults, and >= 5x
transformers `generate` (static batches of 8, left-padded; only each request's own tokens count)
at the same dtype, on the first `--hf-requests` requests.

    python bench/engine_ceiling.py           # ~5 minutes
    python bench/engine_ceiling.py --quick   # 32 requests

The last line printed is one JSON object with the headline numbers.
"""

from __future__ import annotations

import argparse
import time

import torch
from engine_vs_hf import make_workload, run_hf, time_linear
from random_llama import BenchModel, ModelShape, add_model_arguments, add_run_arguments, set_up
from report import print_result, rule, table

from engine import LLM, SamplingParams

GOAL_CEILING = 0.25
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
    """Projections for every token, the output layer for each sampled row, attention over
    each token's context (causal)."""
    lm_head = 2 * shape.hidden * shape.vocab
    per_token = shape.matmul_flops_per_token() - lm_head
    flops = 0.0
    for prompt, count in zip(prompts, counts, strict=True):
        tokens = len(prompt) + count - 1  # the last token is sampled, never computed
        flops += tokens * per_token + count * lm_head
        mean_context = (tokens + 1) / 2
        flops += tokens * shape.attention_flops_per_token(mean_context)
    return flops


def run_engine(path: str, prompts, counts, warm) -> tuple[LLM, float, float]:
    """The engine on its defaults: (engine, seconds for the workload, seconds to warm up)."""
    start = time.perf_counter()
    llm = LLM(path)
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    warm_seconds = time.perf_counter() - start
    params = [SamplingParams(temperature=0, max_tokens=c, ignore_eos=True) for c in counts]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == counts
    return llm, seconds, warm_seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(ap, max_positions=1024)
    add_run_arguments(ap)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--hf-requests", type=int, default=32)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="32 requests, 8 for transformers")
    ap.set_defaults(skip_hf=True)
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.hf_requests = 32, 8
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    m: BenchModel = set_up(args)
    try:
        wl = make_workload(args.requests, (32, 400), (16, 128), m.shape.vocab, args.seed)
        warm = make_workload(4, (16, 64), (8, 8), m.shape.vocab, args.seed + 1).prompts
        rule("workload")
        print(f"{args.requests} requests, {wl.prompt_tokens:,} prompt tokens, "
              f"{wl.output_tokens:,} generated tokens")  # fmt: skip
        rule("engine, on its defaults")
        llm, seconds, warm_seconds = run_engine(str(m.path), wl.prompts, wl.output_lens, warm)
        dtype = llm.dtype
        name = str(dtype).removeprefix("torch.")
        print(f"dtype {name}, attention {llm.runner.backend.name}: {seconds:.2f} s "
              f"(start and warm-up {warm_seconds:.1f} s)")  # fmt: skip
        del llm
        rule(f"matrix products in {name}")
        ceiling, rows = best_rate(m.shape, dtype)
        table(rows, ("product", "in x out", *(f"GFLOP/s at {r} rows" for r in ROWS)))
        flops = workload_flops(m.shape, wl.prompts, wl.output_lens)
        share = flops / ceiling / seconds
        rule("transformers generate")
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(m.path), dtype=dtype).eval()
        hf.generation_config.eos_token_id = None
        subset = make_workload(args.hf_requests, (32, 400), (16, 128), m.shape.vocab, args.seed)
        hf_result = run_hf(hf, subset, args.hf_batch)
        hf_rate = subset.output_tokens / hf_result.wall
        ours_rate = wl.output_tokens / seconds
        print(f"{args.hf_requests} requests in {hf_result.wall:.2f} s: {hf_rate:,.1f} tok/s")
        return report(args, flops, ceiling, seconds, share, ours_rate, hf_rate, dtype)
    finally:
        m.cleanup()


def report(args, flops, ceiling, seconds, share, ours_rate, hf_rate, dtype) -> dict:
    rule("results")
    vs_hf = ours_rate / hf_rate
    print(f"workload: {flops / 1e12:.2f} TFLOP; ceiling {ceiling / 1e9:,.0f} GFLOP/s, so "
          f"{flops / ceiling:.2f} s at best; the engine took {seconds:.2f} s")  # fmt: skip
    for name, value, goal, unit in (("share of the ceiling", share, GOAL_CEILING, "%"),
                                    ("vs transformers", vs_hf, GOAL_VS_HF, "x")):  # fmt: skip
        shown = f"{value:.1%}" if unit == "%" else f"{value:.2f}x"
        target = f"{goal:.0%}" if unit == "%" else f"{goal:.0f}x"
        print(f"{name}: {shown} (goal >= {target}): {'MET' if value >= goal else 'NOT met'}")
    result = {
        "bench": "engine_ceiling",
        "requests": args.requests,
        "dtype": str(dtype).removeprefix("torch."),
        "workload_tflop": round(flops / 1e12, 3),
        "ceiling_gflops": round(ceiling / 1e9, 1),
        "engine_seconds": round(seconds, 2),
        "share_of_ceiling": round(share, 4),
        "engine_tokens_per_s": round(ours_rate, 1),
        "hf_tokens_per_s": round(hf_rate, 1),
        "vs_transformers": round(vs_hf, 2),
        "goal_ceiling_met": share >= GOAL_CEILING,
        "goal_vs_hf_met": vs_hf >= GOAL_VS_HF,
    }
    print_result(result)
    return result


if __name__ == "__main__":
    main()
