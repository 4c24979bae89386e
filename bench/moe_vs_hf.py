"""A mixture-of-experts model through the engine against transformers' `generate` at its best
static batch size: a random-weight Qwen3-MoE shaped as Qwen3-30B-A3B scaled down to fit a small
machine (64 experts, 8 per token, as 128/8 there), saved in bfloat16 as that model ships
(`--checkpoint-dtype`), greedy, in the dtype the engine picks on its defaults (bfloat16 on a CPU
with fast bfloat16 products, else float32) for both, same threads, one process.
transformers runs its own grouped-product experts (its default `grouped_mm`); the engine runs
its plan's (on an x86 CPU its own kernels, `kernels/native_experts.py`; `--experts grouped`
runs the same grouped products as transformers, so that the ratio is the engine's paging,
batching and scheduling alone).

transformers runs the whole workload at each batch size of `--hf-batch-sizes` (16 to all 128 at
once) and its best is compared; with `--sweep-requests N` the sizes are tried on the first N
requests and the best then runs the whole workload. Each side's greedy tokens are compared too
(float32: they should match).

    python bench/moe_vs_hf.py               # 128 requests, prompts 32-256, outputs 16-128
    python bench/moe_vs_hf.py --quick       # 24 small requests, a smaller model

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch
from engine_vs_hf import Workload, make_workload, run_hf
from machine import cpu_isa, git_state, loadavg
from random_llama import hf_generate_batch, load_hf, print_setup
from report import print_result, rule, table

from conveyor.demo_model import write_tiny_model
from conveyor.engine import LLM, SamplingParams

GOAL_RATIO = 5.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: small model and workload")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    # up to the whole workload at once (the largest tried has been transformers' best), each on
    # the whole workload: the best of them is the run compared
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--sweep-requests", type=int, default=None, help="default: the whole workload")
    ap.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
        help="the engine's dtype (auto: its default on this machine); transformers runs in it",
    )  # fmt: skip
    ap.add_argument(
        "--checkpoint-dtype", default="bfloat16", choices=["float32", "bfloat16"],
        help="the dtype the random checkpoint is saved in (bfloat16: as real ones ship)",
    )  # fmt: skip
    ap.add_argument("--experts", default="auto", choices=["auto", "native", "grouped"],
                    help="how the engine runs the experts (auto: its plan's choice)")  # fmt: skip
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--num-experts", type=int, default=64)
    ap.add_argument("--experts-per-token", type=int, default=8)
    ap.add_argument("--moe-intermediate-size", type=int, default=192)
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.num_requests, args.prompt_len, args.output_len = 24, [16, 64], [8, 32]
        args.hf_batch_sizes = [8, 24]
        args.num_layers, args.num_experts, args.vocab_size = 4, 16, 8000
    if args.sweep_requests is None:
        args.sweep_requests = args.num_requests
    return args


def write_model(args: argparse.Namespace, root: Path) -> Path:
    return write_tiny_model(
        root / "qwen3_moe", "qwen3_moe", with_tokenizer=False, seed=args.seed,
        vocab_size=args.vocab_size, hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers, num_attention_heads=8, num_key_value_heads=4,
        head_dim=args.hidden_size // 8, num_experts=args.num_experts,
        num_experts_per_tok=args.experts_per_token,
        moe_intermediate_size=args.moe_intermediate_size, intermediate_size=4 * args.hidden_size,
        tie_word_embeddings=False, max_position_embeddings=1024, init_std=0.02,
        dtype=args.checkpoint_dtype,
    )  # fmt: skip


def run_ours(llm: LLM, wl: Workload) -> tuple[float, list[list[int]]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    started = time.perf_counter()
    outputs = llm.generate(wl.prompts, params, use_tqdm=False)
    return time.perf_counter() - started, [o.outputs[0].token_ids for o in outputs]


def sweep_transformers(model, wl: Workload, args: argparse.Namespace) -> tuple[int, list, Any]:
    """transformers' useful tokens per second on the first requests at each batch size; its
    best batch size, the rows, and the best run when the sweep covered the whole workload
    (else None)."""
    sub = Workload(wl.prompts[: args.sweep_requests], wl.output_lens[: args.sweep_requests])
    rows, best, best_run = [], (0.0, args.hf_batch_sizes[0]), None
    for bs in args.hf_batch_sizes:
        r = run_hf(model, sub, bs)
        tps = sub.output_tokens / r.wall
        rows.append((bs, f"{r.wall:.2f}", f"{tps:,.1f}"))
        print(f"  batch {bs}: {r.wall:.2f}s, {tps:,.1f} useful tok/s", flush=True)
        if (tps, bs) > best:
            best, best_run = (tps, bs), r
    whole = len(sub.prompts) == len(wl.prompts)
    return best[1], rows, best_run if whole else None


def summarize(
    args, dtype: str, output_tokens: int, ours_wall: float, hf_wall: float, best_bs: int
) -> dict:
    """The summary table, and the result without the outputs' comparison."""
    ours_tps, hf_tps = output_tokens / ours_wall, output_tokens / hf_wall
    ratio = ours_tps / hf_tps
    rule("summary")
    table(
        [("ours (engine.LLM)", f"{ours_wall:.2f}", f"{ours_tps:,.1f}"),
         (f"transformers (batch {best_bs})", f"{hf_wall:.2f}", f"{hf_tps:,.1f}"),
         ("ratio", "", f"{ratio:.2f}x (goal >= {GOAL_RATIO}x)")],
        ("", "wall s", "useful tok/s"),
    )  # fmt: skip
    return {
        "bench": "moe_vs_hf",
        "quick": args.quick,
        "dtype": dtype,
        "checkpoint_dtype": args.checkpoint_dtype,
        "experts": args.num_experts,
        "experts_per_token": args.experts_per_token,
        "layers": args.num_layers,
        "hidden": args.hidden_size,
        "requests": args.num_requests,
        "ours_tok_s": round(ours_tps, 1),
        "hf_tok_s": round(hf_tps, 1),
        "hf_batch_size": best_bs,
        "ratio": round(ratio, 2),
        "goal_met": ratio >= GOAL_RATIO,
        "threads": torch.get_num_threads(),
        "loadavg": loadavg(),
        "cpu_isa": cpu_isa(),
        "date": date.today().isoformat(),
        "code": git_state(),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    rule("setup")
    print_setup(torch.get_num_threads())
    tmp = tempfile.TemporaryDirectory(prefix="conveyor-moe-")
    path = write_model(args, Path(tmp.name))
    wl = make_workload(
        args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.vocab_size,
        args.seed,
    )  # fmt: skip
    warm = make_workload(4, (8, 16), (4, 4), args.vocab_size, args.seed + 7)
    print(
        f"model: Qwen3-MoE hidden {args.hidden_size}, {args.num_layers} layers, "
        f"{args.num_experts} experts ({args.experts_per_token} per token, intermediate "
        f"{args.moe_intermediate_size}), vocab {args.vocab_size}; workload: "
        f"{len(wl.prompts)} requests, {wl.prompt_tokens:,} prompt and {wl.output_tokens:,} "
        "output tokens"
    )

    rule("ours: engine.LLM")
    llm = LLM(str(path), device="cpu", dtype=args.dtype, experts=args.experts)
    dtype, experts = llm.dtype, llm.plan.experts
    print(f"dtype {str(dtype).removeprefix('torch.')}, experts {experts}")
    run_ours(llm, warm)
    ours_wall, ours_tokens = run_ours(llm, wl)
    ours_tps = wl.output_tokens / ours_wall
    print(f"wall {ours_wall:.2f}s, {ours_tps:,.1f} useful tok/s")
    del llm

    rule("transformers generate: batch size sweep, then its best on the whole workload")
    model = load_hf(path).to(dtype)
    print(f"experts implementation: {model.config._experts_implementation}")
    hf_generate_batch(model, warm.prompts[:2], 4, 0)
    best_bs, sweep_rows, hf = sweep_transformers(model, wl, args)
    if hf is None:
        hf = run_hf(model, wl, best_bs)
    hf_tps = wl.output_tokens / hf.wall
    print(f"batch {best_bs}: wall {hf.wall:.2f}s, {hf_tps:,.1f} useful tok/s")

    tmp.cleanup()
    result = summarize(
        args, str(dtype).removeprefix("torch."), wl.output_tokens, ours_wall, hf.wall, best_bs
    )
    table(sweep_rows, ("transformers batch", "wall s (sweep)", "useful tok/s"))
    same = sum(a == b for a, b in zip(ours_tokens, hf.tokens, strict=True))
    print(f"greedy outputs equal to transformers': {same} of {len(wl.prompts)}")
    result["outputs_equal"] = same
    result["experts_run"] = experts
    print_result(result)
    return result


if __name__ == "__main__":
    main()
