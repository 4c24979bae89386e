"""What batch-invariant mode costs: the same greedy workload on the engine's defaults and with
`batch_invariant=True` (`--batch-invariant`), in one process, and a check that the mode does
what it promises on that workload.

The workload: `--requests` (128) prompts of 32-400 random tokens, 16-128 generated tokens each
(EOS ignored), greedy, on the benchmarks' random ~56M-parameter Llama; both engines otherwise
on their defaults (dtype, attention, batch sizes) and warmed up as a worker is. Each of
`--rounds` (5) rounds runs both on new prompts, default first in odd rounds and invariant first
in even ones, so the machine's drift falls on both alike; the headline is the median of the
rounds' time ratios (invariant over default), goal <= 1.20.

The check: the first `CHECKED` requests run again one at a time on the invariant engine give
the tokens and logprobs of the batch run, bit for bit.

    python bench/batch_invariant.py           # ~2 minutes
    python bench/batch_invariant.py --quick   # 32 requests, one round

The last line printed is one JSON object with the headline numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import date

from engine_vs_hf import Workload, make_workload
from machine import cpu_isa, git_state
from random_llama import BenchModel, parse_rounds, rounds_parser, set_up
from report import print_result, rule, table

from conveyor.engine import LLM, SamplingParams

GOAL = 1.20
CHECKED = 8


def params_of(workload: Workload) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
        for n in workload.output_lens
    ]


def timed(llm: LLM, workload: Workload) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params_of(workload), use_tqdm=False)
    return time.perf_counter() - start, outputs


def same_alone(llm: LLM, workload: Workload, outputs: list) -> bool:
    """Whether the first requests, each run alone, give the batch's tokens and logprobs."""
    params = params_of(workload)
    for prompt, p, batched in zip(workload.prompts, params, outputs[:CHECKED], strict=False):
        alone = llm.generate([prompt], [p], use_tqdm=False)[0].outputs[0]
        if (alone.token_ids, alone.logprobs) != (batched.outputs[0].token_ids,
                                                 batched.outputs[0].logprobs):  # fmt: skip
            return False
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = rounds_parser(__doc__.split("\n\n")[0], rounds=5)
    ap.add_argument("--dtype", default="auto", help="both engines' dtype (default: theirs)")
    return parse_rounds(ap, argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    m: BenchModel = set_up(args)
    try:
        engines = {
            "default": LLM(str(m.path), dtype=args.dtype),
            "invariant": LLM(str(m.path), dtype=args.dtype, batch_invariant=True),
        }
        for llm in engines.values():
            llm.warm_up()
        dtype = str(engines["default"].dtype).removeprefix("torch.")
        rule("rounds")
        rows, ratios, identical = [], [], True
        for r in range(args.rounds):
            workload = make_workload(args.requests, (32, 400), (16, 128), m.shape.vocab,
                                     args.seed + r)  # fmt: skip
            order = ["default", "invariant"][:: 1 if r % 2 == 0 else -1]
            runs = {name: timed(engines[name], workload) for name in order}
            (default_s, _), (invariant_s, outputs) = runs["default"], runs["invariant"]
            identical = identical and same_alone(engines["invariant"], workload, outputs)
            ratios.append(invariant_s / default_s)
            rows.append((r + 1, f"{default_s:.2f}", f"{invariant_s:.2f}", f"{ratios[-1]:.3f}"))
            print(f"round {r + 1}: default {default_s:.2f} s, invariant {invariant_s:.2f} s",
                  flush=True)  # fmt: skip
        rule("results")
        table(rows, ("round", "default s", "batch-invariant s", "ratio"))
        ratio = statistics.median(ratios)
        print(f"batch-invariant mode: {ratio:.3f}x the default's time (goal <= {GOAL}): "
              f"{'MET' if ratio <= GOAL else 'NOT met'}; requests alone equal to the batch, "
              f"bit for bit: {'yes' if identical else 'NO'}")  # fmt: skip
        result = {
            "bench": "batch_invariant",
            "ratio": round(ratio, 3),
            "ratios": [round(x, 3) for x in ratios],
            "goal_met": ratio <= GOAL,
            "identical_alone": identical,
            "requests": args.requests,
            "dtype": dtype,
            "threads": m.threads,
            "cpu_isa": cpu_isa(),
            "git": git_state(),
            "date": date.today().isoformat(),
        }
    finally:
        m.cleanup()
    print_result(result)
    return result


if __name__ == "__main__":
    main()
