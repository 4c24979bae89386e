"""Every body field is honoured or refused: each field of OpenAI's chat and completions request
schemas (read from the `openai` package) and each field Conveyor declares is either shown to
change the request, accepted without effect for a stated reason, or refused naming the field."""

from __future__ import annotations

import json
import typing
from collections.abc import Callable
from typing import Any

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from conveyor.engine.sampling_params import SamplingParams
from conveyor.wire_format.bodies import (
    CHAT_URL,
    COMPLETIONS_URL,
    ChatCompletionBody,
    CompletionBody,
)
from conveyor.wire_format.errors import (
    UNKNOWN_PARAMETER,
    UNSUPPORTED_PARAMETER,
    RequestError,
)
from conveyor.wire_format.fields import ACCEPTED_WITHOUT_EFFECT, UNSUPPORTED
from conveyor.wire_format.request_line import ParsedRequest, parse_request_line

BASE = {
    CHAT_URL: {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    COMPLETIONS_URL: {"model": "m", "prompt": "hi"},
}
OPENAI_FIELDS = {
    url: set(typing.get_type_hints(params.CompletionCreateParamsBase)) | {"stream"}
    for url, params in ((CHAT_URL, chat_create_params), (COMPLETIONS_URL, completion_create_params))
}
MODELS = {CHAT_URL: ChatCompletionBody, COMPLETIONS_URL: CompletionBody}


def parse(url: str, **fields: Any) -> ParsedRequest:
    body = {**BASE[url], **fields}
    return parse_request_line(json.dumps({"custom_id": "x", "method": "POST", "url": url,
                                          "body": body}))  # fmt: skip


def refusal(url: str, **fields: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse(url, **fields)
    return info.value


def sampling(**expected: Any) -> Callable[[ParsedRequest], bool]:
    return lambda r: all(r.sampling.get(k) == v for k, v in expected.items())


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]
# field -> (the fields to send, what the parsed request must then show); applies to both
# endpoints unless the key is (url, field). The engine tests show what each setting does.
HONOURED: dict[Any, tuple[dict[str, Any], Callable[[ParsedRequest], bool]]] = {
    "model": ({"model": "other"}, lambda r: r.model == "other"),
    "messages": (
        {"messages": [{"role": "system", "content": "s", "name": "n"}]},
        lambda r: r.messages == [{"role": "system", "content": "s", "name": "n"}],
    ),
    "prompt": ({"prompt": [5, 6]}, lambda r: r.prompt == [5, 6]),
    "temperature": ({"temperature": 0.3}, sampling(temperature=0.3)),
    "top_p": ({"top_p": 0.5}, sampling(top_p=0.5)),
    "n": ({"n": 3}, sampling(n=3)),
    "seed": ({"seed": 11}, sampling(seed=11)),
    "stop": ({"stop": "##"}, sampling(stop=["##"])),
    "max_tokens": ({"max_tokens": 7}, sampling(max_tokens=7)),
    "max_completion_tokens": ({"max_completion_tokens": 9}, sampling(max_tokens=9)),
    (CHAT_URL, "logprobs"): ({"logprobs": True}, sampling(logprobs=0)),
    (COMPLETIONS_URL, "logprobs"): ({"logprobs": 2}, sampling(logprobs=2)),
    "top_logprobs": ({"logprobs": True, "top_logprobs": 4}, sampling(logprobs=4)),
    "echo": ({"echo": True, "logprobs": 1}, lambda r: r.echo and r.sampling["prompt_logprobs"]),
    "best_of": ({"best_of": 2, "n": 2}, sampling(n=2)),
    "presence_penalty": ({"presence_penalty": -0.5}, sampling(presence_penalty=-0.5)),
    "frequency_penalty": ({"frequency_penalty": 1.5}, sampling(frequency_penalty=1.5)),
    "logit_bias": ({"logit_bias": {"17": -100}}, sampling(logit_bias={"17": -100.0})),
    "response_format": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": SCHEMA, "strict": True},
            }
        },
        sampling(structured_outputs={"json": SCHEMA}),
    ),  # fmt: skip
    "modalities": ({"modalities": ["text"]}, sampling(n=1)),  # text is all a model answers in
    # vLLM's extensions
    "top_k": ({"top_k": 5}, sampling(top_k=5)),
    "min_p": ({"min_p": 0.1}, sampling(min_p=0.1)),
    "min_tokens": ({"min_tokens": 2}, sampling(min_tokens=2)),
    "ignore_eos": ({"ignore_eos": True}, sampling(ignore_eos=True)),
    "stop_token_ids": ({"stop_token_ids": [4]}, sampling(stop_token_ids=[4])),
    "skip_special_tokens": ({"skip_special_tokens": False}, sampling(skip_special_tokens=False)),
    "include_stop_str_in_output": (
        {"include_stop_str_in_output": True},
        sampling(include_stop_str_in_output=True),
    ),
    "repetition_penalty": ({"repetition_penalty": 1.3}, sampling(repetition_penalty=1.3)),
    "allowed_token_ids": ({"allowed_token_ids": [3, 4]}, sampling(allowed_token_ids=[3, 4])),
    "tools": ({"tools": TOOLS}, lambda r: r.tools == TOOLS and r.tool_use.choice == "auto"),
    "tool_choice": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
        lambda r: r.tool_use.name == "f" and r.sampling["structured_outputs"] == {"json": SCHEMA},
    ),
    "parallel_tool_calls": (
        {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
        lambda r: not r.tool_use.parallel and r.sampling["structured_outputs"]["json"]["maxItems"],
    ),
    "chat_template_kwargs": (
        {"chat_template_kwargs": {"enable_thinking": False}},
        lambda r: r.chat_template_kwargs == {"enable_thinking": False},
    ),
    "add_generation_prompt": (
        {"add_generation_prompt": False},
        lambda r: not r.add_generation_prompt and not r.continue_final_message,
    ),
    "continue_final_message": (
        {"continue_final_message": True},  # the last message continued, no new turn
        lambda r: r.continue_final_message and not r.add_generation_prompt,
    ),
    "structured_outputs": (
        {"structured_outputs": {"choice": ["a", "b"]}},
        sampling(structured_outputs={"choice": ["a", "b"]}),
    ),
    "guided_json": ({"guided_json": SCHEMA}, sampling(structured_outputs={"json": SCHEMA})),
    "guided_regex": ({"guided_regex": "a+"}, sampling(structured_outputs={"regex": "a+"})),
    "guided_choice": ({"guided_choice": ["x"]}, sampling(structured_outputs={"choice": ["x"]})),
    "guided_grammar": (
        {"guided_grammar": 'root ::= "a"'},
        sampling(structured_outputs={"grammar": 'root ::= "a"'}),
    ),
}
# honoured by online requests; a batch line refuses `stream` and has nothing to stream
ONLINE_ONLY = {
    "stream": "tests/system/test_online.py::test_online_requests_answer_as_batch_lines_do",
    "stream_options": "tests/system/test_online.py::test_online_requests_answer_as_batch_lines_do",
}


