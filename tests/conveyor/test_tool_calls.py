"""Tool calls: each parser on recorded outputs of its format (malformed ones are content, never
an error), the body's tools and tool_choice checked, the forced-call schemas, the chat
completion's tool_calls as the `openai` package parses them, and streamed deltas that join to
exactly the whole answer."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from conveyor.engine.errors import StructuredOutputError
from conveyor.engine.outputs import CompletionOutput, RequestOutput
from conveyor.request_outcome import engine_error, prepare_request
from conveyor.wire_format.errors import (
    INVALID_FUNCTION_PARAMETERS,
    INVALID_RESPONSE_FORMAT,
    RequestError,
)
from conveyor.wire_format.reasoning import PARSERS as REASONING
from conveyor.wire_format.request_line import parse_request_line
from conveyor.wire_format.responses import chat_completion_body
from conveyor.wire_format.streaming import ChunkStream
from conveyor.wire_format.token_text import TokenDecoder
from conveyor.wire_format.tool_calls import PARSERS
from conveyor.worker.echo import EchoEngine

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "the time now"}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
PARIS = '{"city": "Paris"}'
BOTH = [("get_weather", PARIS), ("get_time", "{}")]
ASK = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
REQUIRED_ANSWER = (
    '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
    '{"name": "get_time", "parameters": {}}]'
)

# (parser, a model's output, (content, [(name, arguments)])): recorded outputs of each format
RECORDED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     (None, [("get_weather", PARIS)])),
    ("hermes", 'I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
     '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     ("I will look.\n", BOTH)),
    ("hermes", "The weather in Paris is mild.", ("The weather in Paris is mild.", [])),
    # malformed: invalid JSON, a block never closed, no name, arguments not an object
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
     ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>', [])),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
     ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', [])),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>',
     ('<tool_call>{"arguments": {}}</tool_call>', [])),
    ("hermes", '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
     ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>', [])),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     (None, [("get_weather", PARIS)])),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {}}', (None, BOTH)),
    ("llama3_json", '\n{"name": "get_weather", "arguments": {"city": "Zürich"}}',
     (None, [("get_weather", '{"city": "Zürich"}')])),
    ("llama3_json", 'It is {"sunny": true} today.', ('It is {"sunny": true} today.', [])),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}',
     ('{"name": "get_weather", "parameters": {"city": "Paris"}', [])),
    ("llama3_json", '{"name": "a", "parameters": {}} and more',
     ('{"name": "a", "parameters": {}} and more', [])),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": {}}]', (None, BOTH)),
    ("mistral", 'Let me see. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
     ("Let me see. ", [("get_weather", PARIS)])),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
     (None, BOTH)),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par',
     ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par', [])),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"}',
     ('[TOOL_CALLS]get_weather{"city": "Paris"}', [])),
    ("mistral", "No tool needed.", ("No tool needed.", [])),
]  # fmt: skip


@pytest.mark.parametrize("parser, output, want", RECORDED)
def test_recorded_outputs_parse_as_the_parser_says(parser, output, want):
    content, calls = PARSERS[parser].parse(output)
    assert (content, [(c.name, c.arguments) for c in calls]) == want


def chat_request(parser: str | None = None, **body):
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {**ASK, **body}}  # fmt: skip
    engine = EchoEngine()
    engine.tool_call_parser = parser
    request = parse_request_line(json.dumps(line), line=1)
    prepare_request(engine, request)
    return request


def output_of(text: str, finish="stop", finished=True, n: int = 1) -> RequestOutput:
    ids = list(range(len(text)))
    comps = [CompletionOutput(i, text, ids, None, None, finish if finished else None)
             for i in range(n)]  # fmt: skip
    return RequestOutput("r", None, [1], None, comps, finished=finished, num_cached_tokens=0)


def body_of(request, text: str, finish="stop") -> dict:
    body = chat_completion_body(request, output_of(text, finish), "m", TokenDecoder(None))
    ChatCompletion.model_validate(body)  # the `openai` package reads it
    return body


def calls_of(message: dict) -> list[tuple[str, str]]:
    calls = message.get("tool_calls") or []
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("parser, output, want", RECORDED)
def test_an_auto_chat_answers_with_the_calls_the_parser_finds(parser, output, want):
    choice = body_of(chat_request(parser, tools=TOOLS), output)["choices"][0]
    content, calls = want
    assert (choice["message"]["content"], calls_of(choice["message"])) == want
    assert choice["finish_reason"] == ("tool_calls" if calls else "stop")
    for call in choice["message"].get("tool_calls", []):
        assert call["type"] == "function"
        if parser == "mistral":  # Mistral's templates take no other ids
            assert re.fullmatch("[A-Za-z0-9]{9}", call["id"])
        else:
            assert re.fullmatch("chatcmpl-tool-[0-9a-f]{32}", call["id"])


def test_forced_calls_answer_as_vllm_does():
    required = chat_request(None, tools=TOOLS, tool_choice="required")
    answer = REQUIRED_ANSWER
    choice = body_of(required, answer)["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("", "tool_calls")
    assert calls_of(choice["message"]) == [("get_weather", PARIS), ("get_time", "{}")]
    one = chat_request(None, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert calls_of(body_of(one, answer)["choices"][0]["message"]) == [("get_weather", PARIS)]
    cut = body_of(required, '[{"name": "get_weather", "param', "length")["choices"][0]
    assert cut["message"]["content"] == '[{"name": "get_weather", "param'
    assert (cut["finish_reason"], calls_of(cut["message"])) == ("length", [])

    named = chat_request(None, tools=TOOLS, tool_choice=NAMED)
    choice = body_of(named, PARIS)["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("", "stop")
    assert calls_of(choice["message"]) == [("get_weather", PARIS)]


def test_forced_choices_constrain_the_output_with_the_tools_schemas():
    named = chat_request(None, tools=TOOLS, tool_choice=NAMED)
    assert named.sampling["structured_outputs"] == {"json": WEATHER}
    required = chat_request(None, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    schema = required.sampling["structured_outputs"]["json"]
    assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
    names = [option["properties"]["name"]["enum"] for option in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    no_parameters = schema["items"]["anyOf"][1]["properties"]["parameters"]
    assert no_parameters == {"type": "object", "properties": {}, "additionalProperties": False}
    assert "maxItems" not in chat_request(None, tools=TOOLS, tool_choice="required").sampling[
        "structured_outputs"]["json"]  # fmt: skip
    # with a reasoning parser the call is forced after the thinking, as vLLM does
    engine = EchoEngine()
    engine.reasoning_parser = "qwen3"
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {**ASK, "tools": TOOLS, "tool_choice": NAMED}}  # fmt: skip
    _, params = prepare_request(engine, parse_request_line(json.dumps(line)))
    assert params.structured_outputs.after == "</think>"


def test_thinking_is_split_off_before_the_calls_are_read():
    request = chat_request("hermes", tools=TOOLS)
    request.reasoning = REASONING["qwen3"]
    text = "<think>Paris, so the weather tool.</think>\n\n" + RECORDED[0][1]
    choice = body_of(request, text)["choices"][0]
    assert choice["message"]["reasoning"] == "Paris, so the weather tool."
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
    assert calls_of(choice["message"]) == [("get_weather", PARIS)]


def test_none_offers_the_template_the_tools_and_reads_no_calls():
    engine = EchoEngine()
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {**ASK, "tools": TOOLS, "tool_choice": "none"}}  # fmt: skip
    request = parse_request_line(json.dumps(line))
    prompt, params = prepare_request(engine, request)  # no parser needed
    assert prompt.endswith("tools: get_weather, get_time")
    assert request.tool_use is None and params.structured_outputs is None
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    choice = body_of(request, text)["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (text, "stop")
    assert "tool_calls" not in choice["message"]


def refusal(parser: str | None = None, **body) -> RequestError:
    with pytest.raises(RequestError) as info:
        chat_request(parser, **body)
    return info.value


def test_auto_without_a_parser_is_refused_naming_the_flag():
    err = refusal(None, tools=TOOLS)
    assert (err.param, err.status_code) == ("body.tool_choice", 400)
    assert "--tool-call-parser" in str(err)
    mistral = EchoEngine()
    mistral.tool_call_parser = "mistral"
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {**ASK, "tools": TOOLS}}  # fmt: skip
    _, params = prepare_request(mistral, parse_request_line(json.dumps(line)))
    assert params.skip_special_tokens is False  # [TOOL_CALLS] is a special token


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"tools": [{"type": "web_search"}]}, "body.tools[0]", '"web_search"'),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "body.tools[0]", '"custom"'),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "body.tool_choice", '"nope"'),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "body.tool_choice", '"sometimes"'),
        ({"tool_choice": "required"}, "body.tool_choice", "no tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "body.tool_choice", "response_format"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "body.parallel_tool_calls", "boolean"),
        ({"messages": [{"role": "tool", "content": "sunny"}]}, "body.messages[0]", "tool_call_id"),
        ({"messages": [{"role": "user", "content": "q", "tool_call_id": "1"}]},
         "body.messages[0]", "tool_call_id"),
        ({"messages": [{"role": "assistant", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
         "body.messages[0].tool_calls[0].function.arguments", "{oops"),
    ],
)  # fmt: skip
def test_bad_tools_fail_naming_the_field(body, param, needle):
    err = refusal("hermes", **body)
    assert err.param == param and needle in str(err), str(err)


def test_a_forced_tool_whose_schema_cannot_compile_fails_naming_the_tool():
    lookahead = {"type": "object", "properties": {"q": {"type": "string", "pattern": "(?=x)"}}}
    bad = {"type": "function", "function": {"name": "lookahead", "parameters": lookahead}}
    for choice in ("required", {"type": "function", "function": {"name": "lookahead"}}):
        err = refusal("hermes", tools=[*TOOLS, bad], tool_choice=choice)
        assert (err.code, err.param) == (
            INVALID_FUNCTION_PARAMETERS,
            "body.tools[2].function.parameters",
        )
        assert '"lookahead"' in str(err) and "look-around" in str(err)
    # only a forced call is compiled: the model may call it under "auto", as with vLLM
    assert chat_request("hermes", tools=[*TOOLS, bad]).tool_use.choice == "auto"
    assert (
        chat_request("hermes", tools=[*TOOLS, bad], tool_choice=NAMED).tool_use.name
        == "get_weather"
    )


def test_a_forced_calls_grammar_failing_in_the_engine_names_the_tools():
    forced = chat_request(None, tools=TOOLS, tool_choice="required")
    err = engine_error(StructuredOutputError("compile timed out"), forced, "r1")
    assert (err.code, err.param, err.status_code) == (
        INVALID_FUNCTION_PARAMETERS,
        "body.tools",
        400,
    )
    auto = chat_request("hermes", tools=TOOLS, response_format={"type": "json_object"})
    err = engine_error(StructuredOutputError("compile timed out"), auto, "r2")
    assert (err.code, err.param) == (INVALID_RESPONSE_FORMAT, "body.response_format")


def test_calls_and_results_go_back_to_the_template():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call-1", "type": "function",
         "function": {"name": "get_weather", "arguments": PARIS}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "18 C, sunny"},
    ]  # fmt: skip
    request = chat_request("hermes", tools=TOOLS, messages=messages)
    assert request.messages[1]["tool_calls"] == [{"id": "call-1", "type": "function", "function":
        {"name": "get_weather", "arguments": {"city": "Paris"}}}]  # fmt: skip
    assert request.messages[2] == {
        "role": "tool",
        "content": "18 C, sunny",
        "tool_call_id": "call-1",
    }
    # an answer's message as the openai client sends it back: its refusal (null) is accepted and
    # its thinking goes to the template under the name Qwen3's reads
    echoed = {"role": "assistant", "content": "4", "refusal": None, "reasoning": "2 + 2"}
    again = chat_request("hermes", tools=TOOLS, messages=[*messages, echoed])
    assert again.messages[3] == {"role": "assistant", "content": "4", "reasoning_content": "2 + 2"}


# ---- streaming ---------------------------------------------------------------------------------
FORCED = [  # (tool_choice, parallel_tool_calls, output)
    ("required", True, REQUIRED_ANSWER),
    ("required", False, REQUIRED_ANSWER),
    ("required", True, '[{"name": "get_weather", "par'),
    (NAMED, True, '{"city": "Paris", "unit": "C"}'),
    (NAMED, True, ""),
]  # fmt: skip
CASES = [(p, {"tools": TOOLS}, out) for p, out, _ in RECORDED] + [
    (None, {"tools": TOOLS, "tool_choice": c, "parallel_tool_calls": par}, out)
    for c, par, out in FORCED
]


def joined(chunks: list[dict]) -> dict:
    """The message, finish reason and calls the chunks of choice 0 put together, as a client
    puts them together."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                now = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                if "id" in call:
                    assert "name" in call["function"] and not now["name"]  # the call's first
                    now["name"] = call["function"]["name"]
                now["arguments"] += call["function"].get("arguments", "")
            finish = choice["finish_reason"] or finish
    return {"content": content, "calls": [(c["name"], c["arguments"]) for c in calls.values()],
            "finish": finish}  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 120), max_size=8))
