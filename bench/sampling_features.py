"""What penalties and structured outputs cost: one mixed workload at 64 concurrent sequences,
run plain, with penalties and logit_bias on every request, and with a structured output on
every request, in one process.

The workload: `--requests` (128) prompts of 32-256 random tokens, each generating 16-128 tokens (a
fixed count per request). The plain and penalised runs ignore EOS so every request generates
its count; the structured run constrains every request to one of four outputs that are longer
than any count (two JSON schemas, a regex, a grammar), so it generates the
same counts and ends at `length`. Prefix caching is off so no run reuses another's prompts.
The model is the benchmarks' random ~56M-parameter Llama with a 32,000-token byte-level BPE
vocabulary trained on this machine's Python sources, so that grammars meet real token strings.

Goals: penalties < 5% and structured outputs < 20% slower than plain. Judged by the time
each run spends in the feature's own code (the logits processors; filling and applying the
token masks), which is what the feature adds to a plain run and is measured inside the run;
end-to-end rates (the median of `--rounds` runs of each, each round in another order) are
printed too, but this VM's speed drifts by more than the effect.

    python bench/sampling_features.py           # 128 requests, 3 rounds (~6 minutes)
    python bench/sampling_features.py --quick   # 64 requests, 1 round

The last line printed is one JSON object with the headline numbers.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

from random_llama import (
    BenchModel,
    add_model_arguments,
    add_run_arguments,
    engine_with_tokenizer,
    set_up,
)
from report import print_result, rule, table

import conveyor.engine.sampler
from conveyor.engine import LLM, SamplingParams
from conveyor.engine.sampling_params import StructuredOutputsParams
from conveyor.engine.structured_output import StructuredOutputs

GOAL_PENALTIES = 0.05
GOAL_STRUCTURED = 0.20
CONCURRENCY = 64

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "id": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "id", "tags", "ok"],
    "additionalProperties": False,
}
CONSTRAINTS = [
    StructuredOutputsParams(
        json={
            "type": "object",
            "properties": {"items": {"type": "array", "items": ITEM, "minItems": 200}},
            "required": ["items"],
        }  # fmt: skip
    ),
    StructuredOutputsParams(json={"type": "array", "items": {"type": "string"}, "minItems": 300}),
    StructuredOutputsParams(regex=r"([a-z]+ ){300}"),
    StructuredOutputsParams(grammar='root ::= ("(" [0-9]+ ") "){200} "end"'),
]


@dataclass
class Run:
    name: str
    seconds: float
    tokens: int
    own_seconds: float = 0.0  # in the feature's own code on the engine's thread

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def workload(n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(32, 256))] for _ in range(n)]
    return prompts, [rng.randint(16, 128) for _ in range(n)]


def plain(count: int, i: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=i, max_tokens=count, ignore_eos=True)


def penalised(count: int, i: int) -> SamplingParams:
    bias = {(i * 97 + k * 1009) % 32000: (-1) ** k * 5.0 for k in range(10)}
    return SamplingParams(temperature=0.8, seed=i, max_tokens=count, ignore_eos=True,
                          presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                          logit_bias=bias)  # fmt: skip


def structured(count: int, i: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=i, max_tokens=count,
                          structured_outputs=CONSTRAINTS[i % len(CONSTRAINTS)])  # fmt: skip


class Stopwatch:
    """Time spent in the features' own code: the logits processors, and filling and applying
    the token masks. The masks are filled on other threads while the model runs, but on a
    2-core machine they take their cores from the model, so their time counts in full.
    Measured inside each run, so the machine's drift between runs does not enter it."""

    seconds = 0.0

    @classmethod
    def wrap(cls, owner: object, name: str) -> None:
        inner = getattr(owner, name)

        def timed_call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                cls.seconds += time.perf_counter() - start

        setattr(owner, name, timed_call)


def install_stopwatch() -> None:
    Stopwatch.wrap(conveyor.engine.sampler, "apply_logits_processors")
    Stopwatch.wrap(StructuredOutputs, "apply")
    Stopwatch.wrap(StructuredOutputs, "_fill")


