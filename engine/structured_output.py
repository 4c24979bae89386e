"""Structured outputs: a request's JSON schema, regex, choice or grammar turned into a token
matcher per sequence by llguidance (the grammar engine of llama.cpp's and vLLM's `guidance`
backend), and each step's token masks for the whole batch.

llguidance was chosen over xgrammar by measuring (`bench/grammar_engines.py`): on a 32k
vocabulary it fills 64 rows' masks about twice as fast, and it keeps strings to valid UTF-8
where xgrammar let a sampled string hold the bytes of a lone surrogate.

The masks of a step depend only on tokens already chosen, so they are filled on llguidance's
own threads while the model computes the step's logits; `apply` then masks every constrained
row with one tensor op.

A constraint compiles off the engine thread (`engine/grammar_compiler.py` says how and why):
its request waits here, out of the scheduler, and `settled` hands it back to the step that
finds its grammar compiled, failed or past the request's time limit.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from conveyor.engine.errors import StructuredOutputError
from conveyor.engine.grammar_compiler import Compile, GrammarCompiler
from conveyor.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from conveyor.engine.sequence import Request

_BITS = 32  # tokens per word of a bitmask
# how long an engine with nothing else to run waits for a compile in a step, rather than spin
IDLE_WAIT = 0.02

__all__ = ["StructuredOutputError", "StructuredOutputs"]


@dataclass(eq=False)
class _Waiting:
    """A request out of the scheduler until its grammar compiles."""

    request: Request
    compile: Compile
    timeout: float
    deadline: float  # time.monotonic


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._executor: Any = None
        self._tokenizer_lock = threading.Lock()
        self._bitmask: torch.Tensor | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="token-masks")
        self._compiler = GrammarCompiler(self._tokenizer)
        self._waiting: dict[str, _Waiting] = {}

    def _tokenizer(self) -> Any:
        with self._tokenizer_lock:  # the compile threads ask for it
            if self._ll_tokenizer is None:
                import llguidance
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
                self._executor = llguidance.LLExecutor()
            return self._ll_tokenizer

    def wait_for_grammar(
        self, request: Request, spec: StructuredOutputsParams, timeout: float
    ) -> None:
        """Compile `spec` off this thread (once per grammar: the cache may have it) while
        `request` waits; `settled` hands it back within `timeout` seconds."""
        compile_ = self._compiler.submit(spec)
        now = time.monotonic()
        # a compile that ran past the limit for another request fails this one at once
        deadline = now + timeout - compile_.running_for(now)
        self._waiting[request.request_id] = _Waiting(request, compile_, timeout, deadline)

    def settled(self, wait: bool = False) -> list[tuple[Request, Any]]:
        """The waiting requests whose grammar is settled, each with the compiled grammar for
        `matcher`, or with the error that fails it: a `StructuredOutputError` when the grammar
        does not compile, or not within the request's time limit. With `wait` (the engine has
        nothing else to do), first wait up to IDLE_WAIT seconds for a compile to finish."""
        if not self._waiting:
            return []
        if wait:
            first_deadline = min(w.deadline for w in self._waiting.values())
            pending = {w.compile.future for w in self._waiting.values()}
            timeout = max(0.0, min(IDLE_WAIT, first_deadline - time.monotonic()))
            wait_for(pending, timeout, FIRST_COMPLETED)
        now = time.monotonic()
        settled: list[tuple[Request, Any]] = []
        for request_id, waiting in list(self._waiting.items()):
            future = waiting.compile.future
            if future.done():
                settled.append((waiting.request, future.exception() or future.result()))
            elif now >= waiting.deadline:
                settled.append((waiting.request, _timeout_error(waiting)))
            else:
                continue
            del self._waiting[request_id]
        return settled

    def forget(self, request_id: str) -> None:
        """Stop waiting for the grammar of `request_id` (aborted); its compile goes on for the
        cache."""
        self._waiting.pop(request_id, None)

    @property
    def num_compiling(self) -> int:
        """Requests waiting for their grammar."""
        return len(self._waiting)

    def matcher(self, compiled: Any) -> Any:
        """A fresh matcher of a grammar that `settled` gave."""
        return compiled.deep_copy()

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


def _timeout_error(waiting: _Waiting) -> StructuredOutputError:
    return StructuredOutputError(
        f"cannot compile the {waiting.compile.kind} constraint within {waiting.timeout:g} s "
        "(grammar_timeout)"
    )
