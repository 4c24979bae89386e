"""OpenAI's Responses API on the service, driven by the `openai` client: the answer of a
Responses request is the answer of the chat completion it translates to, whole and streamed
(its typed events), with its tools, forced calls and their results fed back, a JSON schema, a
cut answer; a batch of `/v1/responses` lines answers the same; fields it cannot honour are 400s
naming them."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.engine.test_tool_calls_engine import SCHEMAS, TOOLS
from tests.system.test_online import MODEL, batch_answers, client
from tests.system.test_tool_calls_online import tools_serve

GREEDY = {"temperature": 0, "max_output_tokens": 8}
QUESTION = "What is the weather in Paris?"
# the Responses API's flat function tools
FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
NAMED = {"type": "function", "name": "get_weather"}
ANSWER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
          "required": ["city"], "additionalProperties": False}  # fmt: skip


def streamed(api: openai.OpenAI, **fields) -> tuple[list, openai.types.responses.Response]:
    """The events of a streamed request, and the Response the client put together from them
    (the last event's, for an answer cut short: the client puts together completed ones)."""
    with api.responses.stream(model=MODEL, **fields) as stream:
        events = list(stream)
        if events[-1].type == "response.incomplete":
            return events, events[-1].response
        return events, stream.get_final_response()


def calls_of(response) -> list[tuple[str, str]]:
    return [(i.name, i.arguments) for i in response.output if i.type == "function_call"]


def test_responses_answer_as_chat_completions_do(chat_model: Path, tmp_path: Path):
    with tools_serve(tmp_path, chat_model) as url:
        api = client(url)
        answer = api.responses.create(
            model=MODEL, instructions="Be brief.", input="Say hi", store=False, **GREEDY
        )
        chat = api.chat.completions.create(
            model=MODEL, max_tokens=8, temperature=0,
            messages=[{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Say hi"}],
        )  # fmt: skip
        assert answer.id.startswith("resp_") and answer.object == "response"
        assert answer.output_text == chat.choices[0].message.content
        assert answer.usage.input_tokens == chat.usage.prompt_tokens
        assert answer.usage.output_tokens == chat.usage.completion_tokens
        assert answer.usage.output_tokens_details.reasoning_tokens == 0
        cut = chat.choices[0].finish_reason == "length"
        assert answer.status == ("incomplete" if cut else "completed")
        assert answer.instructions == "Be brief." and answer.max_output_tokens == 8

        # input items: messages with parts, as a list
        items = [{"role": "system", "content": "Be brief."},
                 {"type": "message", "role": "user",
                  "content": [{"type": "input_text", "text": "Say hi"}]}]  # fmt: skip
        assert api.responses.create(model=MODEL, input=items, **GREEDY).output_text == (
            answer.output_text
        )

        # streamed: typed events, numbered, that the client puts together into the same answer
        events, final = streamed(api, instructions="Be brief.", input="Say hi", **GREEDY)
        for event in events:  # every event as the client's types hold it, strictly
            type(event).model_validate(event.model_dump(exclude_unset=True))
        kinds = [e.type for e in events]
        assert kinds[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", f"response.{answer.status}"]  # fmt: skip
        assert [e.sequence_number for e in events] == list(range(len(events)))
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == answer.output_text
        assert final.output_text == answer.output_text and final.status == answer.status
        assert final.usage.output_tokens == answer.usage.output_tokens

        # cut by max_output_tokens
        cut = api.responses.create(
            model=MODEL, input="Count", max_output_tokens=2, extra_body={"ignore_eos": True}
        )
        assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
        assert cut.usage.output_tokens == 2

        # text.format: JSON following a schema
        shaped = api.responses.create(
            model=MODEL, input="Where?", temperature=0, max_output_tokens=40,
            text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER}},
        )  # fmt: skip
        jsonschema.validate(json.loads(shaped.output_text), ANSWER)

        check_tools(api, url, tmp_path)
        check_refusals(api)


def check_tools(api: openai.OpenAI, url: str, tmp_path: Path) -> None:
    sampling = {"temperature": 1.0, "max_output_tokens": 300, "extra_body": {"seed": 5}}
    named = api.responses.create(
        model=MODEL, input=QUESTION, tools=FLAT_TOOLS, tool_choice=NAMED, **sampling
    )
    chat = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=300, temperature=1.0, seed=5,
    )  # fmt: skip
    ((name, arguments),) = calls_of(named)
    assert (name, arguments) == (
        chat.choices[0].message.tool_calls[0].function.name,
        chat.choices[0].message.tool_calls[0].function.arguments,
    )
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    (call,) = [i for i in named.output if i.type == "function_call"]
    assert call.call_id.startswith("chatcmpl-tool-") and call.id.startswith("fc_")

    required = api.responses.create(
        model=MODEL, input=QUESTION, tools=FLAT_TOOLS, tool_choice="required", **sampling
    )
    assert calls_of(required) and all(i.type == "function_call" for i in required.output)

    # streamed, the same seed gives the same call, argument deltas and all
    events, final = streamed(api, input=QUESTION, tools=FLAT_TOOLS, tool_choice=NAMED, **sampling)
    assert calls_of(final) == calls_of(named)
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == arguments

    # the call and its result go back as input items, as the client got them
    turn = [
        {"role": "user", "content": QUESTION},
        *[item.model_dump(exclude_none=True) for item in named.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"},
    ]
    after = api.responses.create(
        model=MODEL, input=turn, tools=FLAT_TOOLS, tool_choice="none", max_output_tokens=8
    )
    assert not calls_of(after) and after.output[0].type == "message"

    # a batch of the same bodies answers the same calls
    bodies = [
        {"model": MODEL, "input": QUESTION, "tools": FLAT_TOOLS, "tool_choice": choice,
         "temperature": 1.0, "max_output_tokens": 300, "seed": 5}
        for choice in (NAMED, "required")
    ]  # fmt: skip
    lines = batch_answers(url, "/v1/responses", bodies, tmp_path)
    for line, online in zip(lines, (named, required), strict=True):
        parsed = openai.types.responses.Response.model_validate(line)
        assert calls_of(parsed) == calls_of(online)
        assert parsed.status == online.status and parsed.object == "response"


def check_refusals(api: openai.OpenAI) -> None:
    refused = {
        "previous_response_id": {"previous_response_id": "resp_1"},
        "background": {"background": True},
        "tools[0]": {"tools": [{"type": "web_search"}]},
        "include[0]": {"include": ["file_search_call.results"]},
        "conversation": {"conversation": "conv_1"},
        "max_output_tokens": {"max_output_tokens": 0},
        "input[0].content": {"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
    }  # fmt: skip
    for param, fields in refused.items():
        body = {"input": "hi", **fields}
        with pytest.raises(openai.BadRequestError) as err:
            api.responses.create(model=MODEL, **body)
        assert err.value.body["param"] == param, err.value.body
    with pytest.raises(openai.NotFoundError):
        api.responses.create(model="nobody", input="hi")
