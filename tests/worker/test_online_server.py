"""The worker's online server on its own (an in-process bus, a recording engine service): a
cancelled request's sequences are aborted and counted, a 500 tells only "internal error" and the
request's id, and every 400 names its field."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from conveyor.dispatch.online import LocalBus, OnlineMessage
from conveyor.engine.errors import InvalidPromptError, InvalidSamplingParamsError, RequestFailure
from conveyor.engine.outputs import CompletionOutput, RequestOutput
from conveyor.wire_format.token_text import TokenDecoder
from conveyor.worker.echo import EchoEngine
from conveyor.worker.engine_service import EngineJob
from conveyor.worker.metrics import ONLINE_ABORTS
from conveyor.worker.online import OnlineServer

QUEUE = "conveyor.online.test"


@dataclass
class RecordingService:
    """Stands in for the engine service: keeps what it is given."""

    jobs: list[EngineJob] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    def submit(self, jobs: list[EngineJob]) -> None:
        self.jobs.extend(jobs)

    def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)


class VocabTokenizer:
    """A tokenizer of 100 ids whose `decode` fails on a given id, as a library's would."""

    def __init__(self, failing: int | None = None) -> None:
        self.failing = failing

    def encode(self, text: str) -> list[int]:
        return [1]

    def decode(self, ids: list[int], **_: Any) -> str:
        if self.failing in ids:
            raise RuntimeError("tokenizers.PanicException at src/lib.rs:42")
        return " ".join(map(str, ids))


class NoVocabularySize(EchoEngine):
    """An engine that does not say its vocabulary's size, with a tokenizer that cannot tell."""

    def __init__(self) -> None:
        super().__init__()
        self.tokenizer = VocabTokenizer()


class ModelLike(NoVocabularySize):
    def __init__(self) -> None:
        super().__init__()
        self.vocab_size = 100


