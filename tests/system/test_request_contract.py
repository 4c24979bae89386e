"""The request contract through the service: penalties, logit_bias and structured outputs
answer alike online and in a batch; refused fields fail their request alone, naming the field;
a schema the grammar engine cannot compile fails its line alone; tools without a parser to
read their calls are refused naming tool_choice."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from conveyor.testing import download, submit_batch, wait_for, write_jsonl
from tests.system.test_online import MODEL, client, embedded_serve

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
        "notes": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["answer", "score"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "Is the sea blue?"}]
BODIES = [
    {"messages": MESSAGES, "response_format": RESPONSE_FORMAT, "temperature": 0, "max_tokens": 80},
    {"messages": MESSAGES, "response_format": RESPONSE_FORMAT, "temperature": 1.0, "seed": 4,
     "n": 3, "max_tokens": 80},
    {"messages": MESSAGES, "frequency_penalty": 1.5, "presence_penalty": 0.5, "temperature": 0,
     "max_tokens": 12},
    {"messages": MESSAGES, "logit_bias": {"40": 100}, "temperature": 0, "max_tokens": 5},
    {"messages": MESSAGES, "structured_outputs": {"choice": ["red", "green"]}, "temperature": 0},
]  # fmt: skip


def _lines(bodies: list[dict]) -> list[dict]:
    return [
        {"custom_id": str(i), "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": MODEL, **body}}
        for i, body in enumerate(bodies)
    ]  # fmt: skip


def test_the_request_contract_online_and_in_a_batch(chat_model: Path, tmp_path: Path):
    with embedded_serve(tmp_path, chat_model, "--dtype", "float32") as url:
        api = client(url)
        online = [
            httpx.post(url + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=120)
            .raise_for_status()
            .json()
            for body in BODIES
        ]
        bad_schema = {"type": "json_schema",
                      "json_schema": {"name": "x", "schema": {"$ref": "#/missing"}}}  # fmt: skip
        lines = _lines([*BODIES, {"messages": MESSAGES, "response_format": bad_schema},
                        {"messages": MESSAGES, "max_token": 3},
                        {"messages": MESSAGES, "tools": [{"type": "web_search"}]}])  # fmt: skip
        batch_id = submit_batch(url, write_jsonl(tmp_path / "contract.jsonl", lines))
        done = wait_for(url, batch_id, timeout=180)
        assert done["request_counts"] == {"total": 8, "completed": 5, "failed": 3, "reused": 0}
        answers = {a["custom_id"]: a for a in download(url, done["output_file_id"])}
        errors = {e["custom_id"]: e["error"] for e in download(url, done["error_file_id"])}

        # one code path: the batch lines answer as the online requests did
        for i, answer in enumerate(online):
            body = answers[str(i)]["response"]["body"]
            assert [c["message"]["content"] for c in body["choices"]] == [
                c["message"]["content"] for c in answer["choices"]
            ]
        for answer in online[:2]:
            for choice in answer["choices"]:
                assert choice["finish_reason"] == "stop"
                jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        assert len({c["message"]["content"] for c in online[1]["choices"]}) > 1
        biased = online[3]["choices"][0]["message"]["content"]
        token_40 = httpx.post(url + "/detokenize", json={"tokens": [40]}).json()["prompt"]
        assert biased == token_40 * 5
        assert online[4]["choices"][0]["message"]["content"] in ("red", "green")

        assert errors["5"]["code"] == "invalid_response_format"
        assert (
            errors["6"]["code"] == "unknown_parameter"
            and "body.max_token" in errors["6"]["message"]
        )
        assert errors["7"]["code"] == "invalid_request"
        assert '"body.tools[0]"' in errors["7"]["message"]
        assert "web_search" in errors["7"]["message"]

        with pytest.raises(openai.BadRequestError) as unknown:
            api.chat.completions.create(model=MODEL, messages=MESSAGES,
                                        extra_body={"max_token": 3})  # fmt: skip
        assert (unknown.value.code, unknown.value.body["param"]) == ("unknown_parameter",
                                                                     "max_token")  # fmt: skip
        with pytest.raises(openai.BadRequestError) as tools:
            api.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                tools=[{"type": "function", "function": {"name": "f"}}],
            )
        # "auto" (the default with tools) needs a parser to read the calls: this server has none
        assert (tools.value.code, tools.value.body["param"]) == ("invalid_request", "tool_choice")
        assert "--tool-call-parser" in tools.value.message
        with pytest.raises(openai.BadRequestError) as compile_error:
            api.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=bad_schema)
        assert compile_error.value.code == "invalid_response_format"
