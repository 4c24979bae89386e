"""A request and the sequences (one per sample) that it decodes."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch

from conveyor.engine.logprob_entries import LogprobEntry
from conveyor.engine.outputs import RequestMetrics, TokenLogprobs
from conveyor.engine.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    """One token stream: its tokens, its block table and how much of its KV is computed."""

    request: Request
    index: int  # sample index within the request (0..n-1)
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    # one block table per KV group (`kv_layout`), all of the same length
    tables: list[list[int]] = field(default_factory=lambda: [[]])
    block_keys: list[bytes] = field(default_factory=list)  # chained keys of its full blocks
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    # per group: leading blocks given back, outside the window of the group's layers
    released: list[int] = field(default_factory=lambda: [0])
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: Any = None  # its `OutputText`, where stop strings or a stream need the text as it comes
    arrival_time: float = 0.0  # when it (last) joined the waiting queue, scheduler clock
    matcher: Any = None  # its structured output's grammar state, if the request has one
    # the grammar state kept aside while the output is free: before the text the constraint
    # starts after (`StructuredOutputsParams.after`) has come
    deferred_matcher: Any = None
    prompt_token_set: torch.Tensor | None = None  # distinct prompt ids (repetition penalty)
    rope_long: bool = False  # computed with LongRoPE's long factors (`layers.LongRope`)
    sample_request: Any = None  # its row of the sampler, once nothing about it changes by step

    @property
    def block_table(self) -> list[int]:
        """The block table of the first KV group (the only one, where layers are alike)."""
        return self.tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.tables[0] = table

    @property
    def num_released_blocks(self) -> int:
        return self.released[0]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower goes first
    stream: bool = False  # every step's output so far is returned, not only the last
    seqs: list[Sequence] = field(default_factory=list)
    # prompt_entries[i] is for prompt token i; entry 0 is None (nothing predicts it)
    prompt_entries: list[LogprobEntry | None] | None = None
    num_cached_tokens: int | None = None  # prompt tokens served from the cache on first admission
    grammar: Any = None  # the compiled structured output constraint, if any
    constraint_after: tuple[int, ...] | None = None  # the ids of `structured_outputs.after`
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))

    @property
    def needs_fork(self) -> bool:
        """True until the prompt's single sequence has been split into `n` samples."""
        return len(self.seqs) < self.params.n

    @property
    def is_finished(self) -> bool:
        return not self.needs_fork and all(s.is_finished for s in self.seqs)
