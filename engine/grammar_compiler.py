"""Structured-output constraints compiled off the engine thread, each grammar once.

Compiling a constraint is llguidance building an `LLMatcher`: the JSON schema (regex, Lark
grammar) becomes a grammar and a lexer checked against the vocabulary. Nearly all the time goes
there and it grows with the grammar (`bench/grammar_compile.py`, 32k vocabulary: a schema of
1000 objects takes 0.65 s to build its matcher and 25 ms to become grammar text), so the engine
thread only submits it: the request waits out of the scheduler (vLLM's WAITING_FOR_FSM) while
the others run, and each step admits the requests whose matcher is ready.

Threads, not processes: llguidance compiles in Rust with the GIL released (a Python thread
keeps its full speed meanwhile), and what a compile makes, the matcher, cannot be pickled: a
process could only check a grammar that the engine would then compile again. A thread cannot
be stopped, so the damage of a long compile is bounded instead. llguidance's own limits
(`LLParserLimits`: lexer fuel, lexer states, grammar size) end every compile after bounded
work, as an error of the request. Past its time limit a request fails alone and its compile is
left to finish on a daemon thread (the interpreter's exit does not wait for it). Two threads at
most compile at once, so no flood of grammars takes the cores the model runs on. The cache
holds each compile from its start, so a grammar is never compiled twice at once, and one
compiling past the limit fails the next request for it at once.

Each sequence gets a copy of the compiled matcher (`deep_copy`, well under 1 ms): a second
`LLMatcher` would compile the whole grammar again.
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from conveyor.engine.errors import StructuredOutputError
from conveyor.engine.sampling_params import StructuredOutputsParams

WORKERS = 2  # compiles at once: each takes a core from the model's threads
CACHE_SIZE = 128  # compiled grammars kept; a large schema's lexer takes megabytes


@dataclass(eq=False)
class Compile:
    """One constraint's compile; its future gives the matcher that sequences copy."""

    key: tuple[str, str]  # StructuredOutputsParams.key: the kind and the text of the constraint
    future: Future[Any] = field(default_factory=Future)
    started: float | None = None  # when a worker took it up (time.monotonic)

    @property
    def kind(self) -> str:
        return self.key[0]

    def running_for(self, now: float) -> float:
        return 0.0 if self.started is None else now - self.started


class GrammarCompiler:
    def __init__(self, tokenizer: Callable[[], Any]) -> None:
        """`tokenizer`: gives llguidance's tokenizer; called on the compile threads."""
        self._tokenizer = tokenizer
        self._cache: OrderedDict[tuple[str, str], Compile] = OrderedDict()
        self._jobs: queue.SimpleQueue[Compile] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def submit(self, spec: StructuredOutputsParams) -> Compile:
        """The compile of `spec`: the one cached (done, failed or under way), else a new one."""
        key = spec.key
        compile_ = self._cache.get(key)
        if compile_ is not None and not _failed_by_accident(compile_):
            self._cache.move_to_end(key)
            return compile_
        compile_ = Compile(key)
        self._cache[key] = compile_
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        self._start_threads()
        self._jobs.put(compile_)
        return compile_

    def _start_threads(self) -> None:
        # daemon threads, not a ThreadPoolExecutor: the interpreter's exit joins an executor's
        # threads, and so would wait on a compile abandoned past its limit
        while len(self._threads) < WORKERS:
            thread = threading.Thread(
                target=self._work, name=f"grammar-compile-{len(self._threads)}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _work(self) -> None:
        while True:
            compile_ = self._jobs.get()
            compile_.started = time.monotonic()
            if not compile_.future.set_running_or_notify_cancel():
                continue
            try:
                compile_.future.set_result(self._compile(*compile_.key))
            except BaseException as err:
                compile_.future.set_exception(err)

    def _compile(self, kind: str, text: str) -> Any:
        from llguidance import LLMatcher

        try:
            grammar = _grammar(kind, text)
        except Exception as err:  # llguidance raises ValueError and RuntimeError
            raise StructuredOutputError(f"cannot compile the {kind} constraint: {err}") from None
        matcher = LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise StructuredOutputError(
                f"cannot compile the {kind} constraint: {matcher.get_error()}"
            )
        return matcher


def _failed_by_accident(compile_: Compile) -> bool:
    """Whether it failed, but not for its grammar (an error of the engine's): compile again."""
    future = compile_.future
    return future.done() and not isinstance(future.exception(), StructuredOutputError | None)


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
