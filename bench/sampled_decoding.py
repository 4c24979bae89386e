"""What sampling costs against greedy decoding: one workload run greedy, at temperature 1, with
top-k 50 and with top-p 0.95, in one process, each run on new prompts, the settings in
another order each round; each sampled run's time over the greedy run's of its round.

The workload and model are bench/engine_ceiling.py's: `--requests` (128) prompts of 32-400
random tokens, 16-128 generated tokens each (EOS ignored), the benchmarks' random ~56M-parameter
Llama (a 32,000-token vocabulary) on the engine's defaults. Its rows are flat next to a trained
model's: top-p 0.95 keeps most of the vocabulary. The native draw finds such a nucleus without a
sort; torch's draw sorts the whole vocabulary for it (a trained model's peaked rows settle among
their 64 most likely tokens there, as top-k does).

    python bench/sampled_decoding.py                  # 2 rounds, ~2 minutes
    python bench/sampled_decoding.py --quick          # 32 requests, 1 round
    python bench/sampled_decoding.py --compare-draws  # also temperature 1 with torch's draw

With `--compare-draws`, where the engine's plan draws natively (`sampling native`), a second
engine on the same model with `sampling="torch"` runs temperature 1 in each round too: the
native draw against torch's softmax, float64 cumulative sum and search, in one process.

The last line printed is one JSON object with the headline numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import date

from engine_vs_hf import make_workload
from machine import cpu_isa, git_state
from random_llama import parse_rounds, rounds_parser, set_up
from report import print_result, rule, table

from conveyor.engine import LLM, SamplingParams

SETTINGS = {
    "greedy": {"temperature": 0},
    "temperature 1": {"temperature": 1.0},
    "top-k 50": {"temperature": 0.7, "top_k": 50},
    "top-p 0.95": {"temperature": 0.8, "top_p": 0.95},
}


TORCH_DRAW = "temperature 1, torch's draw"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = rounds_parser(__doc__.split("\n\n")[0], rounds=2)
    ap.add_argument(
        "--compare-draws",
        action="store_true",
        help="also run temperature 1 on a second engine with sampling='torch'",
    )
    return parse_rounds(ap, argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    m = set_up(args)
    try:
        llm = LLM(str(m.path))
        llm.warm_up()
        engines = {name: llm for name in SETTINGS}
        settings = dict(SETTINGS)
        if args.compare_draws and llm.plan.sampling == "native":
            engines[TORCH_DRAW] = LLM(str(m.path), sampling="torch")
            engines[TORCH_DRAW].warm_up()
            settings[TORCH_DRAW] = SETTINGS["temperature 1"]
        rule(f"{args.requests} requests, {str(llm.dtype).removeprefix('torch.')}")
        ratios: dict[str, list[float]] = {name: [] for name in settings if name != "greedy"}
        seed = args.seed
        for r in range(args.rounds):
            names = list(settings) if r % 2 == 0 else list(reversed(settings))
            seconds = {}
            for name in names:
                seed += 1
                wl = make_workload(args.requests, (32, 400), (16, 128), m.shape.vocab, seed)
                params = [SamplingParams(max_tokens=n, ignore_eos=True, **settings[name])
                          for n in wl.output_lens]  # fmt: skip
                started = time.perf_counter()
                engines[name].generate(wl.prompts, params, use_tqdm=False)
                seconds[name] = time.perf_counter() - started
            print(f"round {r + 1}: " + ", ".join(f"{n} {s:.2f} s" for n, s in seconds.items()))
            for name in ratios:
                ratios[name].append(seconds[name] / seconds["greedy"])
        medians = {name: round(statistics.median(v), 2) for name, v in ratios.items()}
        table([(name, f"{x:.2f}x") for name, x in medians.items()], ("setting", "time / greedy"))
        result = {"bench": "sampled_decoding", "requests": args.requests, "rounds": args.rounds,
                  "dtype": str(llm.dtype).removeprefix("torch."), "sampling": llm.plan.sampling,
                  "time_over_greedy": medians,
                  "cpu_isa": cpu_isa(), "date": date.today().isoformat(),
                  "code": git_state()}  # fmt: skip
    finally:
        m.cleanup()
    print_result(result)
    return result


if __name__ == "__main__":
    main()