def test_streamed_deltas_join_to_the_whole_answer(case, cuts):
    parser, body, output = case
    request = chat_request(parser, **body)
    whole = body_of(request, output)["choices"][0]
    stream = ChunkStream([request], 1, "m", TokenDecoder(None), chat=True)
    chunks = []
    for cut in sorted(c for c in cuts if c < len(output)):
        chunks += stream.chunks(0, output_of(output[:cut], finished=False))
    chunks += stream.chunks(0, output_of(output))
    got = joined(chunks)
    assert got["content"] == (whole["message"]["content"] or "")
    assert got["calls"] == calls_of(whole["message"])
    assert got["finish"] == whole["finish_reason"]


def test_content_streams_before_a_call_and_named_arguments_as_they_come():
    request = chat_request("hermes", tools=TOOLS)
    stream = ChunkStream([request], 1, "m", TokenDecoder(None), chat=True)
    text = RECORDED[1][1]
    early = stream.chunks(0, output_of(text[: len("I will look.\n<tool")], finished=False))
    assert [c["choices"][0]["delta"].get("content") for c in early] == ["", "I will look.\n"]
    inside = stream.chunks(0, output_of(text[:60], finished=False))
    assert inside == []  # the call is held until it is whole

    named = chat_request(None, tools=TOOLS, tool_choice=NAMED)
    stream = ChunkStream([named], 1, "m", TokenDecoder(None), chat=True)
    assert stream.chunks(0, output_of("", finished=False))[0]["choices"][0]["delta"] == {
        "role": "assistant", "content": ""}  # fmt: skip
    first = stream.chunks(0, output_of(PARIS[:5], finished=False))[-1]["choices"][0]["delta"]
    (header,) = first["tool_calls"]
    assert header["function"] == {"name": "get_weather", "arguments": '{"cit'}
    assert header["index"] == 0 and header["id"].startswith("chatcmpl-tool-")
    then = stream.chunks(0, output_of(PARIS[:9], finished=False))[-1]["choices"][0]["delta"]
    assert then["tool_calls"] == [{"index": 0, "function": {"arguments": 'y": '}}]


def test_the_engine_option_names_every_parser():
    from conveyor.engine.config import TOOL_CALL_PARSERS

    assert set(TOOL_CALL_PARSERS) == set(PARSERS)