def _honoured(url: str, field: str):
    return HONOURED.get((url, field)) or HONOURED.get(field)


def _fields(url: str) -> list[str]:
    return sorted(OPENAI_FIELDS[url] | set(MODELS[url].model_fields))


@pytest.mark.parametrize("url", [CHAT_URL, COMPLETIONS_URL])
def test_every_field_is_honoured_accepted_or_refused(url):
    unclassified = [
        f
        for f in _fields(url)
        if f not in ACCEPTED_WITHOUT_EFFECT
        and f not in UNSUPPORTED
        and f not in ONLINE_ONLY
        and _honoured(url, f) is None
    ]
    assert unclassified == []


@pytest.mark.parametrize(("url", "field"), [(u, f) for u in BASE for f in _fields(u)])
def test_each_field_does_what_its_class_says(url, field):
    plain = parse(url)
    if field in ACCEPTED_WITHOUT_EFFECT:
        assert parse(url, **{field: "x" if field != "store" else True}) == plain
    elif field in UNSUPPORTED:
        err = refusal(url, **{field: [{"type": "function"}]})
        assert (err.code, err.param) == (UNSUPPORTED_PARAMETER, f"body.{field}")
        assert "not supported" in str(err)
    elif field in ONLINE_ONLY:
        pass  # shown by the online test named in ONLINE_ONLY
    else:
        fields, shows = _honoured(url, field)
        request = parse(url, **fields)
        assert shows(request), (field, request)
        SamplingParams(**request.sampling)  # the engine takes what the body asked for


