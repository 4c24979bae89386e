"""Per-request generation settings, named as in vLLM's `SamplingParams`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from conveyor.engine.errors import InvalidSamplingParamsError, StructuredOutputError

MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: -100..100
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: -2..2
# A seed is a signed 64-bit integer (as vLLM's and torch's); sample i of a request draws from
# a generator seeded with (seed + i) mod 2**64, the same stream torch gives a negative seed.
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
SEED_MODULUS = 2**64
# Token ids, counts and limits past this are no vocabulary's or context's: refused before they
# reach a tensor (int64) or a loop.
MAX_INT = 2**31 - 1
# Below this a positive temperature divides logits past float32's range (inf - inf = nan in
# the softmax); it is greedy in all but name.
MIN_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 256


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the generated text, one kind per request (vLLM's names): a JSON schema,
    any JSON object, a regular expression, one of a list of strings, or an EBNF grammar."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # the constraint starts after this text in the output, which is free up to it: a reasoning
    # model's end of thinking ("</think>"), so that only the answer is constrained (vLLM's way)
    after: str | None = None

    def __post_init__(self) -> None:
        if self.after is not None and (not isinstance(self.after, str) or not self.after):
            raise StructuredOutputError("structured_outputs after must be a non-empty string")
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise StructuredOutputError(
                "structured_outputs must hold exactly one of json, json_object, regex, choice "
                f"or grammar, got {', '.join(kinds) or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise StructuredOutputError(
                "structured_outputs choice must be a list of non-empty strings"
            )

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
    include_stop_str_in_output: bool = False  # the text ends with the stop string that ended it
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
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()} or None
            except (TypeError, ValueError, OverflowError, AttributeError):
                _fail("logit_bias", "logit_bias must map token ids to numbers")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._check()

    def _check(self) -> None:
        self._check_types()
        if self.n < 1:
            _fail("n", f"n must be at least 1, got {self.n}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            _fail(
                "temperature", f"temperature must be a finite number >= 0, got {self.temperature}"
            )
        if 0 < self.temperature < MIN_TEMPERATURE:
            _fail(
                "temperature",
                f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, "
                f"got {self.temperature}",
            )
        if not 0 < self.top_p <= 1:
            _fail("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            _fail("top_k", f"top_k must be 0 or -1 (off) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            _fail("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            _fail("seed", f"seed must be a 64-bit signed integer, got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 1:
            _fail("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            _fail("min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                _fail(name, f"{name} must be non-negative, got {value}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            _fail("stop", "stop strings must be non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            _fail("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        self._check_logit_changes()

    def _check_types(self) -> None:
        """Counts and ids are integers within int32 (seeds: int64), probabilities and
        penalties real numbers: what a tensor and the checks below can take."""
        ints = ["n", "top_k", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs"]
        for name in ints:
            value = getattr(self, name)
            if value is None and name in ("max_tokens", "logprobs", "prompt_logprobs"):
                continue
            if not _is_int(value):
                _fail(name, f"{name} must be an integer, got {value!r}")
            if abs(value) > MAX_INT:
                _fail(name, f"{name} must be at most {MAX_INT}, got {value}")
        if self.seed is not None and not _is_int(self.seed):
            _fail("seed", f"seed must be an integer, got {self.seed!r}")
        floats = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"]
        for name in [*floats, "repetition_penalty"]:
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                _fail(name, f"{name} must be a number, got {value!r}")
            if math.isnan(value):
                _fail(name, f"{name} must be a number, got NaN")
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if ids is not None and not all(_is_int(t) and 0 <= t <= MAX_INT for t in ids):
                _fail(name, f"{name} must hold token ids (integers from 0 to {MAX_INT})")

    def _check_logit_changes(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                _fail(name, f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        if not 0 < self.repetition_penalty < math.inf:
            _fail(
                "repetition_penalty",
                "repetition_penalty must be greater than 0 and finite, "
                f"got {self.repetition_penalty}",
            )
        for token, bias in (self.logit_bias or {}).items():
            if not 0 <= token <= MAX_INT:
                _fail("logit_bias", f"logit_bias keys must be token ids (>= 0), got {token}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                _fail(
                    "logit_bias",
                    f"logit_bias values must be in [-100, 100], got {bias} for token {token}",
                )
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids:
                _fail(
                    "allowed_token_ids", "allowed_token_ids must be a non-empty list of token ids"
                )
        if self.structured_outputs is not None:
            if self.ignore_eos:
                _fail(
                    "structured_outputs",
                    "structured_outputs cannot be combined with ignore_eos: the end of the "
                    "structure is where generation stops",
                )
            if self.min_tokens:
                _fail(
                    "structured_outputs",
                    "structured_outputs cannot be combined with min_tokens: the structure "
                    "decides where generation stops",
                )

    def sample_seed(self, index: int) -> int:
        """The seed of sample `index`'s generator (`seed` must be set)."""
        assert self.seed is not None
        return (self.seed + index) % SEED_MODULUS

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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(field: str, message: str) -> None:
    raise InvalidSamplingParamsError(message, field)
