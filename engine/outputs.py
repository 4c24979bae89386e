"""What `LLM.generate` and `LLM.step` return, named as in vLLM's `RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.engine.errors import RequestFailure

# token id -> log probability, for one position: the chosen token plus the top-k alternatives.
TokenLogprobs = dict[int, float]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass
class RequestMetrics:
    """When a request went through the engine, in `time.monotonic()` seconds (as vLLM's
    `RequestOutput.metrics`): arrival, first output token, finish."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # why the engine gave up on this request alone; its outputs then end with finish_reason
    # "error" and hold what was generated before
    error: RequestFailure | None = None