def test_stream_is_refused_in_a_batch_line():
    err = refusal(CHAT_URL, stream=True)
    assert err.param == "body.stream"


def test_unknown_fields_fail_naming_the_field():
    err = refusal(COMPLETIONS_URL, max_token=5)
    assert (err.code, err.param) == (UNKNOWN_PARAMETER, "body.max_token")
    assert "Unrecognized request argument supplied" in str(err)
    assert "did you mean 'max_tokens'?" in str(err)
    nested = refusal(CHAT_URL, messages=[{"role": "user", "content": "hi", "colour": "red"}])
    assert (nested.code, nested.param) == (UNKNOWN_PARAMETER, "body.messages[0].colour")
    deep = refusal(CHAT_URL, response_format={"type": "json_object", "extra": 1})
    assert (deep.code, deep.param) == (UNKNOWN_PARAMETER, "body.response_format.extra")


def test_empty_values_of_unsupported_fields_are_as_if_absent():
    assert parse(CHAT_URL, functions=[], function_call=None) == parse(CHAT_URL)
    assert parse(CHAT_URL, tools=[], tool_choice=None) == parse(CHAT_URL)  # no tools offered
    err = refusal(CHAT_URL, messages=[{"role": "assistant", "content": "x",
                                       "function_call": {"name": "f"}}])  # fmt: skip
    assert (err.code, err.param) == (UNSUPPORTED_PARAMETER, "body.messages[0].function_call")


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"modalities": ["text", "audio"]}, "body.modalities[1]", "'text'"),
        ({"best_of": 3}, "body.best_of", "best_of other than n"),
        ({"logit_bias": {"abc": 1}}, "body.logit_bias", "token ids"),
        ({"logit_bias": {"5": 150}}, "body.logit_bias", "[-100, 100]"),
        ({"presence_penalty": 2.5}, "body.presence_penalty", "less than or equal to 2"),
        ({"repetition_penalty": 0}, "body.repetition_penalty", "greater than 0"),
        ({"response_format": {"type": "json_schema"}}, "body.response_format", "json_schema"),
        ({"response_format": {"type": "xml"}}, "body.response_format.type", "json_object"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "body.structured_outputs",
         "exactly one"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "body",
         "at most one"),
        ({"add_generation_prompt": True, "continue_final_message": True},
         "body.continue_final_message", "may not both be true"),
    ],
)  # fmt: skip
def test_bad_values_fail_naming_the_field(fields, param, needle):
    chat_only = {"modalities", "continue_final_message"}
    url = CHAT_URL if chat_only & fields.keys() else COMPLETIONS_URL
    err = refusal(url, **fields)
    assert err.param == param
    assert needle in str(err)


def test_response_format_text_is_the_default():
    assert parse(CHAT_URL, response_format={"type": "text"}) == parse(CHAT_URL)


def test_lengths_left_out_are_openais_defaults():
    """A chat without a length runs to the end of the context (the engine stops it there), a
    completion to 16 tokens; `max_completion_tokens` wins over `max_tokens`."""
    assert parse(CHAT_URL).sampling["max_tokens"] is None
    assert SamplingParams(**parse(CHAT_URL).sampling).max_tokens is None
    assert parse(CHAT_URL, max_tokens=7, max_completion_tokens=5).sampling["max_tokens"] == 5
    assert parse(COMPLETIONS_URL).sampling["max_tokens"] == 16


def test_the_online_tests_named_for_streaming_exist():
    import importlib

    for node in ONLINE_ONLY.values():
        path, name = node.split("::")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        assert callable(getattr(module, name))
