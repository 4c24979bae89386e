"""Structured outputs: a request's JSON schema, regex, choice or grammar turned into a token
matcher per sequence by llguidance (the grammar engine of llama.cpp's and vLLM's `guidance`
backend), and each step's token masks for the whole batch.

llguidance was chosen over xgrammar by measuring (`bench/grammar_engines.py`): on a 32k
vocabulary it fills 64 rows' masks about twice as fast, and it keeps strings to valid UTF-8
where xgrammar let a sampled string hold the bytes of a lone surrogate.

The masks of a step depend only on tokens already chosen, so they are filled on llguidance's
own threads while the model computes the step's logits; `apply` then masks every constrained
row with one tensor op.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import Any

import torch

from engine.sampling_params import StructuredOutputsParams

_BITS = 32  # tokens per word of a bitmask


class StructuredOutputError(ValueError):
    """A constraint the grammar engine cannot compile; the message says why."""


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._executor: Any = None
        self._bitmask: torch.Tensor | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="token-masks")

    def _tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            import llguidance
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
            )
            self._executor = llguidance.LLExecutor()
        return self._ll_tokenizer

    def compile(self, spec: StructuredOutputsParams) -> str:
        """The llguidance grammar of `spec`, checked against the vocabulary. Raises
        `StructuredOutputError`."""
        from llguidance import LLMatcher

        kind, _ = spec.key
        try:
            grammar = _grammar(*spec.key)
        except Exception as err:  # llguidance raises ValueError and RuntimeError
            raise StructuredOutputError(f"cannot compile the {kind} constraint: {err}") from None
        matcher = LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise StructuredOutputError(
                f"cannot compile the {kind} constraint: {matcher.get_error()}"
            )
        return grammar

    def matcher(self, grammar: str) -> Any:
        from llguidance import LLMatcher

        return LLMatcher(self._tokenizer(), grammar, log_level=0)

    def fill_async(self, matchers: list[Any | None]) -> Future[torch.Tensor] | None:
        """Start filling the masks of `matchers` (None: an unconstrained row); None when no
        row is constrained."""
        if all(m is None for m in matchers):
            return None
        return self._pool.submit(self._fill, matchers)

    def _fill(self, matchers: list[Any | None]) -> torch.Tensor:
        import llguidance.torch

        rows, words = len(matchers), (self.vocab_size + _BITS - 1) // _BITS
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = torch.empty(max(rows, 64), words, dtype=torch.int32)
        bitmask = self._bitmask[:rows]
        bitmask.fill_(-1)  # every token allowed in an unconstrained row
        constrained = [(m, i) for i, m in enumerate(matchers) if m is not None]
        llguidance.torch.fill_next_token_bitmask_par(self._executor, constrained, bitmask)
        return bitmask.clone()

    def wait(self, masks: Future[torch.Tensor]) -> torch.Tensor:
        return masks.result()

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Set the logits of the tokens each row's mask leaves out to -inf."""
        bitmask = bitmask.to(logits.device)
        bits = torch.arange(_BITS, dtype=torch.int32, device=logits.device)
        allowed = ((bitmask[:, :, None] >> bits) & 1).view(bitmask.shape[0], -1)
        width = logits.shape[1]
        logits.masked_fill_(allowed[:, :width] == 0, float("-inf"))


@lru_cache(maxsize=256)
def _grammar(kind: str, text: str) -> str:
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    no_whitespace = {"whitespace_flexible": False}
    if kind == "json":
        return LLMatcher.grammar_from_json_schema(text, defaults=no_whitespace)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=no_whitespace)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in json.loads(text)))
    # GBNF (llama.cpp's and xgrammar's `root ::= ...`) or Lark (`start: ...`)
    return LLMatcher.grammar_from_lark(any_to_lark(text))
