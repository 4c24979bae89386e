"""The Responses API's translation: a Responses body into the chat body Conveyor runs (and its
refusals, naming the Responses field), and the chat answer back into a Response object and its
typed stream events, each held to the `openai` package's own types."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from conveyor.wire_format.errors import RequestError
from conveyor.wire_format.reasoning import PARSERS
from conveyor.wire_format.request_line import ParsedRequest, parse_online_body, parse_request_line
from conveyor.wire_format.response_events import ResponseEvents
from conveyor.wire_format.response_object import response_from_chat
from conveyor.wire_format.responses import chat_completion_body
from conveyor.wire_format.responses_body import encode_reasoning
from conveyor.wire_format.result_lines import build_output_line
from conveyor.wire_format.streaming import ChunkStream
from conveyor.wire_format.token_text import TokenDecoder

URL = "/v1/responses"
EVENTS = TypeAdapter(ResponseStreamEvent)
DECODER = TokenDecoder(None)
TOOL = {"type": "function", "name": "get_weather", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}  # fmt: skip


def request_of(body: dict, thinking: bool = False) -> ParsedRequest:
    (request,) = parse_online_body(URL, {"model": "m", **body}).requests
    if thinking:  # as the worker sets it for a server started with --reasoning-parser
        request.reasoning = PARSERS["deepseek_r1"]
    return request


def output(text: str, finish_reason: str | None = "stop", tokens: int = 3) -> SimpleNamespace:
    comp = SimpleNamespace(index=0, text=text, token_ids=list(range(tokens)), logprobs=None,
                           finish_reason=finish_reason)  # fmt: skip
    return SimpleNamespace(outputs=[comp], prompt_token_ids=[1, 2], num_cached_tokens=0,
                           finished=finish_reason is not None, prompt=None)  # fmt: skip


def answer(request: ParsedRequest, text: str, finish_reason: str = "stop") -> Response:
    chat = chat_completion_body(request, output(text, finish_reason), "m", DECODER)
    return Response.model_validate(response_from_chat(request, chat))


def stream_events(request: ParsedRequest, texts: list[str], finish_reason: str = "stop") -> list:
    """The events of an answer that grew through `texts`, each held to the client's types."""
    events = ResponseEvents(ChunkStream([request], 1, "m", DECODER, chat=True), request)
    sent = []
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        sent += events.chunks(0, output(text, finish_reason if last else None))
    chat = chat_completion_body(request, output(texts[-1], finish_reason), "m", DECODER)
    sent.append(events.usage_chunk(chat["usage"]))
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    return [EVENTS.validate_python(event) for event in sent]


def test_a_responses_body_becomes_the_chat_body_it_means():
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "encrypted_content": encode_reasoning("I should call it")},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "It is 18 C.", "annotations": []}]},
    ]  # fmt: skip
    request = request_of({
        "instructions": "Be brief.", "input": items, "max_output_tokens": 7, "temperature": 0,
        "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
        "include": ["message.output_text.logprobs"], "top_logprobs": 2,
        "reasoning": {"effort": "none", "summary": "auto"}, "store": True,
        "metadata": {"k": "v"}, "user": "u",
    })  # fmt: skip
    assert request.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "reasoning_content": "I should call it",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        {"role": "assistant", "content": "It is 18 C."},
    ]  # fmt: skip
    assert request.sampling["max_tokens"] == 7 and request.sampling["logprobs"] == 2
    assert request.sampling["structured_outputs"] == {"json": TOOL["parameters"]}
    assert request.tools == [{"type": "function", "function": {
        "name": "get_weather", "parameters": TOOL["parameters"], "strict": True}}]  # fmt: skip
    assert request.chat_template_kwargs == {"reasoning_effort": "none", "enable_thinking": False}
    assert request.tool_use is not None and request.tool_use.name == "get_weather"


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "unsupported_parameter"),
        ({"background": True}, "background", "unsupported_parameter"),
        ({"conversation": {"id": "c"}}, "conversation", "unsupported_parameter"),
        ({"prompt": {"id": "p"}}, "prompt", "unsupported_parameter"),
        ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]", "unsupported_parameter"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0]", "unsupported_parameter"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice", "unsupported_parameter"),
        ({"include": ["web_search_call.results"]}, "include[0]", "unsupported_parameter"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]", "unsupported_parameter"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content",
            "invalid_request",
        ),  # fmt: skip
        (
            {"input": [{"type": "reasoning", "encrypted_content": "opaque"}]},
            "input[0].encrypted_content",
            "invalid_request",
        ),  # fmt: skip
        ({"max_tokens": 5}, "max_tokens", "unknown_parameter"),
        ({"messages": []}, "messages", "unknown_parameter"),
        ({"max_output_tokens": 0}, "max_output_tokens", "invalid_request"),
        ({"temperature": 3}, "temperature", "invalid_request"),
        ({"top_logprobs": 3}, "top_logprobs", "invalid_request"),
        ({"reasoning": {"mode": "pro"}}, "reasoning.mode", "unknown_parameter"),
        (
            {"text": {"format": {"type": "json_schema", "schema": {}}}},
            "text.format.name",
            "invalid_request",
        ),  # fmt: skip
        (
            {"tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]},
            "tool_choice",
            "invalid_request",
        ),  # fmt: skip
        ({"input": []}, "input", "invalid_request"),
    ],
)
def test_what_a_responses_body_cannot_ask_is_refused_naming_it(fields, param, code):
    with pytest.raises(RequestError) as err:
        parse_online_body(URL, {"model": "m", "input": "hi", **fields})
    assert (err.value.param, err.value.code) == (f"body.{param}", code), err.value.detail
    assert f'"body.{param}"' in err.value.detail