def timed(llm: LLM, name: str, prompts, counts, make) -> Run:
    params = [make(c, i) for i, c in enumerate(counts)]
    own = Stopwatch.seconds
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    if name == "structured":
        reasons = [o.outputs[0].finish_reason for o in outputs]
        assert all(r == "length" for r in reasons), "a constrained output ended early"
    return Run(name, seconds, tokens, Stopwatch.seconds - own)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(ap, max_positions=512)
    add_run_arguments(ap)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each configuration")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="64 requests")
    ap.set_defaults(skip_hf=True, max_num_seqs=CONCURRENCY)
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.rounds = 64, 1
    return args


def report(runs: dict[str, list[Run]]) -> dict:
    rule("results")
    rate = {name: statistics.median(r.rate for r in rs) for name, rs in runs.items()}
    share = {name: statistics.median(r.own_seconds / r.seconds for r in rs)
             for name, rs in runs.items()}  # fmt: skip
    base = rate["plain"]
    rows = [
        (name, ", ".join(f"{r.seconds:.1f}" for r in rs), f"{rs[0].tokens:,}",
         ", ".join(f"{r.rate:,.0f}" for r in rs), f"{1 - rate[name] / base:+.1%}",
         f"{share[name]:.1%}")
        for name, rs in runs.items()
    ]  # fmt: skip
    table(rows, ("run", "seconds", "generated tokens", "tokens/s", "median vs plain",
                 "time in the feature's code"))  # fmt: skip
    # the feature's own time on the engine's thread: what it adds to a plain run
    cost = {k: share[k] / (1 - share[k]) for k in ("penalties", "structured")}
    for name, goal in (("penalties", GOAL_PENALTIES), ("structured", GOAL_STRUCTURED)):
        verdict = "MET" if cost[name] < goal else "NOT met"
        print(f"{name}: adds {cost[name]:.1%} to a plain run, end to end "
              f"{1 - rate[name] / base:+.1%} (goal < {goal:.0%} slower): {verdict}")  # fmt: skip
    return {
        "bench": "sampling_features",
        "plain_tokens_per_s": round(base, 1),
        "penalties_cost": round(cost["penalties"], 4),
        "structured_cost": round(cost["structured"], 4),
        "penalties_end_to_end": round(1 - rate["penalties"] / base, 4),
        "structured_end_to_end": round(1 - rate["structured"] / base, 4),
        "goal_penalties_met": cost["penalties"] < GOAL_PENALTIES,
        "goal_structured_met": cost["structured"] < GOAL_STRUCTURED,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    m: BenchModel = set_up(args)
    try:
        llm = engine_with_tokenizer(m, args, CONCURRENCY)
        install_stopwatch()
        prompts, counts = workload(args.requests, m.shape.vocab, args.seed)
        rule("workload")
        print(f"{len(prompts)} requests, {sum(map(len, prompts)):,} prompt tokens, "
              f"{sum(counts):,} tokens to generate, {CONCURRENCY} at a time")  # fmt: skip
        warm, warm_counts = workload(8, m.shape.vocab, -1)
        for make in (plain, penalised, structured):  # compile, and the grammars
            llm.generate(warm, [make(c, i) for i, c in enumerate(warm_counts)], use_tqdm=False)
        configs = [("plain", plain), ("penalties", penalised), ("structured", structured)]
        runs: dict[str, list[Run]] = {name: [] for name, _ in configs}
        for round_ in range(args.rounds):  # each round in another order: drift spreads evenly
            for name, make in configs[round_ % 3 :] + configs[: round_ % 3]:
                runs[name].append(timed(llm, name, prompts, counts, make))
                print(f"round {round_ + 1}, {name}: {runs[name][-1].seconds:.2f} s", flush=True)
        result = report(runs)
        result["requests"] = len(prompts)
    finally:
        m.cleanup()
    print_result(result)
    return result


if __name__ == "__main__":
    main()
