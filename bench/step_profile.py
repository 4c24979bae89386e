"""Where one engine step's time goes: a decode step of ~96 running sequences and a prefill
step of ~4,096 prompt tokens, split into the engine's parts by timing each part's own calls
(the scheduler; the step's layout and attention metadata; the projections; attention, KV
writes included; the norms; rope, activation and residual adds; the output layer; sampling;
appending tokens and building outputs).

    python bench/step_profile.py                                   # the engine's defaults
    python bench/step_profile.py --dtype float32 --attention torch # the defaults before

The model is the benchmarks' random ~56M-parameter Llama; the requests are prompts of 32-400
random tokens, as in bench/engine_ceiling.py. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from datetime import date

from engine_vs_hf import make_workload
from machine import cpu_isa, git_state
from random_llama import add_model_arguments, add_run_arguments, set_up
from report import print_result, rule, table

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.models.layers import Linear, RMSNorm

PARTS = (
    "schedule", "layout and metadata", "projections", "attention", "norms",
    "rope, activation, residuals", "output layer", "sampling", "tokens and outputs",
)  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner: object, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        setattr(owner, name, timed)


class TimedSampler:
    def __init__(self, sampler, clock: Clock) -> None:
        self.sampler, self.clock = sampler, clock

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.sampler(*args, **kwargs)
        finally:
            self.clock.seconds["sampling"] += time.perf_counter() - start


def instrument(llm: LLM) -> Clock:
    clock = Clock()
    model = llm.runner.model
    clock.wrap(llm.scheduler, "schedule", "schedule")
    clock.wrap(llm.runner, "run", "run")
    clock.wrap(model, "forward", "model")
    clock.wrap(model, "compute_logits", "output layer")
    clock.wrap(model.model.embed_tokens, "forward", "embedding")
    clock.wrap(llm.runner.backend, "forward", "attention")
    for module in model.modules():
        if isinstance(module, Linear):  # a packed one's shards are views of its one product
            clock.wrap(module, "forward", "projections")
        elif isinstance(module, RMSNorm):
            clock.wrap(module, "forward", "norms")
    llm.sampler = TimedSampler(llm.sampler, clock)
    clock.wrap(llm, "_advance", "tokens and outputs")
    return clock


def shares(clock: Clock, steps: int, total: float) -> dict[str, float]:
    s = clock.seconds
    inside = s["projections"] + s["attention"] + s["norms"] + s["embedding"]
    parts = {
        "schedule": s["schedule"],
        "layout and metadata": s["run"] - s["model"] - s["output layer"],
        "projections": s["projections"],
        "attention": s["attention"],
        "norms": s["norms"],
        "rope, activation, residuals": s["model"] - inside + s["embedding"],
        "output layer": s["output layer"],
        "sampling": s["sampling"],
        "tokens and outputs": s["tokens and outputs"],
    }
    parts["other"] = total - sum(parts.values())
    return {k: v / steps for k, v in parts.items()}


def decode_steps(llm: LLM, prompts, steps: int) -> tuple[Clock, float]:
    params = SamplingParams(temperature=0, max_tokens=steps + 400, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        llm.add_request(f"d{i}", prompt, params)
    while llm.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                       for s in llm.scheduler.running):  # fmt: skip
        llm.step()
    clock = instrument(llm)
    start = time.perf_counter()
    for _ in range(steps):
        llm.step()
    return clock, time.perf_counter() - start


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(ap, max_positions=1024)
    add_run_arguments(ap)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--elementwise", default="auto", help="norms, rope and activation's path")
    ap.add_argument("--sequences", type=int, default=96)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.set_defaults(skip_hf=True)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    m = set_up(args)
    try:
        options = dict(
            dtype=args.dtype, attention_backend=args.attention, elementwise=args.elementwise
        )
        wl = make_workload(args.sequences, (32, 400), (1, 1), m.shape.vocab, args.seed)
        llm = LLM(str(m.path), **options)
        llm.generate(wl.prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False)  # compile
        rule(f"{args.sequences} sequences, {str(llm.dtype).removeprefix('torch.')}, "
             f"attention {llm.runner.backend.name}")  # fmt: skip
        clock, seconds = decode_steps(llm, wl.prompts, args.steps)
        decode = shares(clock, args.steps, seconds)
        prefill_llm = LLM(str(m.path), **options)
        prefill_llm.generate(wl.prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False)
        for i, prompt in enumerate(wl.prompts):
            prefill_llm.add_request(f"p{i}", prompt, SamplingParams(max_tokens=1))
        prefill_llm.step()  # the first full-size step also grows the heap: not measured
        clock = instrument(prefill_llm)
        start = time.perf_counter()
        prefill_llm.step()  # one step of max_num_batched_tokens prompt tokens
        prefill = shares(clock, 1, time.perf_counter() - start)
        rows = []
        for part in (*PARTS, "other"):
            d, p = decode[part], prefill[part]
            rows.append((part, f"{d * 1e3:.1f}", f"{d / sum(decode.values()):.0%}",
                         f"{p * 1e3:.1f}", f"{p / sum(prefill.values()):.0%}"))  # fmt: skip
        rows.append(
            (
                "step",
                f"{sum(decode.values()) * 1e3:.1f}",
                "",
                f"{sum(prefill.values()) * 1e3:.1f}",
                "",
            )
        )
        table(rows, ("part", "decode ms", "share", "prefill ms", "share"))
        result = {"bench": "step_profile", "dtype": str(llm.dtype).removeprefix("torch."),
                  "attention": llm.runner.backend.name, "elementwise": llm.plan.elementwise,
                  "sequences": args.sequences,
                  "decode_ms": {k: round(v * 1e3, 2) for k, v in decode.items()},
                  "prefill_ms": {k: round(v * 1e3, 2) for k, v in prefill.items()},
                  "cpu_isa": cpu_isa(), "date": date.today().isoformat(),
                  "code": git_state()}  # fmt: skip
    finally:
        m.cleanup()
    print_result(result)
    return result


if __name__ == "__main__":
    main()
