"""Per-request generation settings, named as in vLLM's `SamplingParams`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: -100..100
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: -2..2


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the generated text, one kind per request (vLLM's names): a JSON schema,
    any JSON object, a regular expression, one of a list of strings, or an EBNF grammar."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must hold exactly one of json, json_object, regex, choice "
                f"or grammar, got {', '.join(kinds) or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs choice must be a list of non-empty strings")

    @property
    def key(self) -> tuple[str, str]:
        """What the constraint is, as a hashable key (the same constraint compiles once)."""
        if self.json is not None:
            text = (
                self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            )
            return "json", text
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        assert self.grammar is not None
        return "grammar", self.grammar


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (plus the actual one)
    skip_special_tokens: bool = True
    # OpenAI's penalties, over the generated tokens: logit -= count * frequency + presence
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # transformers' and vLLM's, over prompt and generated tokens: a logit of a token seen is
    # divided by it when positive, multiplied by it when negative
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be generated
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()} or None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._check()

    def _check(self) -> None:
        def fail(msg: str) -> None:
            raise ValueError(msg)

        if self.n < 1:
            fail(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            fail(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            fail(f"top_k must be 0 or -1 (off) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            fail(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                fail(f"{name} must be non-negative, got {value}")
        if any(not s for s in self.stop):
            fail("stop strings must be non-empty")
        self._check_logit_changes(fail)

    def _check_logit_changes(self, fail: Any) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                fail(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        if not self.repetition_penalty > 0:
            fail(f"repetition_penalty must be greater than 0, got {self.repetition_penalty}")
        for token, bias in (self.logit_bias or {}).items():
            if token < 0:
                fail(f"logit_bias keys must be token ids (>= 0), got {token}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                fail(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids or min(self.allowed_token_ids) < 0:
                fail("allowed_token_ids must be a non-empty list of token ids")
        if self.structured_outputs is not None:
            if self.ignore_eos:
                fail(
                    "structured_outputs cannot be combined with ignore_eos: the end of the "
                    "structure is where generation stops"
                )
            if self.min_tokens:
                fail(
                    "structured_outputs cannot be combined with min_tokens: the structure "
                    "decides where generation stops"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
