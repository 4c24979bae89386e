"""Why structured outputs use llguidance: it and xgrammar (the two maintained grammar engines
for LLM decoding on PyPI; `pip install xgrammar` to run this) side by side on one JSON schema
against a 32,000-token byte-level BPE vocabulary.

Measured for each: compiling the schema (first time and again), filling the token masks of 64
sequences per step, and applying them to [64, 32000] logits with one tensor op (ours, the same
for both); and whether strings stay valid UTF-8: `--walks` random walks through a schema whose
only string may hold one character, each step choosing uniformly among the allowed tokens, on
the tests' 512-token byte-level BPE (where single bytes are a large share of the tokens, so a
walk often spells a character byte by byte).

    python bench/grammar_engines.py

The last line printed is one JSON object with the headline numbers.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from random_llama import write_tokenizer
from report import print_result, rule, table

ROWS = 64
VOCAB = 32000
STEPS = 40
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age"],
}
ONE_CHARACTER = {
    "type": "object",
    "properties": {"c": {"type": "string", "minLength": 1, "maxLength": 1}},
    "required": ["c"],
    "additionalProperties": False,
}


def apply_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).view(bitmask.shape[0], -1)
    logits.masked_fill_(allowed[:, : logits.shape[1]] == 0, float("-inf"))


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, eos: int, vocab: int = VOCAB) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.torch = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False}
        )
        return [grammar, self.ll.LLMatcher(self.tok, grammar)]  # compiles on first use

    def matchers(self, compiled, n: int) -> list:
        return [self.ll.LLMatcher(self.tok, compiled[0]) for _ in range(n)]

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self.torch.fill_next_token_bitmask_par(self.executor, pairs, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_stopped()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, eos: int, vocab: int = VOCAB) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab, stop_token_ids=[eos]
        )
        self.compiler = xgrammar.GrammarCompiler(info)
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matchers(self, compiled, n: int) -> list:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


def allowed_tokens(bitmask_row: torch.Tensor, vocab: int) -> list[int]:
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask_row[:, None] >> bits) & 1).view(-1)[:vocab]
    return allowed.nonzero().flatten().tolist()


def timings(engine) -> dict:
    start = time.perf_counter()
    compiled = engine.compile(SCHEMA)
    first = time.perf_counter() - start
    start = time.perf_counter()
    engine.compile(SCHEMA)
    again = time.perf_counter() - start
    matchers = engine.matchers(compiled, ROWS)
    bitmask = torch.full((ROWS, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    logits = torch.randn(ROWS, VOCAB)
    fill = apply = 0.0
    for _ in range(STEPS):
        start = time.perf_counter()
        engine.fill(matchers, bitmask)
        fill += time.perf_counter() - start
        step_logits = logits.clone()
        start = time.perf_counter()
        apply_mask(step_logits, bitmask)
        apply += time.perf_counter() - start
        for i, token in enumerate(step_logits.argmax(-1).tolist()):
            engine.accept(matchers[i], token)
            if engine.done(matchers[i]):  # a finished row starts again
                matchers[i] = engine.matchers(compiled, 1)[0]
    return {"compile_ms": first * 1e3, "compile_again_ms": again * 1e3,
            "fill_ms": fill / STEPS * 1e3, "apply_ms": apply / STEPS * 1e3}  # fmt: skip


def invalid_utf8_walks(engine, tokenizer, eos: int, walks: int, seed: int) -> int:
    """Random walks through ONE_CHARACTER whose text is not valid UTF-8 or breaks the schema."""
    rng = random.Random(seed)
    compiled = engine.compile(ONE_CHARACTER)
    vocab = len(tokenizer)
    bitmask = torch.empty(1, (vocab + 31) // 32, dtype=torch.int32)
    bad = 0
    for _ in range(walks):
        matcher = engine.matchers(compiled, 1)[0]
        tokens: list[int] = []
        for _ in range(30):
            bitmask.fill_(-1)
            engine.fill([matcher], bitmask)
            token = rng.choice(allowed_tokens(bitmask[0], vocab))
            engine.accept(matcher, token)
            tokens.append(token)
            if engine.done(matcher):
                break
        text = tokenizer.decode([t for t in tokens if t != eos])
        try:
            ok = len(json.loads(text)["c"]) == 1 and "\ufffd" not in text
        except (ValueError, KeyError):
            ok = False
        bad += not ok
    return bad


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--walks", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    rule("vocabulary")
    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer(Path(tmp), VOCAB)
        tokenizer = AutoTokenizer.from_pretrained(tmp)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    print(f"byte-level BPE, {len(tokenizer):,} tokens; {ROWS} rows, {STEPS} steps")
    from conveyor.demo_model import build_tokenizer

    small = build_tokenizer()
    small_eos = small.convert_tokens_to_ids("<|im_end|>")
    rows, result = [], {"bench": "grammar_engines"}
    for cls in (Llguidance, Xgrammar):
        t = timings(cls(tokenizer, eos))
        walker = cls(small, small_eos, len(small))
        bad = invalid_utf8_walks(walker, small, small_eos, args.walks, args.seed)
        rows.append((cls.name, f"{t['compile_ms']:.1f}", f"{t['compile_again_ms']:.2f}",
                     f"{t['fill_ms']:.2f}", f"{t['apply_ms']:.2f}",
                     f"{bad}/{args.walks}"))  # fmt: skip
        result[cls.name] = {k: round(v, 3) for k, v in t.items()} | {"invalid_walks": bad}
    rule("results")
    table(rows, ("engine", "compile ms", "again ms", f"fill {ROWS} rows ms/step",
                 "apply ms/step", "walks breaking UTF-8 or the schema"))  # fmt: skip
    print_result(result)
    return result


if __name__ == "__main__":
    main()