def wait_until(check, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def answer_of(bus: LocalBus, message: OnlineMessage) -> dict:
    async def last() -> dict:
        async for answer in bus.answers(message):
            if answer.get("last"):
                return answer
        raise AssertionError("no last answer")

    return asyncio.run(last())


@pytest.fixture
def served(request):
    engine = getattr(request, "param", None) or ModelLike()
    bus, service = LocalBus(), RecordingService()
    server = OnlineServer(bus, [QUEUE], service, engine, TokenDecoder(engine.tokenizer), None)
    server.start()
    yield bus, service, server
    server.stop()


def completion(**body: Any) -> OnlineMessage:
    body = {"model": "m", "prompt": "a b c", "max_tokens": 4, **body}
    return OnlineMessage("completion", body, time.time() + 60)


def aborts(reason: str) -> float:
    return ONLINE_ABORTS.labels("m", reason)._value.get()


@pytest.mark.parametrize("taken", [False, True], ids=["unsure", "answered"])
def test_a_cancelled_request_is_aborted_and_counted(served, taken):
    bus, service, _ = served
    before = aborts("disconnect")
    message = completion(prompt=["one", "two"], stream=True)
    asyncio.run(bus.send(QUEUE, message))
    wait_until(lambda: len(service.jobs) == 2)
    asyncio.run(bus.cancel(QUEUE, message, taken))
    wait_until(lambda: len(service.aborted) == 2)
    assert service.aborted == [job.request_id for job in service.jobs]
    assert aborts("disconnect") == before + 1


def test_a_request_cancelled_before_a_worker_took_it_never_starts(served):
    bus, service, server = served
    server.stop()  # takes nothing more
    server.join(timeout=5)
    message = completion()
    asyncio.run(bus.send(QUEUE, message))
    asyncio.run(bus.cancel(QUEUE, message))
    assert bus.take([QUEUE], timeout=0.1) is None


def test_a_cancel_that_overtakes_its_request_stops_it_from_starting(served):
    _, service, server = served
    message = completion()
    server._cancel(message.request_id)  # heard of before the request is started
    server._handle(message)
    assert service.jobs == []


def test_an_output_after_the_abort_is_aborted_again(served):
    bus, service, _ = served
    message = completion(stream=True)
    asyncio.run(bus.send(QUEUE, message))
    wait_until(lambda: len(service.jobs) == 1)
    asyncio.run(bus.cancel(QUEUE, message))
    wait_until(lambda: len(service.aborted) == 1)
    job = service.jobs[0]
    job.on_partial(RequestOutput(job.request_id, "a", [1], None, [], finished=False))
    assert service.aborted == [job.request_id, job.request_id]


@pytest.mark.parametrize("tokens", [[5, 100], [10**12], [2**70]])
def test_detokenize_refuses_ids_outside_the_vocabulary(served, tokens):
    bus, _, _ = served
    message = OnlineMessage("detokenize", {"tokens": tokens}, time.time() + 60)
    asyncio.run(bus.send(QUEUE, message))
    answer = answer_of(bus, message)
    assert answer["status"] == 400
    assert answer["body"]["error"]["param"] == "tokens"


@pytest.mark.parametrize("served", [NoVocabularySize()], indirect=True)
def test_detokenize_without_a_vocabulary_size_still_refuses_huge_ids(served):
    bus, _, _ = served
    message = OnlineMessage("detokenize", {"tokens": [2**70]}, time.time() + 60)
    asyncio.run(bus.send(QUEUE, message))
    assert answer_of(bus, message)["body"]["error"]["param"] == "tokens"
    fine = OnlineMessage("detokenize", {"tokens": [7, 8]}, time.time() + 60)
    asyncio.run(bus.send(QUEUE, fine))
    assert answer_of(bus, fine) == {"status": 200, "body": {"prompt": "7 8"}, "last": True}


def test_a_500_tells_the_request_id_and_no_internals(served, caplog):
    bus, _, server = served
    server.engine.tokenizer = VocabTokenizer(failing=13)
    message = OnlineMessage("detokenize", {"tokens": [13]}, time.time() + 60)
    with caplog.at_level(logging.ERROR, logger="conveyor.worker.online"):
        asyncio.run(bus.send(QUEUE, message))
        answer = answer_of(bus, message)
    error = answer["body"]["error"]
    assert answer["status"] == 500 and error["code"] == "internal_error"
    assert error["message"] == (
        f"internal error (request {message.request_id}); the service's log has the details"
    )
    assert message.request_id in caplog.text and "PanicException" in caplog.text


@pytest.mark.parametrize(
    ("error", "status", "param"),
    [
        (
            RequestFailure("top_k must be at least -1", "top_k", InvalidSamplingParamsError),
            400,
            "top_k",
        ),
        (
            RequestFailure("prompt token id 7 is outside the vocab", "prompt", InvalidPromptError),
            400,
            "prompt",
        ),
        (RequestFailure("IndexError: index 9 is out of bounds"), 500, None),
    ],
)
def test_an_output_with_an_error_answers_by_its_kind(served, error, status, param):
    bus, service, _ = served
    message = completion()
    asyncio.run(bus.send(QUEUE, message))
    wait_until(lambda: len(service.jobs) == 1)
    job = service.jobs[0]
    output = RequestOutput(job.request_id, "", [], None, [], finished=True)
    output.error = error
    job.on_done(output)
    answer = answer_of(bus, message)
    assert answer["status"] == status
    assert answer["body"]["error"]["param"] == param
    assert "IndexError" not in answer["body"]["error"]["message"]


def test_a_chats_template_variables_reach_the_template(served):
    """`chat_template_kwargs` of an online chat render its prompt (the echo engine writes the
    variables after the messages)."""
    bus, service, _ = served
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    asyncio.run(bus.send(QUEUE, OnlineMessage("chat", body, time.time() + 60)))
    wait_until(lambda: service.jobs)
    assert service.jobs[0].prompt == "user: hi\nenable_thinking=False"


class Thinking(ModelLike):
    def __init__(self) -> None:
        super().__init__()
        self.reasoning_parser = "deepseek_r1"


@pytest.mark.parametrize("served", [Thinking()], indirect=True)
def test_an_online_chat_answers_with_its_thinking_apart(served):
    bus, service, _ = served
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    message = OnlineMessage("chat", body, time.time() + 60)
    asyncio.run(bus.send(QUEUE, message))
    wait_until(lambda: service.jobs)
    job = service.jobs[0]
    comp = CompletionOutput(0, "two and two</think>4", [5, 6, 7], None, None, "stop")
    job.on_done(RequestOutput(job.request_id, None, [1], None, [comp], finished=True))
    answer = answer_of(bus, message)
    choice = answer["body"]["choices"][0]["message"]
    assert (choice["content"], choice["reasoning"]) == ("4", "two and two")
    assert answer["body"]["usage"]["completion_tokens_details"]["reasoning_tokens"] == 3


def streamed_output(job: EngineJob, ids: list[int], finished: bool = False) -> RequestOutput:
    text = " ".join(map(str, ids))
    comp = CompletionOutput(0, text, ids, None, None, "length" if finished else None)
    return RequestOutput(job.request_id, "a b c", [1], None, [comp], finished=finished)


def sent_answers(bus: LocalBus, message: OnlineMessage) -> list[dict]:
    async def every() -> list[dict]:
        got = []
        async for answer in bus.answers(message):
            got.append(answer)
            if answer.get("last"):
                return got
        return got

    return asyncio.run(every())


def texts(answers: list[dict]) -> list[str]:
    return [chunk["choices"][0]["text"] for a in answers for chunk in a["chunks"]]


def test_a_stream_whose_answers_fall_behind_sends_several_steps_in_one_chunk():
    engine = ModelLike()
    bus, service = LocalBus(), RecordingService()
    server = OnlineServer(bus, [QUEUE], service, engine, TokenDecoder(engine.tokenizer), None)
    message = completion(stream=True, max_tokens=3)
    asyncio.run(bus.send(QUEUE, message))
    server._handle(bus.take([QUEUE], timeout=1))  # not started: the outbox fills until sent
    (job,) = service.jobs
    job.on_partial(streamed_output(job, [7]))
    job.on_partial(streamed_output(job, [7, 8]))
    server._send_round([server.outbox.get_nowait()])
    job.on_partial(streamed_output(job, [7, 8, 9]))
    job.on_done(streamed_output(job, [7, 8, 9, 10], finished=True))
    taken = [server.outbox.get_nowait()]
    assert server.outbox.empty()  # the stream waits in the outbox once, however many steps
    server._send_round(taken)

    first, last = sent_answers(bus, message)
    assert not first["last"] and last["last"] and last["status"] == 200
    # the opening chunk, then what each round had: two steps, then two more and the end
    assert texts([first]) == ["", "7 8"]
    assert texts([last]) == [" 9 10", ""]
    assert last["chunks"][-1]["choices"][0]["finish_reason"] == "length"
    assert server.calls == {}


def test_a_stream_cancelled_with_chunks_unsent_sends_none_of_them(served):
    bus, service, server = served
    server.stop()
    server.join(timeout=5)
    message = completion(stream=True)
    asyncio.run(bus.send(QUEUE, message))
    server._handle(bus.take([QUEUE], timeout=1))
    (job,) = service.jobs
    job.on_partial(streamed_output(job, [7]))
    server._cancel(message.request_id)
    assert service.aborted == [job.request_id]
    server._send_round([server.outbox.get_nowait()])
    assert not bus._reply_queue(message.request_id).items
