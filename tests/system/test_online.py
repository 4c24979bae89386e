"""OpenAI's online endpoints on the service: `/v1/completions` and `/v1/chat/completions` (plain
and streamed) and vLLM's tokenizer endpoints, answered by the workers that run batches, with the
batch lines' bodies, checks and answers, ahead of batch work, and with OpenAI's errors."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from conveyor.testing import (
    Stack,
    batch_lines,
    create_key,
    download,
    submit_batch,
    wait_for,
    write_jsonl,
)
from conveyor.testing import embedded_serve as serve

MODEL = "tiny"
GREEDY = {"temperature": 0, "max_tokens": 6}


@contextlib.contextmanager
def embedded_serve(tmp_path: Path, model: Path, *extra: str) -> Iterator[str]:
    with serve(tmp_path, model, MODEL, *extra) as url:
        yield url


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def streamed_text(chunks, chat: bool) -> dict[int, str]:
    """Each choice's text, put together from its chunks."""
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = (choice.delta.content or "") if chat else choice.text
            texts[choice.index] = texts.get(choice.index, "") + piece
    return texts


def batch_answers(url: str, endpoint: str, bodies: list[dict], tmp_path: Path) -> list[dict]:
    """The response bodies a batch of `bodies` gets, in their order."""
    lines = [
        {"custom_id": str(i), "method": "POST", "url": endpoint, "body": body}
        for i, body in enumerate(bodies)
    ]
    batch_id = submit_batch(url, write_jsonl(tmp_path / "same.jsonl", lines), endpoint=endpoint)
    done = wait_for(url, batch_id, timeout=180)
    assert done["request_counts"]["failed"] == 0, download(url, done["error_file_id"])
    answers = {line["custom_id"]: line for line in download(url, done["output_file_id"])}
    return [answers[str(i)]["response"]["body"] for i in range(len(bodies))]


def test_online_requests_answer_as_batch_lines_do(chat_model: Path, tmp_path: Path):
    with embedded_serve(tmp_path, chat_model, "--dtype", "float32") as url:
        api = client(url)
        prompts = ["The sea is", "Numbers:", "Once upon"]
        ids = api.completions.create(model=MODEL, prompt="Tokens", **GREEDY)
        many = api.completions.create(model=MODEL, prompt=prompts, n=2, **GREEDY)
        assert [c.index for c in many.choices] == list(range(6))
        counts = [
            httpx.post(url + "/tokenize", json={"prompt": p}).json()["count"] for p in prompts
        ]
        assert many.usage.prompt_tokens == sum(counts)  # the usage of all prompts, summed
        assert 0 < many.usage.completion_tokens <= 6 * 6
        tokenized = httpx.post(url + "/tokenize", json={"prompt": prompts[0]}).json()
        by_ids = api.completions.create(
            model=MODEL, prompt=[tokenized["tokens"], tokenized["tokens"][:2]], **GREEDY
        )
        chat = api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hi"}], **GREEDY
        )

        # one code path: a batch of the same bodies answers the same texts
        same = batch_answers(
            url,
            "/v1/completions",
            [{"model": MODEL, "prompt": p, **GREEDY} for p in ["Tokens", *prompts]],
            tmp_path,
        )
        assert ids.choices[0].text == same[0]["choices"][0]["text"]
        for i in range(3):  # n=2 greedy: both samples are the batch line's text
            assert many.choices[2 * i].text == many.choices[2 * i + 1].text
            assert many.choices[2 * i].text == same[i + 1]["choices"][0]["text"]
        assert by_ids.choices[0].text == same[1]["choices"][0]["text"]
        assert by_ids.usage.prompt_tokens == tokenized["count"] + 2

        # streamed: the chunks put together are the whole answer
        stream = api.completions.create(model=MODEL, prompt=prompts, stream=True, **GREEDY)
        assert streamed_text(stream, chat=False) == {i: many.choices[2 * i].text for i in range(3)}
        chunks = list(
            api.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Say hi"}],
                stream=True,
                stream_options={"include_usage": True},
                **GREEDY,
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert streamed_text(chunks, chat=True) == {0: chat.choices[0].message.content}
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == (
            chat.usage.completion_tokens
        )
        assert chunks[-2].choices[0].finish_reason == chat.choices[0].finish_reason


def test_tokenizer_endpoints_and_errors(chat_model: Path, tmp_path: Path):
    with embedded_serve(tmp_path, chat_model) as url:
        tokens = httpx.post(url + "/tokenize", json={"prompt": "Hello world"}).json()
        assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] > 0
        text = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]})
        assert text.json() == {"prompt": "Hello world"}
        chat = httpx.post(
            url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
        ).json()
        assert chat["count"] > tokens["count"] - 2  # the template's tokens around the message
        info = httpx.get(url + "/tokenizer_info").json()
        assert info["eos_token"] == "<|im_end|>" and "<|im_start|>" in info["chat_template"]

        api = client(url)
        with pytest.raises(openai.NotFoundError) as missing:
            api.completions.create(model="nobody", prompt="x")
        assert missing.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as bad:
            api.completions.create(model=MODEL, prompt="x", temperature=5)
        assert bad.value.body["param"] == "temperature"
        with pytest.raises(openai.BadRequestError) as empty:
            api.chat.completions.create(model=MODEL, messages=[])
        assert empty.value.body["param"] == "messages"
        too_long = httpx.post(
            url + "/v1/completions", json={"model": MODEL, "prompt": "word " * 5000}
        )
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt"
        bad_tokens = httpx.post(url + "/detokenize", json={"tokens": "abc"})
        assert bad_tokens.status_code == 400


