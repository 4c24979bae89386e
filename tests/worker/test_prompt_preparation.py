"""A worker's requests are tokenized on the threads that prepare them (a shard's task, the
online server's), never on the engine's: that thread steps the model for every request in
flight, and a long prompt's tokenizing (~7 ms for 10,000 tokens on a CPU) would hold them all
up, as vLLM's engine core never tokenizes either."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.errors import InvalidPromptError
from conveyor.engine.protocol import TokenizedPrompt
from conveyor.request_outcome import PreparedLine, prepare_line, prepare_request, reuse_key
from conveyor.wire_format.request_line import parse_request_line
from conveyor.worker.engine_service import EngineJob, EngineService


class RecordingTokenizer:
    """The model's tokenizer, noting the thread of every encoding."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.threads: list[str] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        return self.tokenizer(*args, **kwargs)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        return self.tokenizer.encode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


@pytest.fixture(scope="module")
def llm(chat_model: Path) -> LLM:
    return LLM(str(chat_model), device="cpu", dtype="float32", num_kv_blocks=64)


def line(custom_id: str, body: dict[str, Any], url: str = "/v1/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_a_prepared_prompt_runs_as_its_text_does(llm: LLM) -> None:
    text = "the sea and the ships on it"
    prepared = llm.prepare_prompt(text)
    assert prepared.text == text
    assert prepared.token_ids == list(llm.tokenizer(text).input_ids)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain, early = llm.generate([text, prepared], params, use_tqdm=False)
    assert early.prompt == plain.prompt == text
    assert early.prompt_token_ids == plain.prompt_token_ids
    assert early.outputs[0].token_ids == plain.outputs[0].token_ids


def test_prompt_ids_are_checked_as_they_are_prepared(llm: LLM) -> None:
    with pytest.raises(InvalidPromptError, match="outside the vocabulary"):
        llm.prepare_prompt([1, llm.vocab_size])
    # one made by hand, not by prepare_prompt, is checked as it is added
    with pytest.raises(InvalidPromptError, match="outside the vocabulary"):
        llm.add_request("r", TokenizedPrompt([1, llm.vocab_size + 5]), SamplingParams())
    assert not llm.has_unfinished()


def test_a_bad_line_is_its_own_error_line_as_it_is_prepared(llm: LLM) -> None:
    raw = line("bad", {"model": "tiny", "prompt": [1, 10**9], "max_tokens": 2})
    error = prepare_line(llm, raw, 3, "b:3", lambda r, n: parse_request_line(r, line=n))
    assert isinstance(error, dict)
    body = error["response"]["body"]["error"]
    assert error["response"]["status_code"] == 400
    assert (body["code"], body["param"]) == ("invalid_prompt", "body.prompt")
    assert "outside the vocabulary" in body["message"]


def test_the_engine_thread_never_tokenizes(llm: LLM) -> None:
    recording = RecordingTokenizer(llm.tokenizer)
    llm.tokenizer = recording
    story = {"model": "tiny", "prompt": "tell a long story about the sea", "max_tokens": 4}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "a story"}], "max_tokens": 4}
    lines = [line("text", story), line("chat", chat, "/v1/chat/completions")]
    parse = lambda raw, n: parse_request_line(raw, line=n)  # noqa: E731
    prepared = [prepare_line(llm, raw, i, f"b:{i}", parse) for i, raw in enumerate(lines)]
    hi = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
    online, params = prepare_request(llm, parse(line("o", hi), 9))
    assert all(isinstance(p, PreparedLine) for p in prepared)
    jobs = [(f"b:{i}", p.prompt, p.params) for i, p in enumerate(prepared)]
    jobs.append(("online:o:0", online, params))
    done: dict[str, Any] = {}
    finished = threading.Event()

    def on_done(request_id: str, output: Any) -> None:
        done[request_id] = output
        if len(done) == len(jobs):
            finished.set()

    service = EngineService(llm)
    service.start()
    try:
        service.submit([
            EngineJob(rid, prompt, p, lambda o, r=rid: on_done(r, o), print)
            for rid, prompt, p in jobs
        ])  # fmt: skip
        assert finished.wait(60), done
    finally:
        service.stop()
        llm.tokenizer = recording.tokenizer
    assert service.failure is None
    assert all(done[rid].outputs[0].token_ids for rid, _, _ in jobs)
    assert done["b:0"].prompt == "tell a long story about the sea"
    assert recording.threads, "nothing was tokenized"
    assert service.name not in recording.threads, recording.threads


def test_a_prepared_lines_reuse_key_is_the_one_of_its_text(llm: LLM) -> None:
    """Keys stored before prompts were prepared off the engine's thread still match."""
    raw = line("k", {"model": "tiny", "prompt": "the same words", "temperature": 0})
    prepared = prepare_line(llm, raw, 1, "b:1", lambda r, n: parse_request_line(r, line=n))
    assert isinstance(prepared, PreparedLine) and isinstance(prepared.prompt, TokenizedPrompt)
    as_given = PreparedLine(prepared.parsed, "the same words", prepared.params)
    assert reuse_key(prepared) == reuse_key(as_given) is not None
