"""A checked batch line (`ParsedRequest`) as the engine takes it: the prompt (a chat's messages
through the model's chat template) and its `SamplingParams`. The worker and the offline runner
both prepare requests here."""

from __future__ import annotations

from typing import Any

from conveyor.batch_format.errors import (
    CHAT_TEMPLATE_ERROR,
    INVALID_SAMPLING_PARAMS,
    BatchRequestError,
)
from conveyor.batch_format.request_line import ParsedRequest
from engine.sampling_params import SamplingParams

# SamplingParams field -> the request body field it comes from, to name it in errors.
_BODY_FIELD = {
    "logprobs": "body.logprobs",
    "prompt_logprobs": "body.logprobs",
    "stop": "body.stop",
}
_SAMPLING_FIELDS = {
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
    "stop_token_ids", "ignore_eos", "skip_special_tokens",
}  # fmt: skip


def _sampling_param_name(message: str) -> str | None:
    """The body field a `SamplingParams` error message starts with (`top_p must be ...`)."""
    first = message.split(" ", 1)[0].strip("'\"`:,")
    if first in _BODY_FIELD:
        return _BODY_FIELD[first]
    return f"body.{first}" if first in _SAMPLING_FIELDS else None


def prepare_request(llm: Any, request: ParsedRequest) -> tuple[str | list[int], SamplingParams]:
    """The engine prompt and sampling params of a parsed line. Raises `BatchRequestError`."""
    lineno = request.line
    try:
        params = SamplingParams(**request.sampling)
    except (ValueError, TypeError) as err:
        raise BatchRequestError(
            str(err),
            code=INVALID_SAMPLING_PARAMS,
            line=lineno,
            custom_id=request.custom_id,
            param=_sampling_param_name(str(err)),
        ) from None
    if not request.is_chat:
        assert request.prompt is not None
        return request.prompt, params
    try:
        return llm.apply_chat_template(request.messages or []), params
    except Exception as err:  # template errors come in many exception types
        raise BatchRequestError(
            f"could not apply the chat template: {err}",
            code=CHAT_TEMPLATE_ERROR,
            line=lineno,
            custom_id=request.custom_id,
            param="body.messages",
        ) from None
