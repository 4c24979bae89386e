"""What a stop string costs: the same greedy workload with and without a stop string that
never occurs, at output lengths 128, 1,024 and 4,096, and the detokenizer's host time per
engine step at 256 sequences.

The workload: 64 prompts of 16 random tokens, each generating exactly the output length (EOS
ignored), greedy, on the benchmarks' random ~56M-parameter Llama with a 32,000-token byte-level
BPE tokenizer (`write_tokenizer`). Both runs give the same tokens (checked). The ratio: the run
with the stop string over itself less its time in the detokenizer and the stop-string search
(timed inside the run: on a shared 2-core machine the drift between two runs is larger than
the cost); goal <= 1.10 at every length (flat in output length: the text is detokenized once
per token and only the new text is searched). Both runs' times are printed too.

The host time: 256 sequences' detokenizers and stop-string search fed one token each per step
(tokens of real text), the engine's thread time per step, beside what decoding every output
whole again would take at 1,024 tokens (the way before).

    python bench/stop_strings.py           # lengths 128, 1,024 and 4,096
    python bench/stop_strings.py --quick   # lengths 128 and 1,024

The last line printed is one JSON object with the headline numbers.
"""

from __future__ import annotations

import argparse
import random
import sysconfig
import time
from datetime import date
from pathlib import Path

from machine import cpu_isa
from random_llama import (
    BenchModel,
    add_model_arguments,
    add_run_arguments,
    engine_with_tokenizer,
    set_up,
)
from report import print_result, rule, table

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.detokenizer import TextDecoding
from conveyor.engine.output_processor import OutputProcessor
from conveyor.engine.output_text import OutputText

GOAL = 1.10
SEQUENCES = 64
HOST_SEQUENCES = 256
STOP = "\u2603 never \u2603"  # a snowman: not in the tokenizer's training text


class Stopwatch:
    """Time in the detokenizer and the stop-string search, on the engine's thread: measured
    inside each run, so the machine's drift between the two runs does not enter it."""

    seconds = 0.0

    @classmethod
    def install(cls) -> None:
        inner = OutputProcessor.read_text

        def read_text(self, seq, token):
            start = time.perf_counter()
            try:
                return inner(self, seq, token)
            finally:
                cls.seconds += time.perf_counter() - start

        OutputProcessor.read_text = read_text


def timed(llm: LLM, prompts: list[list[int]], length: int, stop: list[str]):
    params = SamplingParams(temperature=0, max_tokens=length, ignore_eos=True, stop=stop)
    own, start = Stopwatch.seconds, time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, Stopwatch.seconds - own, [o.outputs[0].token_ids for o in outputs]


def compare(llm: LLM, prompts: list[list[int]], lengths: list[int]) -> list[dict]:
    """Per length: both runs, and the stop string's cost as the time in its own code over
    the rest of the run (end to end, the 2-core machine's drift is larger than the cost)."""
    rows = []
    for length in lengths:
        plain, _, plain_ids = timed(llm, prompts, length, [])
        stopped, own, stop_ids = timed(llm, prompts, length, [STOP])
        assert stop_ids == plain_ids, "a stop string that never occurs changed the output"
        rows.append({"length": length, "plain_s": round(plain, 2), "stop_s": round(stopped, 2),
                     "own_s": round(own, 3), "ratio": round(stopped / (stopped - own), 4),
                     "end_to_end": round(stopped / plain, 3)})  # fmt: skip
        print(f"length {length}: {plain:.2f} s plain, {stopped:.2f} s with a stop string, "
              f"{own:.3f} s of it detokenizing", flush=True)  # fmt: skip
    return rows


def host_step_ms(tokenizer, steps: int) -> tuple[float, float]:
    """The detokenizers' time per step of 256 sequences, and a whole decode of 256 outputs of
    1,024 tokens (what each step cost before)."""
    sources = sorted(Path(sysconfig.get_paths()["purelib"]).glob("*/*.py"))[:400]
    ids = tokenizer.encode("".join(p.read_text(errors="replace") for p in sources))
    rng = random.Random(0)
    starts = [rng.randrange(len(ids) - steps) for _ in range(HOST_SEQUENCES)]
    decoding = TextDecoding(tokenizer)
    params = SamplingParams(stop=[STOP], max_tokens=None)
    texts = [OutputText(decoding.detokenizer(True), params) for _ in starts]
    start = time.perf_counter()
    for k in range(steps):
        for text, at in zip(texts, starts, strict=True):
            text.append(ids[at + k], k + 1)
    incremental = (time.perf_counter() - start) / steps
    start = time.perf_counter()
    for at in starts:
        tokenizer.decode(ids[at : at + 1024], skip_special_tokens=True)
    return incremental * 1e3, (time.perf_counter() - start) * 1e3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(ap, max_positions=4096 + 64)
    add_run_arguments(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="lengths 128 and 1,024")
    ap.set_defaults(skip_hf=True, max_num_seqs=SEQUENCES)
    return ap.parse_args(argv)


def report(rows: list[dict], host_ms: float, whole_ms: float) -> dict:
    rule("results")
    table([(r["length"], r["plain_s"], r["stop_s"], r["own_s"], f"{r['ratio']:.4f}",
            f"{r['end_to_end']:.3f}") for r in rows],
          ("output length", "plain s", "with a stop string s", "detokenizing s", "ratio",
           "end to end"))  # fmt: skip
    worst = max(r["ratio"] for r in rows)
    print(f"worst ratio {worst:.3f} (goal <= {GOAL}): {'MET' if worst <= GOAL else 'NOT met'}")
    print(f"detokenizer at {HOST_SEQUENCES} sequences: {host_ms:.2f} ms per step "
          f"(a whole decode of each 1,024-token output: {whole_ms:.1f} ms)")  # fmt: skip
    return {
        "bench": "stop_strings",
        "ratios": {str(r["length"]): r["ratio"] for r in rows},
        "end_to_end": {str(r["length"]): r["end_to_end"] for r in rows},
        "seconds": {str(r["length"]): [r["plain_s"], r["stop_s"]] for r in rows},
        "goal_met": worst <= GOAL,
        "host_ms_per_step_256": round(host_ms, 3),
        "whole_decode_ms_256x1024": round(whole_ms, 1),
        "cpu_isa": cpu_isa(),
        "date": date.today().isoformat(),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    m: BenchModel = set_up(args)
    try:
        llm = engine_with_tokenizer(m, args, SEQUENCES)
        llm.warm_up()
        Stopwatch.install()
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(3, m.shape.vocab) for _ in range(16)] for _ in range(SEQUENCES)]
        lengths = [128, 1024] if args.quick else [128, 1024, 4096]
        rule("runs")
        rows = compare(llm, prompts, lengths)
        host_ms, whole_ms = host_step_ms(llm.tokenizer, 256)
        result = report(rows, host_ms, whole_ms)
    finally:
        m.cleanup()
    print_result(result)
    return result


if __name__ == "__main__":
    main()
