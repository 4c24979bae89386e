"""A reasoning model's thinking split from its answer, on recorded outputs of each format (an
unclosed block, a stray end marker), whole and streamed: the streamed deltas of the thinking
and of the answer join to exactly the whole output's."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.demo_model import build_tokenizer
from conveyor.engine.outputs import CompletionOutput, RequestOutput
from conveyor.request_outcome import prepare_request
from conveyor.wire_format.reasoning import PARSERS, reasoning_tokens
from conveyor.wire_format.request_line import parse_request_line
from conveyor.wire_format.responses import chat_completion_body
from conveyor.wire_format.streaming import ChunkStream
from conveyor.wire_format.token_text import TokenDecoder
from conveyor.worker.echo import EchoEngine

QWEN3, R1 = PARSERS["qwen3"], PARSERS["deepseek_r1"]

RECORDED = [  # (parser, output, (thinking, answer))
    (QWEN3, "<think>\nLet me add.\n</think>\n\nThe answer is 4.",
     ("\nLet me add.\n", "\n\nThe answer is 4.")),
    (QWEN3, "The answer is 4.", (None, "The answer is 4.")),  # thinking turned off
    (QWEN3, "<think>\nstill thinking when max_tokens", ("\nstill thinking when max_tokens", "")),
    (QWEN3, "stray </think> marker", (None, "stray </think> marker")),
    (QWEN3, "\n<think>a</think>b", ("a", "b")),
    (R1, "Okay, 2 + 2.\n</think>\n\n4", ("Okay, 2 + 2.\n", "\n\n4")),
    (R1, "<think>Okay</think>4", ("Okay", "4")),
    (R1, "cut inside the thinking", ("cut inside the thinking", "")),
    (R1, "</think>", ("", "")),
]  # fmt: skip


@pytest.mark.parametrize("parser, output, want", RECORDED)
def test_recorded_outputs_split_as_the_parser_says(parser, output, want):
    assert parser.split(output) == want


def chat_request(parser, **body):
    messages = [{"role": "user", "content": "q"}]
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": messages, **body}}  # fmt: skip
    request = parse_request_line(json.dumps(line), line=1)
    request.reasoning = parser
    return request


def output_of(text: str, ids: list[int], finish="stop", finished=True) -> RequestOutput:
    comp = CompletionOutput(0, text, ids, None, None, finish if finished else None)
    return RequestOutput("r", None, [1], None, [comp], finished=finished, num_cached_tokens=0)


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(RECORDED), cuts=st.lists(st.integers(0, 60), max_size=8))
def test_streamed_deltas_join_to_the_whole_split(case, cuts):
    parser, output, (thinking, answer) = case
    stream = ChunkStream([chat_request(parser)], 1, "m", TokenDecoder(None), chat=True)
    deltas = []
    for cut in sorted(c for c in cuts if c < len(output)):
        prefix = output[:cut]
        deltas += stream.chunks(0, output_of(prefix, list(range(cut)), finished=False))
    deltas += stream.chunks(0, output_of(output, list(range(len(output)))))
    got = [c["choices"][0]["delta"] for c in deltas]
    assert "".join(d.get("reasoning_content", "") for d in got) == (thinking or "")
    assert "".join(d.get("reasoning", "") for d in got) == (thinking or "")
    assert "".join(d.get("content", "") for d in got) == answer


def test_the_message_carries_the_thinking_and_the_usage_counts_its_tokens():
    tokenizer = build_tokenizer()
    text = "<think>add two and two</think>4"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    body = chat_completion_body(chat_request(QWEN3), output_of(text, ids), "m",
                                TokenDecoder(tokenizer))  # fmt: skip
    message = body["choices"][0]["message"]
    assert message["content"] == "4"
    assert message["reasoning_content"] == message["reasoning"] == "add two and two"
    thinking = body["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert 0 < thinking < len(ids)
    assert "</think>" in tokenizer.decode(ids[:thinking])
    assert "</think>" not in tokenizer.decode(ids[: thinking - 1])
    assert reasoning_tokens(QWEN3, ids, tokenizer, None) == 0  # no thinking: none counted


def test_without_a_parser_or_with_thinking_off_the_output_is_all_answer():
    engine = EchoEngine()
    engine.reasoning_parser = "deepseek_r1"
    request = chat_request(None)
    prepare_request(engine, request)
    assert request.reasoning is R1
    off = chat_request(None, chat_template_kwargs={"enable_thinking": False})
    prepare_request(engine, off)
    assert off.reasoning is None
    body = chat_completion_body(off, output_of("a</think>b", [1, 2]), "m", TokenDecoder(None))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "a</think>b",
                                             "refusal": None}  # fmt: skip
    assert "completion_tokens_details" not in body["usage"]


def test_the_engine_option_names_every_parser():
    from conveyor.engine.config import REASONING_PARSERS

    assert set(REASONING_PARSERS) == set(PARSERS)


def test_a_reasoning_chats_structured_output_starts_after_the_thinking():
    engine = EchoEngine()
    engine.reasoning_parser = "qwen3"
    request = chat_request(None, response_format={"type": "json_object"})
    _, params = prepare_request(engine, request)
    assert params.structured_outputs.json_object and params.structured_outputs.after == "</think>"
    off = chat_request(None, response_format={"type": "json_object"},
                       chat_template_kwargs={"enable_thinking": False})  # fmt: skip
    assert prepare_request(engine, off)[1].structured_outputs.after is None


def test_a_models_own_markers_split_its_thinking():
    import argparse

    import pytest

    from conveyor.engine.config import EngineConfig, reasoning_parser_name
    from conveyor.wire_format.reasoning import reasoning_parser

    name = "markers:<|begin_of_thought|>,<|end_of_thought|>"
    assert EngineConfig(reasoning_parser=name).reasoning_parser == name
    own = reasoning_parser(name)
    text = "<|begin_of_thought|>add them<|end_of_thought|>42"
    assert own.split(text) == ("add them", "42")
    assert own.split("42") == (None, "42")  # no block opened: all answer
    assert own.split("<|begin_of_thought|>add th", finished=False) == ("add th", "")
    for bad in ("markers:<a>", "markers:,</a>", "markers:<a>,</a>,<b>", "qwen4"):
        with pytest.raises(argparse.ArgumentTypeError):
            reasoning_parser_name(bad)
        with pytest.raises(ValueError, match="reasoning-parser"):
            EngineConfig(reasoning_parser=bad)
    engine = EchoEngine()
    engine.reasoning_parser = name
    request = chat_request(None, response_format={"type": "json_object"})
    _, params = prepare_request(engine, request)
    assert request.reasoning == own
    assert params.structured_outputs.after == "<|end_of_thought|>"  # the answer alone
