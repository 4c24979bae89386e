"""Tool calls through the engine, on a tiny random checkpoint whose chat template renders tools
(Qwen's hermes format): the tools, an earlier call and its result reach the prompt; a forced
call ("required" or a named function) is valid for its tool's schema whatever the random model
would write, because the grammar forces it; and under "auto" the hermes parser reads the calls
the model writes."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from conveyor.engine import LLM, SamplingParams
from conveyor.request_outcome import prepare_request
from conveyor.wire_format.request_line import ParsedRequest, parse_request_line
from conveyor.wire_format.responses import chat_completion_body
from conveyor.wire_format.token_text import TokenDecoder
from tests.engine.test_structured_output import SCHEMAS as GENERATED_SCHEMAS

# a hermes-style template, as Qwen2.5's: the tools in a system turn, calls in <tool_call> blocks
# (their arguments written as objects), results in <tool_response> blocks
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'For each call write <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% for call in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}},
]  # fmt: skip
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(str(checkpoints["llama"]), device="cpu", dtype="float32", seed=3,
               chat_template=TOOLS_TEMPLATE, tool_call_parser="hermes")  # fmt: skip


@pytest.fixture(scope="module")
def plain_llm(checkpoints):
    """The checkpoint's own template, which leaves the tools out: many long schemas fit."""
    return LLM(str(checkpoints["llama"]), device="cpu", dtype="float32", seed=3)


def chat(**body) -> ParsedRequest:
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": MESSAGES, "tools": TOOLS, **body}}  # fmt: skip
    return parse_request_line(json.dumps(line))


def answer(llm: LLM, request: ParsedRequest) -> dict:
    prompt, params = prepare_request(llm, request)
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    return chat_completion_body(request, output, "m", TokenDecoder(llm.tokenizer))


def test_the_template_gets_the_tools_and_the_calls_and_results_given_back(llm):
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call-1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "18 C, sunny"},
    ]  # fmt: skip
    prompt, _ = prepare_request(llm, chat(messages=messages))
    text = llm.tokenizer.decode(prompt.token_ids)
    assert json.dumps(TOOLS[0]) in text
    # the arguments reach the template as an object: written once, not as a quoted string
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # the library's chat offers the template the same tools
    (output,) = llm.chat(MESSAGES, use_tqdm=False, tools=TOOLS)
    assert json.dumps(TOOLS[1]) in llm.tokenizer.decode(output.prompt_token_ids)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "choice",
    [{"tool_choice": "required", "parallel_tool_calls": False},
     {"tool_choice": "required"},
     {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}],
)  # fmt: skip
def test_a_forced_call_is_always_valid_for_its_schema(llm, seed, choice):
    body = answer(llm, chat(temperature=1.0, seed=seed, max_tokens=400, **choice))
    (picked,) = body["choices"]
    message = picked["message"]
    assert message["content"] == "" and message["tool_calls"]
    named = isinstance(choice["tool_choice"], dict)
    assert picked["finish_reason"] == ("stop" if named else "tool_calls")
    if named or choice.get("parallel_tool_calls") is False:
        assert len(message["tool_calls"]) == 1
    for call in message["tool_calls"]:
        name = call["function"]["name"]
        assert not named or name == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


@settings(
    max_examples=4,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.lists(GENERATED_SCHEMAS, min_size=1, max_size=3), st.integers(0, 1000))
def test_forced_calls_follow_any_tools_schemas(plain_llm, schemas, seed):
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": schema}}
             for i, schema in enumerate(schemas)]  # fmt: skip
    for choice in ("required", {"type": "function", "function": {"name": "tool_0"}}):
        body = answer(plain_llm, chat(tools=tools, tool_choice=choice, parallel_tool_calls=False,
                                temperature=1.0, seed=seed, max_tokens=400))  # fmt: skip
        (call,) = body["choices"][0]["message"]["tool_calls"]
        index = int(call["function"]["name"].removeprefix("tool_"))
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[index])


