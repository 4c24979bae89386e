"""Tool calls through the service, driven by the `openai` client: forced calls (required, a named
function) and calls the model writes (auto, read by --tool-call-parser hermes), answered whole
and streamed alike, the calls and their results fed back for the next turn, errors naming their
field, and a batch of the same bodies answering the same calls."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.engine.test_tool_calls_engine import SCHEMAS, TOOLS, TOOLS_TEMPLATE
from tests.system.test_online import MODEL, batch_answers, client, embedded_serve

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SAMPLING = {"temperature": 1.0, "seed": 5, "max_tokens": 300}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# the random model is made to write a hermes call (a regex over its output), as a tool model would
HERMES_CALL = (
    r'Let me see\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "[a-z]{1,6}", "days": [1-7]\}\}\n</tool_call>'
)
CASES = {  # name -> (fields of the request, finish_reason)
    "required": ({"tool_choice": "required"}, "tool_calls"),
    "one required": ({"tool_choice": "required", "parallel_tool_calls": False}, "tool_calls"),
    "named": ({"tool_choice": NAMED}, "stop"),
    "auto": ({"guided_regex": HERMES_CALL}, "tool_calls"),
}


def typed(fields: dict) -> dict:
    """The fields as the client's arguments: vLLM's extension in its `extra_body`."""
    return {k: v for k, v in fields.items() if k != "guided_regex"} | (
        {"extra_body": {"guided_regex": fields["guided_regex"]}} if "guided_regex" in fields else {}
    )


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def streamed(api: openai.OpenAI, fields: dict) -> tuple[str, list[tuple[str, str]], str]:
    """The content, calls and finish reason a stream's chunks put together."""
    content, calls, finish = "", {}, None
    for chunk in api.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, stream=True, **SAMPLING, **typed(fields)
    ):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                now = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                if call.id is not None:
                    assert now["id"] is None and call.id.startswith("chatcmpl-tool-")
                    now["id"], now["name"] = call.id, call.function.name
                now["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [(c["name"], c["arguments"]) for c in calls.values()], finish


@contextlib.contextmanager
def tools_serve(tmp_path: Path, chat_model: Path) -> Iterator[str]:
    """The service with a template that renders tools, and the hermes tool-call parser."""
    template = tmp_path / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    extra = ("--dtype", "float32", "--chat-template", str(template), "--tool-call-parser", "hermes")
    with embedded_serve(tmp_path, chat_model, *extra) as url:
        yield url


def test_tool_calls_online_streamed_fed_back_and_in_a_batch(chat_model: Path, tmp_path: Path):
    with tools_serve(tmp_path, chat_model) as url:
        api = client(url)
        answers = {}
        for name, (fields, finish) in CASES.items():
            answer = api.chat.completions.create(
                model=MODEL, messages=MESSAGES, tools=TOOLS, **SAMPLING, **typed(fields)
            )
            (choice,) = answer.choices
            assert choice.finish_reason == finish, name
            calls = calls_of(choice.message)
            assert calls and all(
                c.id.startswith("chatcmpl-tool-") for c in choice.message.tool_calls
            )
            for called, arguments in calls:
                jsonschema.validate(json.loads(arguments), SCHEMAS[called])
            if name != "required":
                assert len(calls) == 1
            want_content = "Let me see.\n" if name == "auto" else ""
            assert choice.message.content == want_content, name
            # streamed, the same seed gives the same calls
            assert streamed(api, fields) == (want_content, calls, finish), name
            answers[name] = answer

        # the openai client's own stream helper puts the chunks together into the same calls
        with api.chat.completions.stream(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, **SAMPLING
        ) as stream:
            final = stream.get_final_completion()
        assert calls_of(final.choices[0].message) == calls_of(answers["named"].choices[0].message)

        # the call and its result go back for the next turn: the message as the client got it
        message = answers["named"].choices[0].message
        (call,) = message.tool_calls
        turn = [*MESSAGES, message, {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
        after = api.chat.completions.create(
            model=MODEL, messages=turn, tools=TOOLS, tool_choice="none", max_tokens=8
        )
        assert after.choices[0].message.tool_calls is None
        assert after.choices[0].message.content

        # the same bodies in a batch answer the same calls
        bodies = [
            {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, **SAMPLING, **fields}
            for fields, _ in CASES.values()
        ]
        for body, (name, answer) in zip(
            batch_answers(url, "/v1/chat/completions", bodies, tmp_path),
            answers.items(),
            strict=True,
        ):
            (choice,) = body["choices"]
            got = [(c["function"]["name"], c["function"]["arguments"])
                   for c in choice["message"]["tool_calls"]]  # fmt: skip
            assert got == calls_of(answer.choices[0].message), name
            assert choice["finish_reason"] == answer.choices[0].finish_reason

        with pytest.raises(openai.BadRequestError) as bad_type:
            api.chat.completions.create(
                model=MODEL, messages=MESSAGES, tools=[{"type": "custom", "custom": {"name": "x"}}]
            )
        assert bad_type.value.body["param"] == "tools[0]" and "custom" in bad_type.value.message
        with pytest.raises(openai.BadRequestError) as unknown_name:
            api.chat.completions.create(
                model=MODEL, messages=MESSAGES, tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "get_news"}},
            )  # fmt: skip
        assert unknown_name.value.body["param"] == "tool_choice"
        assert "get_news" in unknown_name.value.message
        lookahead = {"type": "object", "properties": {"q": {"type": "string", "pattern": "(?=x)"}}}
        uncompilable = {
            "type": "function",
            "function": {"name": "lookahead", "parameters": lookahead},
        }
        with pytest.raises(openai.BadRequestError) as bad_schema:
            api.chat.completions.create(
                model=MODEL, messages=MESSAGES, tools=[uncompilable], tool_choice="required"
            )
        assert bad_schema.value.code == "invalid_function_parameters"
        assert bad_schema.value.body["param"] == "tools[0].function.parameters"
        assert "lookahead" in bad_schema.value.message