# the server's own template: the tools' names, and a variable of its own
TEMPLATE = (
    "{% if tools %}Tools: {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if style %}Style: {{ style }}\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tokenize_counts_a_chat_as_the_chat_endpoint_renders_it(chat_model: Path, tmp_path: Path):
    """`/tokenize` with messages renders them as a chat request does: the server's
    --chat-template, the request's `chat_template_kwargs` and `tools`; its count is the
    chat's `prompt_tokens` (it once counted with the checkpoint's template and none of them)."""
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    messages = [{"role": "user", "content": "Say hi"}]
    tool = {"type": "function", "function": {"name": "lookup_weather", "parameters": {}}}
    variants = [{}, {"extra_body": {"chat_template_kwargs": {"style": "terse and plain"}}},
                {"tools": [tool], "tool_choice": "none"},
                {"extra_body": {"continue_final_message": True}}]  # fmt: skip
    with embedded_serve(tmp_path, chat_model, "--chat-template", str(template)) as url:
        counts = []
        for extra in variants:
            chat = client(url).chat.completions.create(
                model=MODEL, messages=messages, max_tokens=1, **extra
            )
            fields = {k: v for k, v in extra.items() if k not in ("tool_choice", "extra_body")}
            fields |= extra.get("extra_body", {})
            tokenized = httpx.post(url + "/tokenize", json={"messages": messages, **fields})
            assert tokenized.status_code == 200, tokenized.text
            assert tokenized.json()["count"] == chat.usage.prompt_tokens, extra
            counts.append(chat.usage.prompt_tokens)
        assert counts[0] < counts[1] and counts[0] < counts[2]  # each reached the template
        assert counts[3] < counts[0]  # the message left open: no end of turn, no new turn
        # lm-eval's remote tokenizer renders chats itself, with the template this tells it
        assert httpx.get(url + "/tokenizer_info").json()["chat_template"] == TEMPLATE
        bare = httpx.post(
            url + "/tokenize", json={"messages": messages, "add_generation_prompt": False}
        )
        assert bare.json()["count"] < counts[0]

        reserved = httpx.post(
            url + "/tokenize",
            json={"messages": messages, "chat_template_kwargs": {"add_generation_prompt": True}},
        )
        assert reserved.status_code == 400
        assert reserved.json()["error"]["param"] == "chat_template_kwargs"
        with_prompt = httpx.post(
            url + "/tokenize", json={"prompt": "hi", "chat_template_kwargs": {"style": "x"}}
        )
        assert with_prompt.status_code == 400
        assert 'goes with "messages"' in with_prompt.json()["error"]["message"]


def test_online_through_redis_with_keys_503_and_504(stack: Stack, chat_model: Path, tmp_path: Path):
    stack.env["CONVEYOR_AUTH"] = "required"
    stack.env["CONVEYOR_ONLINE_TIMEOUT"] = "3"
    api_url = stack.start_api()
    worker = stack.start_worker("w1", chat_model)
    api = client(api_url, create_key(stack.env, "team-a").secret)
    with pytest.raises(openai.AuthenticationError):
        client(api_url).completions.create(model=MODEL, prompt="x")
    answer = api.completions.create(model=MODEL, prompt="Hello", **GREEDY)
    assert answer.choices[0].finish_reason in ("length", "stop")
    tokens = httpx.post(
        api_url + "/tokenize",
        json={"prompt": "Hello"},
        headers={"Authorization": f"Bearer {api.api_key}"},
    )
    assert tokens.status_code == 200 and tokens.json()["tokens"]

    os.killpg(worker.pid, signal.SIGSTOP)  # alive in the ledger, but answers nothing
    try:
        start = time.time()
        with pytest.raises(openai.APIStatusError) as late:
            api.completions.create(model=MODEL, prompt="Hello", **GREEDY)
        assert late.value.status_code == 504 and late.value.code == "timeout"
        assert time.time() - start < 30
    finally:
        os.killpg(worker.pid, signal.SIGCONT)

    stack.kill("w1", signal.SIGTERM)  # gone: the model is known but nobody serves it
    with pytest.raises(openai.APIStatusError) as away:
        api.completions.create(model=MODEL, prompt="Hello", **GREEDY)
    assert away.value.status_code == 503 and away.value.code == "model_unavailable"


def test_an_online_request_goes_ahead_of_a_running_batch(
    stack: Stack, chat_model: Path, tmp_path: Path
):
    api_url = stack.start_api()
    stack.start_worker("w1", chat_model, "--max-num-seqs", "4")
    lines = batch_lines(160, max_tokens=48)
    for line in lines:
        line["body"]["ignore_eos"] = True  # every request runs its whole length
    batch_id = submit_batch(api_url, write_jsonl(tmp_path / "big.jsonl", lines))
    deadline = time.time() + 120
    while httpx.get(f"{api_url}/v1/batches/{batch_id}").json()["request_counts"]["completed"] < 4:
        assert time.time() < deadline
        time.sleep(0.2)
    started = time.time()
    answer = client(api_url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Quick!"}], **GREEDY
    )
    latency = time.time() - started
    progress = httpx.get(f"{api_url}/v1/batches/{batch_id}").json()
    assert answer.choices[0].message.content is not None
    assert progress["status"] == "in_progress", "the batch ended before the test could tell"
    batch_left = progress["request_counts"]["total"] - progress["request_counts"]["completed"]
    assert batch_left > 40  # far from done, yet the online request did not wait for it
    assert latency < 10, latency
    done = wait_for(api_url, batch_id, timeout=600)
    assert done["request_counts"] == {"total": 160, "completed": 160, "failed": 0, "reused": 0}