def test_auto_reads_the_calls_the_model_writes(llm):
    # the random model is made to write a hermes call (a regex over its output): the parser
    # reads it as any model's
    arguments = r'\{"city": "[a-z]{1,6}", "days": [1-7]\}'
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": ' + arguments + r"\}\n</tool_call>"
    body = answer(llm, chat(temperature=1.0, seed=1, guided_regex="Let me see\\.\n" + call))
    (picked,) = body["choices"]
    assert picked["finish_reason"] == "tool_calls"
    assert picked["message"]["content"] == "Let me see.\n"
    ((made),) = picked["message"]["tool_calls"]
    assert made["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(made["function"]["arguments"]), WEATHER)


def test_special_tokens_kept_for_a_parser_leave_out_the_token_that_ended_the_output(llm):
    # the mistral parser keeps special tokens ([TOOL_CALLS] is one): the EOS that ends the
    # output is no part of its text, nor is a stop token id's, as in vLLM
    eos = llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    kept = SamplingParams(max_tokens=8, min_tokens=2, skip_special_tokens=False,
                          logit_bias={eos: 100.0})  # fmt: skip
    (out,) = llm.generate(["Hello"], kept, use_tqdm=False)[0].outputs
    assert out.token_ids[-1] == eos and out.finish_reason == "stop"
    assert out.text == llm.tokenizer.decode(out.token_ids[:-1], skip_special_tokens=False)
    assert "<|im_end|>" not in out.text
    stop_at = llm.tokenizer("Paris", add_special_tokens=False).input_ids[0]
    stopped = SamplingParams(max_tokens=8, min_tokens=1, stop_token_ids=[stop_at],
                             logit_bias={stop_at: 100.0})  # fmt: skip
    (out,) = llm.generate(["Hello"], stopped, use_tqdm=False)[0].outputs
    assert (out.token_ids[-1], out.stop_reason) == (stop_at, stop_at)
    assert out.text == llm.tokenizer.decode(out.token_ids[:-1])


def test_the_mistral_parser_reads_the_calls_the_model_writes(checkpoints):
    mistral = LLM(str(checkpoints["llama"]), device="cpu", dtype="float32",
                  chat_template=TOOLS_TEMPLATE, tool_call_parser="mistral")  # fmt: skip
    arguments = r'\{"city": "[a-z]{1,6}", "days": [1-7]\}'
    written = r"\[TOOL_CALLS\]get_weather\[ARGS\]" + arguments
    request = chat(temperature=1.0, seed=2, guided_regex=written)
    (picked,) = answer(mistral, request)["choices"]
    assert picked["finish_reason"] == "tool_calls" and picked["message"]["content"] is None
    (made,) = picked["message"]["tool_calls"]
    assert made["function"]["name"] == "get_weather" and len(made["id"]) == 9
    jsonschema.validate(json.loads(made["function"]["arguments"]), WEATHER)


def test_without_the_flag_the_templates_markers_choose_the_parser(checkpoints):
    from conveyor.engine.chat_template import tool_call_parser_of

    assert tool_call_parser_of(TOOLS_TEMPLATE) == "hermes"
    assert tool_call_parser_of("{{ '[TOOL_CALLS]' }}{{ messages }}") == "mistral"
    assert tool_call_parser_of("<|python_tag|>{{ messages }}") == "llama3_json"
    assert tool_call_parser_of("{{ messages }}") is None
    assert tool_call_parser_of("<tool_call> or [TOOL_CALLS]") is None  # which one: say it
    found = LLM(str(checkpoints["llama"]), device="cpu", dtype="float32",
                chat_template=TOOLS_TEMPLATE)  # fmt: skip
    assert found.tool_call_parser == "hermes"
    given = LLM(str(checkpoints["llama"]), device="cpu", dtype="float32",
                chat_template=TOOLS_TEMPLATE, tool_call_parser="mistral")  # fmt: skip
    assert given.tool_call_parser == "mistral"  # the flag wins
