"""What a large structured-output grammar costs the engine thread: compiling JSON schemas of 200
and 1000 objects (and a large regex) against a 32,000-token byte-level BPE vocabulary.

First the parts of a compile, on this thread: the schema turned into llguidance grammar text,
the first `LLMatcher` (where the grammar and its lexer are built), a second `LLMatcher` of the
same grammar (what each further sequence used to cost), and `deep_copy` (what it costs now).
Then an engine decoding `--streams` unconstrained requests is handed one request with the
grammar: how long `add_request` holds the engine thread, the steps the streams ran meanwhile,
their median and longest step against the steps before (on a machine of few cores the
compile takes one from the model's threads), and when the request was scheduled.
Before, `add_request` compiled on the engine thread, so every stream waited for the whole first
`LLMatcher`.

    python bench/grammar_compile.py

The last line printed is one JSON object with the headline numbers.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from random_llama import write_tokenizer
from report import print_result, rule, table

from conveyor.demo_model import write_tiny_model
from conveyor.engine import LLMEngine, SamplingParams
from conveyor.engine.grammar_compiler import _grammar
from conveyor.engine.sampling_params import StructuredOutputsParams

VOCAB = 32000


def big_schema(n: int) -> dict:
    """`n` objects of six typed fields each (patterns, formats, ranges, enums, arrays)."""
    item = {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4,8}$"},
            "email": {"type": "string", "format": "email"},
            "when": {"type": "string", "format": "date-time"},
            "n": {"type": "integer", "minimum": -1000, "maximum": 123456},
            "kind": {"enum": [f"k{j}" for j in range(20)]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        },
        "required": ["id", "n"],
        "additionalProperties": False,
    }
    props = {f"field_{i}": item for i in range(n)}
    return {
        "type": "object",
        "properties": props,
        "required": list(props)[: n // 2],
        "additionalProperties": False,
    }


def cases() -> list[tuple[str, StructuredOutputsParams]]:
    words = "|".join(f"word{i}" for i in range(20000))
    return [
        ("schema, 200 objects", StructuredOutputsParams(json=big_schema(200))),
        ("schema, 1000 objects", StructuredOutputsParams(json=big_schema(1000))),
        ("regex, 20000 words", StructuredOutputsParams(regex=f"({words})( ({words})){{0,8}}")),
    ]


def parts(engine: LLMEngine, spec: StructuredOutputsParams) -> dict:
    from llguidance import LLMatcher

    tokenizer = engine.structured_outputs._tokenizer()
    t0 = time.perf_counter()
    grammar = _grammar(*spec.key)
    t1 = time.perf_counter()
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    t2 = time.perf_counter()
    LLMatcher(tokenizer, grammar, log_level=0)
    t3 = time.perf_counter()
    matcher.deep_copy()
    t4 = time.perf_counter()
    assert not matcher.is_error(), matcher.get_error()
    return {"text_ms": t1 - t0, "matcher_ms": t2 - t1, "again_ms": t3 - t2, "copy_ms": t4 - t3}


def on_the_engine(engine: LLMEngine, spec: StructuredOutputsParams, streams: int, tag: str):
    plain = SamplingParams(max_tokens=100_000, ignore_eos=True)
    for i in range(streams):
        engine.add_request(f"{tag}-plain-{i}", [3 + i, 7, 11, 13], plain)
    before = []
    for _ in range(10):
        t = time.perf_counter()
        engine.step()
        before.append(time.perf_counter() - t)
    t0 = time.perf_counter()
    constrained = SamplingParams(max_tokens=1, structured_outputs=spec)
    engine.add_request(f"{tag}-grammar", [5, 6, 7], constrained)
    add_s = time.perf_counter() - t0
    during = []
    while engine.structured_outputs.num_compiling:
        t = time.perf_counter()
        engine.step()
        during.append(time.perf_counter() - t)
    admitted_s = time.perf_counter() - t0
    for request_id in list(engine.requests):
        engine.abort(request_id)
    meanwhile = during[:-1] or [0.0]  # the last step admitted it
    return {
        "add_request_ms": add_s,
        "steps_while_compiling": len(during) - 1,
        "median_step_before_ms": statistics.median(before),
        "median_step_while_compiling_ms": statistics.median(meanwhile),
        "longest_step_while_compiling_ms": max(meanwhile),
        "scheduled_after_ms": admitted_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=8, help="unconstrained requests decoding")
    ap.add_argument("--model-dir", type=Path, default=None, help="write (or reuse) it here")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    tmp = tempfile.TemporaryDirectory(prefix="conveyor-bench-") if args.model_dir is None else None
    model_dir = args.model_dir or Path(tmp.name) / "llama"
    if not (model_dir / "tokenizer.json").exists():
        write_tiny_model(model_dir, "llama", with_tokenizer=False, vocab_size=VOCAB,
                         hidden_size=256, intermediate_size=688, num_hidden_layers=4)  # fmt: skip
        write_tokenizer(model_dir, VOCAB)
    engine = LLMEngine(str(model_dir), device="cpu", dtype="float32")
    engine.warm_up()

    rule("the parts of a compile, on this thread")
    measured = {name: parts(engine, spec) for name, spec in cases()}
    ms = lambda s: f"{s * 1000:.1f}"  # noqa: E731
    table(
        [(n, ms(p["text_ms"]), ms(p["matcher_ms"]), ms(p["again_ms"]), ms(p["copy_ms"]))
         for n, p in measured.items()],
        ("grammar", "to grammar text ms", "first LLMatcher ms", "second LLMatcher ms",
         "deep_copy ms"),
    )  # fmt: skip

    rule(f"a new grammar handed to an engine decoding {args.streams} unconstrained streams")
    engine_runs = {}
    for i, (name, _) in enumerate(cases()):
        spec = cases()[i][1]
        # a grammar the cache has not seen: the same schema under another title
        fresh = StructuredOutputsParams(json={**spec.json, "title": "fresh"}) if spec.json else (
            StructuredOutputsParams(regex=spec.regex + "x"))  # fmt: skip
        engine_runs[name] = on_the_engine(engine, fresh, args.streams, f"run{i}")
    table(
        [(n, ms(r["add_request_ms"]), r["steps_while_compiling"], ms(r["median_step_before_ms"]),
          ms(r["median_step_while_compiling_ms"]), ms(r["longest_step_while_compiling_ms"]),
          ms(r["scheduled_after_ms"]))
         for n, r in engine_runs.items()],
        ("grammar", "add_request ms", "steps meanwhile", "step before ms",
         "step meanwhile ms", "longest meanwhile ms", "scheduled after ms"),
    )  # fmt: skip
    print_result(
        {
            name: {
                "engine_thread_before_ms": round(measured[name]["matcher_ms"] * 1000, 1),
                "engine_thread_after_ms": round(run["add_request_ms"] * 1000, 3),
                "steps_while_compiling": run["steps_while_compiling"],
            }
            for name, run in engine_runs.items()
        }
    )
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
