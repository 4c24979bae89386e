"""`conveyor run-batch` and the OpenAI Batch format in `conveyor.wire_format`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conveyor.engine.errors import ContextLengthError
from conveyor.wire_format.bodies import CHAT_URL, COMPLETIONS_URL
from conveyor.wire_format.errors import RequestError
from conveyor.wire_format.request_line import (
    BatchLineParser,
    parse_request_line,
    parse_request_object,
)
from conveyor.wire_format.result_lines import build_error_line, build_output_line
from conveyor.wire_format.token_text import TokenDecoder

REPO = Path(__file__).resolve().parents[2]

# Small engine settings: a short context and a small KV cache keep the tests fast on CPU.
MAX_MODEL_LEN = 256
ENGINE_ARGS = [
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--num-kv-blocks",
    "64",
]
ENGINE_KWARGS = dict(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)

PROMPTS = [
    "The quick brown fox",
    "What is the capital of France?",
    "Translate the sentence into German.",
    "Write a short poem about the sea.",
    "Summarise the following paragraph in one sentence.",
]


def line(custom_id: Any, url: str, body: Any, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def chat_line(custom_id: str, content: Any = "hi", **body: Any) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], **body}
    return line(custom_id, CHAT_URL, body)


def completion_line(custom_id: str, prompt: Any = "hi", **body: Any) -> str:
    return line(custom_id, COMPLETIONS_URL, {"model": "m", "prompt": prompt, **body})


def parse_error(text: str, lineno: int = 7, **kwargs: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_request_line(text, line=lineno, **kwargs)
    return info.value


# ------------------------------------------------------------------------------------------------
# Parsing: error messages
# ------------------------------------------------------------------------------------------------


def test_unknown_url_message() -> None:
    err = parse_error(line("a", "/v1/embeddings", {"model": "m", "input": "x"}))
    assert str(err) == (
        'line 7: "url" must be one of /v1/chat/completions, /v1/completions, /v1/responses, '
        'got "/v1/embeddings"'
    )
    assert (err.code, err.custom_id, err.line, err.param) == ("invalid_url", "a", 7, "url")


@pytest.mark.parametrize(
    ("text", "code", "custom_id", "needle"),
    [
        ("{not json", "invalid_json", None, "not valid JSON"),
        ("[1, 2]", "invalid_json", None, "must be a JSON object, got list"),
        (json.dumps({"method": "POST"}), "invalid_request", None, '"custom_id" is required'),
        (line(5, CHAT_URL, {}), "invalid_request", None, '"custom_id" must be a non-empty string'),
        (line("a", CHAT_URL, {}, method="GET"), "invalid_method", "a", '"method" must be "POST"'),
        (json.dumps({"custom_id": "a", "method": "POST"}), "invalid_url", "a", '"url" is required'),
        (
            json.dumps({"custom_id": "a", "method": "POST", "url": CHAT_URL}),
            "invalid_request",
            "a",
            '"body" is required',
        ),
        (line("a", CHAT_URL, [1]), "invalid_request", "a", '"body" must be a JSON object'),
        (line("a", CHAT_URL, {"messages": []}), "invalid_request", "a", '"body.model" is required'),
        (line("a", CHAT_URL, {"model": "m"}), "invalid_request", "a", '"body.messages" is'),
        (
            line("a", COMPLETIONS_URL, {"model": "m"}),
            "invalid_request",
            "a",
            '"body.prompt" is required',
        ),
        (
            completion_line("a", max_tokens="ten"),
            "invalid_request",
            "a",
            '"body.max_tokens" should be a valid integer, got "ten"',
        ),
        (
            completion_line("a", temperature=3),
            "invalid_request",
            "a",
            '"body.temperature" should be less than or equal to 2, got 3',
        ),
        (
            completion_line("a", logprobs=6),
            "invalid_request",
            "a",
            '"body.logprobs" should be less than or equal to 5',
        ),
        (
            chat_line("a", logprobs=True, top_logprobs=21),
            "invalid_request",
            "a",
            '"body.top_logprobs" should be less than or equal to 20',
        ),
        (
            chat_line("a", top_logprobs=2),
            "invalid_request",
            "a",
            '"body.top_logprobs" needs "body.logprobs": true',
        ),
        (
            chat_line("a", logprobs=1),
            "invalid_request",
            "a",
            '"body.logprobs" should be a valid boolean',
        ),
        (chat_line("a", n=0), "invalid_request", "a", '"body.n" should be greater than or equal'),
        (chat_line("a", stop=5), "invalid_request", "a", '"body.stop" must be a string or a list'),
        (
            completion_line("a", ["one", "two"]),
            "invalid_request",
            "a",
            "must be a single prompt, got a list of 2 prompts",
        ),
        (
            completion_line("a", [[1, 2], [3]]),
            "invalid_request",
            "a",
            "got a list of 2 token-id prompts",
        ),
        (completion_line("a", [1, "x"]), "invalid_request", "a", '"body.prompt" must be a string'),
        (completion_line("a", []), "invalid_request", "a", '"body.prompt" must not be empty'),
        (
            completion_line("a", max_tokens=0),
            "invalid_request",
            "a",
            '"body.max_tokens" must be at least 1 (0 is allowed only with "echo": true)',
        ),
        (
            chat_line("a", [{"type": "image_url", "image_url": {"url": "x"}}]),
            "invalid_request",
            "a",
            '"body.messages[0].content" must only hold "text" parts, got a part of type '
            '"image_url"',
        ),
        (
            line("a", CHAT_URL, {"model": "m", "messages": [{"role": "robot", "content": "x"}]}),
            "invalid_request",
            "a",
            '"body.messages[0].role" should be',
        ),
    ],
)
def test_error_messages(text: str, code: str, custom_id: str | None, needle: str) -> None:
    err = parse_error(text)
    assert err.code == code
    assert err.custom_id == custom_id
    assert str(err).startswith("line 7: ")
    assert needle in str(err), str(err)


def test_duplicate_custom_id() -> None:
    parser = BatchLineParser()
    parser.parse(chat_line("x"), 1)
    with pytest.raises(RequestError) as info:
        parser.parse(completion_line("x"), 4)
    assert info.value.code == "duplicate_custom_id"
    assert str(info.value) == 'line 4: duplicate "custom_id" "x" (first used on line 1)'
    # An invalid line still claims its custom_id.
    with pytest.raises(RequestError):
        parser.parse(completion_line("y", temperature=-1), 5)
    with pytest.raises(RequestError, match="duplicate"):
        parser.parse(completion_line("y"), 6)


def test_model_name_check() -> None:
    err = parse_error(chat_line("a"), served_model_names=["tiny"])
    assert err.code == "model_not_found"
    assert '"body.model" "m" is not served here; use "tiny"' in str(err)
    assert parse_request_line(chat_line("a"), served_model_names=["m", "tiny"]).model == "m"


def test_bytes_that_are_not_utf8() -> None:
    err = parse_error(b'{"custom_id": "\xff"}')
    assert err.code == "invalid_json"
    assert "not valid UTF-8" in str(err)


@pytest.mark.parametrize(
    ("text", "param", "where"),
    [
        (chat_line("a", "\ud800"), "body.messages[0].content", "\\ud800 at character 0"),
        (completion_line("a", "ok \udfff"), "body.prompt", "\\udfff at character 3"),
        (
            chat_line("a", [{"type": "text", "text": "x"}, {"type": "text", "text": "y\udc00"}]),
            "body.messages[0].content[1].text",
            "\\udc00 at character 1",
        ),
        (chat_line("a", stop=["ok", "\udbff"]), "body.stop[1]", "\\udbff"),
        (chat_line("a", user="\ud800"), "body.user", "\\ud800"),  # ignored fields too
        (chat_line("a", **{"n\udc00": 1}), 'body["n\\udc00"]', "in the field name"),
        # the escape written by hand in the JSON text, in either case
        (chat_line("a", "x").replace('"x"', '"x\\uDFFF"'), "body.messages[0].content", "\\udfff"),
    ],
    ids=["chat", "prompt", "part", "stop", "unknown-field", "key", "raw-escape"],
)
def test_lone_surrogates_fail_their_line(text: str, param: str, where: str) -> None:
    """A tokenizer, a UTF-8 file and the ledger all fail on a lone surrogate: the line is
    refused where it is validated, naming the field."""
    err = parse_error(text)
    assert (err.code, err.param, err.custom_id, err.status_code) == (
        "invalid_unicode",
        param,
        "a",
        400,
    )
    assert where in str(err) and "not valid Unicode" in str(err)
    assert str(err).isascii()  # the message itself can be stored and written anywhere
    # the same check when the line comes in decoded, with no text to pre-test
    with pytest.raises(RequestError) as info:
        parse_request_object(json.loads(text))
    assert (info.value.code, info.value.param) == ("invalid_unicode", param)


def test_text_that_is_valid_unicode_passes() -> None:
    pair = chat_line("a", "\U0001f600 and PAIR with a NUL \x00").replace("PAIR", "\\ud83d\\ude00")
    assert parse_request_line(pair).messages == [
        {"role": "user", "content": "\U0001f600 and \U0001f600 with a NUL \x00"}
    ]
    # body.model is checked by the ledger where it is stored (tests/api/test_api_validation.py)
    model = line("a", CHAT_URL, {"model": "m\ud800", "messages": [{"role": "user", "content": ""}]})
    assert parse_request_line(model).model == "m\ud800"


def test_a_type_error_is_reported_before_a_lone_surrogate() -> None:
    err = parse_error(chat_line("a", temperature="\ud800"))
    assert (err.code, err.param) == ("invalid_request", "body.temperature")


def test_nesting_is_bounded() -> None:
    def nested(levels: int) -> Any:
        value: Any = []
        for _ in range(levels - 1):
            value = [value]
        return value

    # the line is level 1 and its body level 2: 62 more levels fit
    assert parse_request_line(chat_line("a", user=nested(62))).custom_id == "a"
    err = parse_error(chat_line("a", user=nested(63)))
    assert (err.code, err.custom_id) == ("invalid_request", "a")
    assert err.param == "body.user" + "[0]" * 62 and "deeper than 64 levels" in str(err)
    # too deep for the JSON parser itself: not a crash, an invalid_json line
    deep = '{"custom_id": "a", "body": ' + "[" * 100_000 + "]" * 100_000 + "}"
    err = parse_error(deep)
    assert err.code == "invalid_json" and err.custom_id is None
    assert "nested deeper than" in str(err)


# ------------------------------------------------------------------------------------------------
# Parsing: mapping to SamplingParams keyword arguments
# ------------------------------------------------------------------------------------------------


def test_chat_defaults() -> None:
    req = parse_request_line(chat_line("c", "hello"), line=3)
    assert req.is_chat and req.custom_id == "c" and req.line == 3
    assert req.messages == [{"role": "user", "content": "hello"}]
    assert req.prompt is None
    assert req.top_logprobs is None
    # what the line leaves out stays out: the engine fills it from the model's defaults
    assert req.sampling == {"n": 1, "max_tokens": None}


def test_chat_sampling_kwargs() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": t} for t in "ab"]},
            {"role": "assistant", "content": None},
        ],
        "max_tokens": 50,
        "max_completion_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "n": 2,
        "stop": "END",
        "seed": 3,
        "logprobs": True,
        "top_logprobs": 4,
        "top_k": 20,
        "min_p": 0.05,
        "min_tokens": 2,
        "ignore_eos": True,
        "stop_token_ids": [5, 6],
        "presence_penalty": 0.1,
        # accepted without effect (an end-user id; free text is the default format)
        "user": "someone",
        "response_format": {"type": "text"},
    }
    req = parse_request_line(line("c", CHAT_URL, body))
    assert req.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]
    assert req.top_logprobs == 4
    assert req.sampling == {
        "n": 2,
        "temperature": 0.5,
        "top_p": 0.9,
        "max_tokens": 7,
        "stop": ["END"],
        "seed": 3,
        "logprobs": 4,
        "top_k": 20,
        "min_p": 0.05,
        "min_tokens": 2,
        "ignore_eos": True,
        "stop_token_ids": [5, 6],
        "presence_penalty": 0.1,
    }


def test_chat_logprobs_without_top() -> None:
    req = parse_request_line(chat_line("c", logprobs=True, max_tokens=3))
    assert req.top_logprobs == 0
    assert req.sampling["logprobs"] == 0
    assert req.sampling["max_tokens"] == 3
    assert "logprobs" not in parse_request_line(chat_line("c", logprobs=False)).sampling


def test_completion_defaults_and_token_prompts() -> None:
    req = parse_request_line(completion_line("p", "Once upon"))
    assert not req.is_chat and req.prompt == "Once upon" and req.messages is None
    assert req.sampling == {"n": 1, "max_tokens": 16}
    assert not req.echo
    assert parse_request_line(completion_line("p", [3, 4, 5])).prompt == [3, 4, 5]
    assert parse_request_line(completion_line("p", [[3, 4]])).prompt == [3, 4]
    assert parse_request_line(completion_line("p", ["only"])).prompt == "only"


def test_completion_lm_eval_loglikelihood_body() -> None:
    body = {"prompt": "The fox", "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    req = parse_request_line(completion_line("p", **body))
    assert req.echo and not req.drop_generation
    assert req.sampling == {
        "n": 1,
        "temperature": 0.0,
        "max_tokens": 1,
        "logprobs": 1,
        "prompt_logprobs": 1,
    }
    # `max_tokens: 0` with echo scores the prompt only: one token is generated, then dropped.
    req = parse_request_line(completion_line("p", "x", max_tokens=0, echo=True, logprobs=0))
    assert req.drop_generation and req.sampling["max_tokens"] == 1
    assert req.sampling["prompt_logprobs"] == 0


def test_completion_sampling_extras() -> None:
    req = parse_request_line(
        completion_line(
            "p", "x", stop=["a", "b"], seed=1, top_k=-1, min_p=0.1, min_tokens=1, n=3,
            ignore_eos=False, stop_token_ids=[], skip_special_tokens=False, best_of=3,
        )
    )  # fmt: skip
    assert req.sampling == {
        "n": 3,
        "max_tokens": 16,
        "stop": ["a", "b"],
        "seed": 1,
        "top_k": -1,
        "min_p": 0.1,
        "min_tokens": 1,
        "ignore_eos": False,
        "stop_token_ids": [],
        "skip_special_tokens": False,
    }


def test_sampling_kwargs_are_accepted_by_sampling_params() -> None:
    from conveyor.engine.sampling_params import SamplingParams

    for text in (
        chat_line("a", logprobs=True, top_logprobs=3, stop="x", top_k=5, seed=1),
        completion_line("b", [1, 2], echo=True, logprobs=2, max_tokens=0, min_tokens=0),
        completion_line("c", "x", stop_token_ids=[1], ignore_eos=True, n=2, temperature=0),
    ):
        req = parse_request_line(text)
        SamplingParams(**req.sampling)


def test_parse_object_directly() -> None:
    obj = {"custom_id": "z", "method": "POST", "url": CHAT_URL, "body": {"model": "m"}}
    with pytest.raises(RequestError, match='line 2: "body.messages" is required'):
        parse_request_object(obj, line=2)


# ------------------------------------------------------------------------------------------------
# Output lines
# ------------------------------------------------------------------------------------------------


class FakeTokenizer:
    """Token id i is the text `t<i> `; enough for the formatting code."""

    all_special_tokens: list[str] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"t{i} " for i in ids)

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return f"t{token_id} "


def fake_output(
    prompt_ids: list[int],
    outs: list[dict[str, Any]],
    prompt_logprobs: list[Any] | None = None,
    cached: int = 0,
) -> SimpleNamespace:
    completions = [
        SimpleNamespace(
            index=i,
            text=o["text"],
            token_ids=o["ids"],
            cumulative_logprob=None,
            logprobs=o.get("logprobs"),
            finish_reason=o.get("finish_reason", "length"),
            stop_reason=None,
        )
        for i, o in enumerate(outs)
    ]
    return SimpleNamespace(
        request_id="r",
        prompt=None,
        prompt_token_ids=prompt_ids,
        prompt_logprobs=prompt_logprobs,
        outputs=completions,
        finished=True,
        num_cached_tokens=cached,
        error=None,
    )


def test_chat_output_line_shape() -> None:
    req = parse_request_line(chat_line("c1", logprobs=True, top_logprobs=2, n=2))
    out = fake_output(
        [1, 2, 3],
        [
            {
                "text": "t7 t8 ",
                "ids": [7, 8],
                "logprobs": [{7: -0.5, 9: -1.5, 4: -2.0}, {8: -3.0, 2: -0.1, 3: -0.2}],
                "finish_reason": "stop",
            },
            {"text": "t5 ", "ids": [5], "logprobs": [{5: -0.25, 6: -2.5}]},
        ],
        cached=2,
    )
    result = build_output_line(req, out, "tiny", TokenDecoder(FakeTokenizer()), created=123)
    assert set(result) == {"id", "custom_id", "response", "error"}
    assert result["id"].startswith("batch_req_") and result["custom_id"] == "c1"
    assert result["error"] is None
    response = result["response"]
    assert response["status_code"] == 200
    assert isinstance(response["request_id"], str) and response["request_id"]
    body = response["body"]
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert body["created"] == 123 and body["id"].startswith("chatcmpl-")
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    first, second = body["choices"]
    assert first["index"] == 0 and second["index"] == 1
    assert first["message"]["role"] == "assistant" and first["message"]["content"] == "t7 t8 "
    assert first["finish_reason"] == "stop" and second["finish_reason"] == "length"
    content = first["logprobs"]["content"]
    assert content[0] == {
        "token": "t7 ",
        "logprob": -0.5,
        "bytes": list(b"t7 "),
        "top_logprobs": [
            {"token": "t7 ", "logprob": -0.5, "bytes": list(b"t7 ")},
            {"token": "t9 ", "logprob": -1.5, "bytes": list(b"t9 ")},
        ],
    }
    # The sampled token is reported even when it is not among the top alternatives.
    assert content[1]["token"] == "t8 " and content[1]["logprob"] == -3.0
    assert [t["token"] for t in content[1]["top_logprobs"]] == ["t2 ", "t3 "]
    json.dumps(result)  # plain JSON all the way down

    import openai.types.chat as openai_types

    openai_types.ChatCompletion.model_validate(body)


def test_completion_output_line_echo_logprobs() -> None:
    req = parse_request_line(
        completion_line("e", "t1 t2 ", max_tokens=1, logprobs=1, echo=True, temperature=0)
    )
    out = fake_output(
        [1, 2],
        [{"text": "t3 ", "ids": [3], "logprobs": [{3: -0.5, 4: -1.0}]}],
        prompt_logprobs=[None, {2: -2.0, 5: -0.5}],
    )
    result = build_output_line(req, out, "tiny", TokenDecoder(FakeTokenizer()))
    body = result["response"]["body"]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == "t1 t2 t3 "
    assert choice["logprobs"] == {
        "tokens": ["t1 ", "t2 ", "t3 "],
        "token_logprobs": [None, -2.0, -0.5],
        "top_logprobs": [None, {"t5 ": -0.5, "t2 ": -2.0}, {"t3 ": -0.5, "t4 ": -1.0}],
        "text_offset": [0, 3, 6],
    }
    assert body["usage"]["prompt_tokens"] == 2 and body["usage"]["completion_tokens"] == 1
    # (The `openai` package types these lists as non-null, but the API answers null for the
    # first echoed prompt token, as here; so no `openai` type check for this body.)


def test_completion_output_line_plain_and_prompt_only() -> None:
    decoder = TokenDecoder(FakeTokenizer())
    req = parse_request_line(completion_line("p", [1, 2], max_tokens=2))
    out = fake_output([1, 2], [{"text": "t3 t4 ", "ids": [3, 4], "finish_reason": "stop"}])
    body = build_output_line(req, out, "m", decoder)["response"]["body"]
    assert body["choices"][0] == {
        "index": 0,
        "text": "t3 t4 ",
        "logprobs": None,
        "finish_reason": "stop",
    }
    import openai.types as openai_types

    openai_types.Completion.model_validate(body)

    # max_tokens 0 + echo: the prompt (decoded from its ids) and its logprobs, nothing generated.
    req = parse_request_line(completion_line("p", [1, 2], max_tokens=0, echo=True, logprobs=0))
    out = fake_output(
        [1, 2], [{"text": "t3 ", "ids": [3], "logprobs": [{3: -1.0}]}], [None, {2: -0.75}]
    )
    body = build_output_line(req, out, "m", decoder)["response"]["body"]
    (choice,) = body["choices"]
    assert choice["text"] == "t1 t2 "
    assert choice["logprobs"]["token_logprobs"] == [None, -0.75]
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0


def test_error_line_shape() -> None:
    err = parse_error(line("a", "/v1/embeddings", {}), lineno=3)
    from conveyor.wire_format.result_lines import error_line_from_exception

    result = error_line_from_exception(err)
    assert result["id"].startswith("batch_req_") and result["custom_id"] == "a"
    assert result["error"] == {
        "code": "invalid_url",
        "message": str(err),
        "line": 3,
        "param": "url",
    }
    assert result["response"]["status_code"] == 400
    assert result["response"]["body"]["error"]["code"] == "invalid_url"
    # Without a custom_id there is no response to speak of.
    anonymous = build_error_line(None, "invalid_json", "line 9: not valid JSON", line=9)
    assert anonymous["custom_id"] is None and anonymous["response"] is None
    assert anonymous["error"]["line"] == 9


def test_token_decoder_bytes_for_byte_level_bpe() -> None:
    from conveyor.demo_model import build_tokenizer

    tok = build_tokenizer()
    decoder = TokenDecoder(tok)
    ids = tok("héllo wörld").input_ids
    raw = b"".join(bytes(decoder.bytes(i)) for i in ids)
    assert raw == "héllo wörld".encode()


def test_wire_format_and_cli_help_do_not_import_torch() -> None:
    # the engine's flags come from its torch-free config: nothing else of the engine is loaded
    code = (
        "import sys, conveyor.wire_format.result_lines, conveyor.wire_format.validation;"
        "import conveyor.cli;"
        "conveyor.cli.build_parser();"
        "bad = [m for m in sys.modules if (m.split('.')[0] in ('torch', 'transformers')"
        " or m.startswith('conveyor.engine.') or m.startswith('engine'))"
        " and m != 'conveyor.engine.config'];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# ------------------------------------------------------------------------------------------------
# run-batch end to end, on a tiny random model
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from conveyor.demo_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("model") / "m", "llama")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "conveyor", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def make_batch_file(path: Path, n_lines: int = 200) -> tuple[set[str], dict[int, Any]]:
    """`n_lines` lines, five of them bad. Returns the good custom_ids and {line: custom_id}
    of the bad ones."""
    bad_at = {20: "json", 50: "url", 90: "missing", 130: "duplicate", 170: "too-long"}
    good: set[str] = set()
    bad: dict[int, Any] = {}
    rows = []
    for lineno in range(1, n_lines + 1):
        kind = bad_at.get(lineno)
        cid = f"req-{lineno}"
        prompt = PROMPTS[lineno % len(PROMPTS)]
        if kind == "json":
            rows.append('{"custom_id": "req-broken", "method": "POST", ')
            bad[lineno] = None
        elif kind == "url":
            rows.append(line(cid, "/v1/embeddings", {"model": "m", "input": prompt}))
            bad[lineno] = cid
        elif kind == "missing":
            rows.append(line(cid, CHAT_URL, {"model": "m", "max_tokens": 4}))
            bad[lineno] = cid
        elif kind == "duplicate":
            rows.append(completion_line("req-3", prompt, max_tokens=4))
            bad[lineno] = "req-3"
        elif kind == "too-long":
            rows.append(completion_line(cid, "fox " * (MAX_MODEL_LEN + 20), max_tokens=4))
            bad[lineno] = cid
        elif lineno % 3 == 0:
            rows.append(
                chat_line(cid, prompt, max_tokens=4 + lineno % 4, temperature=0, seed=lineno)
            )
            good.add(cid)
        elif lineno % 7 == 0:
            rows.append(completion_line(cid, prompt, max_tokens=1, logprobs=1, echo=True))
            good.add(cid)
        else:
            rows.append(completion_line(cid, prompt, max_tokens=4 + lineno % 5, temperature=0.7))
            good.add(cid)
    assert len(rows) == n_lines and len(bad) == 5
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return good, bad


def test_run_batch_answers_to_the_model_path_beside_its_served_name(tiny_model, tmp_path):
    """The path given to --model is the name vLLM serves it under: accepted beside
    --served-model-name, and the answers say the served name."""
    infile, outfile = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [
        completion_line("by-name", max_tokens=2),
        completion_line("by-path", max_tokens=2, model=str(tiny_model)),
        completion_line("other", max_tokens=2, model="other"),
    ]
    infile.write_text("\n".join(rows) + "\n", encoding="utf-8")
    proc = run_cli(
        "run-batch", "-i", str(infile), "-o", str(outfile), "--model", str(tiny_model),
        "--served-model-name", "m", *ENGINE_ARGS,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    by_id = {r["custom_id"]: r for r in read_jsonl(outfile)}
    assert by_id["by-name"]["response"]["body"]["model"] == "m"
    assert by_id["by-path"]["response"]["body"]["model"] == "m"
    assert by_id["other"]["error"]["code"] == "model_not_found"


def test_run_batch_round_trip(tiny_model: Path, tmp_path: Path) -> None:
    infile, outfile = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good, bad = make_batch_file(infile)
    proc = run_cli(
        "run-batch", "-i", str(infile), "-o", str(outfile), "--model", str(tiny_model),
        "--served-model-name", "m", *ENGINE_ARGS,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "195 succeeded, 5 failed" in proc.stderr

    rows = read_jsonl(outfile)
    assert len(rows) == 200
    results = [r for r in rows if r["error"] is None]
    errors = [r for r in rows if r["error"] is not None]
    assert len(results) == 195 and len(errors) == 5

    result_ids = [r["custom_id"] for r in results]
    assert len(set(result_ids)) == len(result_ids) == 195
    assert set(result_ids) == good
    assert {e["error"]["line"]: e["custom_id"] for e in errors} == bad
    codes = {e["error"]["line"]: e["error"]["code"] for e in errors}
    assert codes == {
        20: "invalid_json",
        50: "invalid_url",
        90: "invalid_request",
        130: "duplicate_custom_id",
        170: "context_length_exceeded",
    }
    for e in errors:
        assert e["error"]["message"].startswith(f"line {e['error']['line']}: ")
        if e["custom_id"] is None:
            assert e["response"] is None
        else:
            assert e["response"]["status_code"] == 400
    assert (
        '"body.messages" is required'
        in next(e for e in errors if e["error"]["line"] == 90)["error"]["message"]
    )

    for r in results:
        response = r["response"]
        assert response["status_code"] == 200
        body = response["body"]
        assert body["model"] == "m"
        n = int(r["custom_id"].split("-")[1])
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        (choice,) = body["choices"]
        if n % 3 == 0:
            assert body["object"] == "chat.completion"
            assert choice["message"]["role"] == "assistant"
            assert usage["completion_tokens"] <= 4 + n % 4
        else:
            assert body["object"] == "text_completion"
            assert isinstance(choice["text"], str)
        if n % 3 and n % 7 == 0:  # echo + logprobs
            lp = choice["logprobs"]
            assert choice["text"].startswith(PROMPTS[n % len(PROMPTS)])
            assert lp["token_logprobs"][0] is None
            assert len(lp["tokens"]) == usage["prompt_tokens"] + 1
            assert all(x is not None and x <= 0 for x in lp["token_logprobs"][1:])


def test_error_file_and_greedy_matches_generate(tiny_model: Path, tmp_path: Path) -> None:
    from conveyor.cli import main
    from conveyor.engine import LLM, SamplingParams

    prompt = "The quick brown fox"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    infile, outfile, errfile = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "e.jsonl"
    infile.write_text(
        "\n".join(
            [
                completion_line("greedy", prompt, max_tokens=8, temperature=0),
                "",  # blank lines are skipped
                line("chat", CHAT_URL, {"model": "m", "messages": messages, "max_tokens": 8,
                                        "temperature": 0}),
                completion_line("bad-top-p", prompt, top_p=0),
            ]
        ),
        encoding="utf-8",
    )  # fmt: skip
    args = ["run-batch", "-i", str(infile), "-o", str(outfile), "--error-file", str(errfile)]
    assert main([*args, "--model", str(tiny_model), "--no-progress", *ENGINE_ARGS]) == 0

    results = {r["custom_id"]: r for r in read_jsonl(outfile)}
    assert set(results) == {"greedy", "chat"}
    (error,) = read_jsonl(errfile)
    assert error["custom_id"] == "bad-top-p"
    assert error["error"]["code"] == "invalid_sampling_params"
    assert error["error"]["param"] == "body.top_p"
    assert error["error"]["line"] == 4

    llm = LLM(str(tiny_model), **ENGINE_KWARGS)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    (expected,) = llm.generate([prompt], params, use_tqdm=False)
    text = results["greedy"]["response"]["body"]["choices"][0]["text"]
    assert text == expected.outputs[0].text
    usage = results["greedy"]["response"]["body"]["usage"]
    assert usage["prompt_tokens"] == len(expected.prompt_token_ids)
    assert usage["completion_tokens"] == len(expected.outputs[0].token_ids)

    chat_ids = llm.apply_chat_template(messages)
    (expected_chat,) = llm.generate([chat_ids], params, use_tqdm=False)
    content = results["chat"]["response"]["body"]["choices"][0]["message"]["content"]
    assert content == expected_chat.outputs[0].text


def test_missing_input_file(tmp_path: Path) -> None:
    proc = run_cli(
        "run-batch", "-i", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o.jsonl"),
        "--model", "whatever",
    )  # fmt: skip
    assert proc.returncode != 0
    assert "nope.jsonl" in proc.stderr and "does not exist" in proc.stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_unloadable_model(tmp_path: Path) -> None:
    from conveyor.cli import main

    infile = tmp_path / "in.jsonl"
    infile.write_text(completion_line("a") + "\n", encoding="utf-8")
    empty_model_dir = tmp_path / "empty"
    empty_model_dir.mkdir()
    out = tmp_path / "o.jsonl"
    code = main(["run-batch", "-i", str(infile), "-o", str(out), "--model", str(empty_model_dir)])
    assert code != 0
    assert not out.exists()


def test_unloadable_model_message(tmp_path: Path) -> None:
    infile = tmp_path / "in.jsonl"
    infile.write_text(completion_line("a") + "\n", encoding="utf-8")
    proc = run_cli(
        "run-batch", "-i", str(infile), "-o", str(tmp_path / "o.jsonl"),
        "--model", str(tmp_path / "no-such-model"),
    )  # fmt: skip
    assert proc.returncode == 1
    assert "cannot load model" in proc.stderr and "no-such-model" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_demo_model_command(tmp_path: Path) -> None:
    from conveyor.cli import main

    assert main(["demo-model", str(tmp_path / "q"), "--arch", "qwen2"]) == 0
    assert (tmp_path / "q" / "config.json").is_file()
    assert json.loads((tmp_path / "q" / "config.json").read_text())["model_type"] == "qwen2"


# ------------------------------------------------------------------------------------------------
# The runner loop, with a scripted stand-in engine
# ------------------------------------------------------------------------------------------------


class ScriptedEngine:
    """Finishes one request per step with a fixed reply; can be told to fail on a given step."""

    tokenizer = None
    default_sampling: dict = {}
    reasoning_parser = None
    tool_call_parser = None

    def __init__(self, fail_on_step: int | None = None, exc: BaseException | None = None):
        self.waiting: list[tuple[str, list[int]]] = []
        self.steps = 0
        self.fail_on_step = fail_on_step
        self.exc = exc or KeyboardInterrupt()
        self.aborted: list[str] = []

    def prepare_prompt(self, prompt: Any) -> Any:
        return prompt

    def add_request(self, request_id: str, prompt: Any, params: Any) -> None:
        if prompt == "too long":
            raise ContextLengthError("the prompt has 9999 tokens, but max_model_len is 10")
        self.waiting.append((request_id, list(prompt) if isinstance(prompt, list) else [1, 2]))

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def step(self) -> list[Any]:
        self.steps += 1
        if self.steps == self.fail_on_step:
            raise self.exc
        request_id, prompt_ids = self.waiting.pop(0)
        out = fake_output(prompt_ids, [{"text": "ok", "ids": [7], "finish_reason": "stop"}])
        out.request_id = request_id
        return [out]


def test_runner_writes_and_flushes_each_line(tmp_path: Path) -> None:
    from conveyor.batch_runner import BatchRunner

    path = tmp_path / "out.jsonl"
    engine = ScriptedEngine(fail_on_step=4)
    lines = [(i, completion_line(f"r{i}", "x").encode()) for i in range(1, 7)]
    lines.insert(2, (99, completion_line("long", "too long").encode()))
    with open(path, "w", encoding="utf-8") as out:
        runner = BatchRunner(engine, model_name="m", out=out, max_pending=2)
        with pytest.raises(KeyboardInterrupt):
            runner.run(lines)
        # Written lines are already on disk before the file is closed.
        rows = read_jsonl(path)
        runner.abort_pending()
    assert [r["custom_id"] for r in rows] == ["r1", "long", "r2", "r3"]
    assert rows[1]["error"]["code"] == "context_length_exceeded"
    assert engine.aborted == ["line-4", "line-5"]


def test_runner_reports_requests_the_engine_lost(tmp_path: Path) -> None:
    import io

    from conveyor.batch_runner import BatchRunner

    class LosingEngine(ScriptedEngine):
        def has_unfinished(self) -> bool:
            return False

    out = io.StringIO()
    runner = BatchRunner(LosingEngine(), model_name="m", out=out)
    stats = runner.run([(1, completion_line("a").encode())])
    (row,) = [json.loads(x) for x in out.getvalue().splitlines()]
    assert row["custom_id"] == "a" and row["error"]["code"] == "internal_error"
    assert (stats.succeeded, stats.failed) == (0, 1)


def test_runner_writes_lines_that_hold_lone_surrogates(tmp_path: Path) -> None:
    """Model text (or a message quoting input) with a lone surrogate cannot be written as
    UTF-8: the line is written with ASCII escapes instead, and reads back the same."""
    from conveyor.batch_runner import BatchRunner

    class SurrogateEngine(ScriptedEngine):
        def step(self) -> list[Any]:
            (out,) = super().step()
            out.outputs[0].text = "ok \udc80"
            return [out]

    path = tmp_path / "out.jsonl"
    lines = [
        (1, completion_line("a", "x").encode()),
        (2, line("b", COMPLETIONS_URL, {"model": "m\ud800", "prompt": "x"}).encode()),
        (3, completion_line("c", "é").encode()),
    ]
    with open(path, "w", encoding="utf-8") as out:
        runner = BatchRunner(
            SurrogateEngine(),
            model_name="m",
            out=out,
            served_model_names=["m"],
        )
        stats = runner.run(lines)
    assert (stats.succeeded, stats.failed) == (2, 1)
    rows = {r["custom_id"]: r for r in read_jsonl(path)}
    assert rows["a"]["response"]["body"]["choices"][0]["text"] == "ok \udc80"
    assert (
        rows["b"]["error"]["code"] == "model_not_found"
        and "\ud800" in rows["b"]["error"]["message"]
    )
    assert rows["c"]["response"]["body"]["choices"][0]["text"] == "ok \udc80"
    text = path.read_text(encoding="utf-8")
    assert "\\udc80" in text and "\\ud800" in text


def test_dump_line_keeps_text_unless_it_cannot_be_utf8() -> None:
    from conveyor.wire_format.result_lines import dump_line

    assert dump_line({"t": "é 😀"}) == '{"t": "é 😀"}'
    assert dump_line({"t": "é \ud800"}) == '{"t": "\\u00e9 \\ud800"}'
    assert json.loads(dump_line({"t": "é \ud800"})) == {"t": "é \ud800"}


def test_dump_line_escapes_what_some_readers_take_for_line_ends() -> None:
    from conveyor.wire_format.result_lines import dump_line

    obj = {"t": "é x\x85y\u2028z\u2029w"}
    text = dump_line(obj)
    assert text == '{"t": "é x\\u0085y\\u2028z\\u2029w"}'
    assert text.splitlines() == [text] and json.loads(text) == obj