def test_store_false_and_true_are_accepted_and_echoed():
    for store in (False, True):
        assert answer(request_of({"input": "hi", "store": store}), "hello").store is store


def test_a_batch_line_of_the_responses_api_answers_a_response():
    line = ('{"custom_id": "a", "method": "POST", "url": "/v1/responses", '
            '"body": {"model": "m", "input": "hi", "metadata": {"k": "v"}}}')  # fmt: skip
    request = parse_request_line(line, line=1)
    body = build_output_line(request, output("hello"), "m", DECODER)["response"]["body"]
    response = Response.model_validate(body)
    assert (response.output_text, response.status, response.metadata) == ("hello", "completed",
                                                                          {"k": "v"})  # fmt: skip
    assert response.usage.input_tokens == 2 and response.usage.output_tokens == 3


def test_the_thinking_is_a_reasoning_item_and_may_come_back_encoded():
    request = request_of({"input": "2+2?", "include": ["reasoning.encrypted_content"]}, True)
    response = answer(request, "two and two</think>4")
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [part.text for part in reasoning.content] == ["two and two"]
    assert response.output_text == "4" and response.usage.output_tokens_details.reasoning_tokens
    # the next turn gives it back, and the template gets the thinking
    again = request_of({"input": [{"role": "user", "content": "2+2?"},
                                  reasoning.model_dump(exclude={"content"}),
                                  message.model_dump()]})  # fmt: skip
    assert again.messages[-1] == {"role": "assistant", "content": "4",
                                  "reasoning_content": "two and two"}  # fmt: skip


def test_an_answer_cut_in_its_thinking_is_incomplete_with_an_empty_message():
    request = request_of({"input": "2+2?", "max_output_tokens": 3}, thinking=True)
    response = answer(request, "two and", "length")
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output_text == "" and response.output[0].status == "incomplete"
    events = stream_events(request, ["two", "two and"], "length")
    assert events[-1].type == "response.incomplete"
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]


def test_streamed_thinking_and_text_are_typed_events_ending_in_the_whole_response():
    request = request_of({"input": "2+2?", "stream": True}, thinking=True)
    events = stream_events(request, ["two", "two and two</th", "two and two</think>4", "two and "
                                     "two</think>4 it is"])  # fmt: skip
    kinds = [event.type for event in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    final = events[-1].response
    assert final.output_text == "4 it is" and final.output[0].content[0].text == "two and two"
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert final.output == done and final.id == events[0].response.id


def test_a_streamed_named_call_is_a_function_call_item_with_argument_deltas():
    request = request_of({"input": "Weather?", "tools": [TOOL], "stream": True,
                          "tool_choice": {"type": "function", "name": "get_weather"}})  # fmt: skip
    events = stream_events(request, ['{"city"', '{"city": "Paris"}'])
    kinds = [event.type for event in events]
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    (call,) = events[-1].response.output
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')
    assert events[2].item.call_id == call.call_id
