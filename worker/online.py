"""A worker's online requests: taken from its models' online lists, run at the front of its
engine's queue (ahead of batch work), answered through the bus while the client waits.

Completions and chat completions are checked and answered with the batch lines' own code
(`conveyor.wire_format`): the same bodies, the same response objects. Tokenizing answers
at once from this thread. Answers go out from a thread of their own, so the engine's loop never
waits on the bus, and cancellations (a client that went away) come in on another, so that its
sequences are aborted before the engine's next step, not when this thread next looks.

A streamed request's chunks are made on the answers' thread too, from the newest output of each
of its prompts: the engine's thread only hands the output over. When the answers fall behind the
engine (many streams at once), the tokens of several steps go out in one chunk, so a busy worker
spends its time on tokens rather than on messages about them.

A 500 says only "internal error" and the request's id, which the worker's log line carries with
the details; a 4xx names the field at fault.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from pydantic import ValidationError

from conveyor.dispatch.online import OnlineBus, OnlineMessage
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.protocol import Engine
from conveyor.request_outcome import (
    chat_template_error,
    engine_error,
    internal_error,
    prepare_request,
)
from conveyor.wire_format.bodies import (
    CHAT_URL,
    COMPLETIONS_URL,
    MAX_INT,
    RESPONSES_URL,
    DetokenizeBody,
    TokenizeBody,
    template_ending,
    template_messages,
    template_tools,
)
from conveyor.wire_format.errors import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    MODEL_UNAVAILABLE,
    RequestError,
    error_body,
)
from conveyor.wire_format.request_line import (
    OnlineRequest,
    parse_online_body,
    validation_message,
)
from conveyor.wire_format.response_events import ResponseEvents
from conveyor.wire_format.response_object import response_from_chat
from conveyor.wire_format.responses import (
    chat_completion_body,
    merged_body,
    text_completion_body,
)
from conveyor.wire_format.streaming import ChunkStream
from conveyor.wire_format.token_text import TokenDecoder
from conveyor.worker.engine_service import EngineJob, EngineService
from conveyor.worker.metrics import ONLINE_ABORTS

log = logging.getLogger(__name__)

ONLINE_PRIORITY = 0  # ahead of batch work
ANSWERS_PER_SEND = 256  # answers pushed to the bus in one round trip at most
ENGINE_FAILED = "the engine failed while running this request; retry it"
URLS = {"completion": COMPLETIONS_URL, "chat": CHAT_URL, "responses": RESPONSES_URL}
# how long a cancellation of a request this worker has not seen is kept: it may have taken the
# request a moment before, and be about to start it
EARLY_CANCEL_SECONDS = 60.0


@dataclass
class _Call:
    """One online request in the engine: the outputs of its prompts as they finish."""

    message: OnlineMessage
    online: OnlineRequest
    model: str
    stream: ChunkStream | ResponseEvents | None
    outputs: dict[int, Any] = field(default_factory=dict)
    engine_ids: list[str] = field(default_factory=list)
    over: bool = False
    # a stream's outputs not yet made into chunks, the newest per prompt; `queued` while the
    # call waits in the outbox, `complete` once every prompt finished, `closed` once its last
    # answer is made
    pending: dict[int, RequestOutput] = field(default_factory=dict)
    queued: bool = False
    complete: bool = False
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class OnlineServer(threading.Thread):
    def __init__(
        self,
        bus: OnlineBus,
        queue_names: list[str],
        service: EngineService,
        engine: Engine,
        decoder: TokenDecoder,
        max_tokens_cap: int | None,
    ) -> None:
        super().__init__(name="conveyor-online", daemon=True)
        self.bus, self.queue_names = bus, queue_names
        self.service, self.engine, self.decoder = service, engine, decoder
        self.max_tokens_cap = max_tokens_cap
        self.stopped = threading.Event()
        self.calls: dict[str, _Call] = {}  # request id -> call in the engine
        self.lock = threading.Lock()
        # answers, and streamed calls whose chunks are to be made when their turn comes
        self.outbox: queue.SimpleQueue[tuple[str, dict[str, Any] | _Call]] = queue.SimpleQueue()
        self.sender = threading.Thread(target=self._send, name="conveyor-online-answers")
        self.sender.daemon = True
        self.canceller = threading.Thread(target=self._take_cancels, name="conveyor-online-cancels")
        self.canceller.daemon = True
        self.early_cancels: dict[str, float] = {}  # request id -> when its cancel came

    def stop(self) -> None:
        self.stopped.set()

    def fail_in_flight(self) -> None:
        """The engine failed: answer the requests that were in it with an error to retry."""
        with self.lock:
            calls = list(self.calls.values())
        for call in calls:
            log.warning("online request %s: the engine failed under it", call.message.request_id)
            self._finish(call, error_answer(503, ENGINE_FAILED, MODEL_UNAVAILABLE))

    def use_engine(self, service: EngineService, engine: Engine) -> None:
        """Run online requests on a new engine (the last one failed)."""
        self.service, self.engine = service, engine

    def run(self) -> None:
        self.sender.start()
        self.canceller.start()
        while not self.stopped.is_set():
            try:
                message = self.bus.take(self.queue_names, timeout=1.0)
            except Exception:  # the bus is away: try again in a moment
                log.warning("could not take online requests; retrying", exc_info=True)
                self.stopped.wait(1.0)
                continue
            if message is not None:
                self._handle(message)
            self._abort_overdue()
            self._forget_early_cancels()

    # ---- requests --------------------------------------------------------------------------
    def _handle(self, message: OnlineMessage) -> None:
        if message.deadline <= time.time():
            return  # nobody waits for it any more
        try:
            if message.kind in URLS:
                self._start(message)
            else:
                self._answer(message, self._tokenizer_answer(message))
        except RequestError as err:
            param = err.param.removeprefix("body.") if err.param else None
            self._answer(message, error_answer(err.status_code, err.detail, err.code, param))
        except ValidationError as err:
            self._answer(message, invalid_body_answer(err))
        except Exception:
            log.exception("online request %s failed", message.request_id)
            self._answer(message, internal_error_answer(message.request_id))

    def _start(self, message: OnlineMessage) -> None:
        online = parse_online_body(
            URLS[message.kind], message.body, max_tokens_cap=self.max_tokens_cap or None
        )
        chat = message.kind != "completion"
        stream: ChunkStream | ResponseEvents | None = None
        if online.stream:
            stream = ChunkStream(online.requests, online.n, online.model, self.decoder, chat)
            if message.kind == "responses":  # its events are made from the chat chunks
                stream = ResponseEvents(stream, online.requests[0])
        call = _Call(message, online, online.model, stream)
        jobs = []
        for i, request in enumerate(online.requests):
            prompt, params = prepare_request(self.engine, request)
            engine_id = f"online:{message.request_id}:{i}"
            call.engine_ids.append(engine_id)
            jobs.append(
                EngineJob(
                    engine_id,
                    prompt,
                    params,
                    on_done=partial(self._on_output, call, i),
                    on_error=partial(self._on_error, call),
                    priority=ONLINE_PRIORITY,
                    on_partial=partial(self._on_output, call, i) if stream else None,
                )
            )
        with self.lock:
            if self.early_cancels.pop(message.request_id, None) is not None:
                return  # its client left while it was on its way here
            self.calls[message.request_id] = call
        self.service.submit(jobs)

    def _tokenizer_answer(self, message: OnlineMessage) -> dict[str, Any]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not hasattr(tokenizer, "encode"):
            raise RequestError("this model has no tokenizer", code=INVALID_REQUEST, param="model")
        if message.kind == "tokenizer_info":
            return {"status": 200, "body": tokenizer_info(tokenizer, self.engine)}
        if message.kind == "detokenize":
            body = DetokenizeBody.model_validate(message.body)
            check_token_ids(body.tokens, vocabulary_size(self.engine, tokenizer))
            return {"status": 200, "body": {"prompt": tokenizer.decode(body.tokens)}}
        body = TokenizeBody.model_validate(message.body)
        if body.messages is not None:  # rendered as a chat request renders them
            generation_prompt, continued = template_ending(
                body.add_generation_prompt, body.continue_final_message
            )
            try:
                text = self.engine.render_chat_template(
                    template_messages(body.messages),
                    generation_prompt,
                    body.chat_template_kwargs,
                    template_tools(body.tools),
                    continued,
                )
            except Exception as err:  # the engine's ChatTemplateError, or a template's own
                raise chat_template_error(err) from None
            special = bool(body.add_special_tokens)
        else:
            text = body.prompt or ""
            special = body.add_special_tokens is not False
        tokens = list(tokenizer(text, add_special_tokens=special).input_ids)
        limit = self.engine.max_model_len
        return {
            "status": 200,
            "body": {"count": len(tokens), "max_model_len": limit, "tokens": tokens},
        }

    # ---- outputs (called from the engine's thread) -----------------------------------------
    def _on_output(self, call: _Call, prompt: int, output: RequestOutput) -> None:
        if call.over:
            if not output.finished:  # its abort came before the engine had it
                self.service.abort([call.engine_ids[prompt]])
            return
        if error := output.error:
            self._finish(call, self._error_answer(call, error))
            return
        finished = output.finished
        if finished:
            call.outputs[prompt] = output
        if call.stream is not None:
            self._hand_over(call, prompt, output)
        elif len(call.outputs) == len(call.online.requests):
            body = self._body(call)
            if call.message.kind == "responses":
                body = response_from_chat(call.online.requests[0], body)
            self._finish(call, {"status": 200, "body": body})

    def _hand_over(self, call: _Call, prompt: int, output: RequestOutput) -> None:
        """Give a stream's output to the answers' thread; one already waiting there is replaced
        (outputs hold everything so far, so the newest makes the chunks of both)."""
        complete = len(call.outputs) == len(call.online.requests)
        if complete:
            self._retire(call)
        with call.lock:
            call.pending[prompt] = output
            call.complete = complete
            if call.queued:
                return
            call.queued = True
        self.outbox.put((call.message.request_id, call))

    def _stream_answer(self, call: _Call) -> dict[str, Any] | None:
        """The answer that carries a stream's new chunks (its last one, with the usage, once
        every prompt finished); None when there is nothing to send."""
        with call.lock:
            pending, call.pending, call.queued = call.pending, {}, False
            complete = call.complete
            if call.closed:
                return None
            call.closed = complete
        assert call.stream is not None
        try:
            chunks = [c for i in sorted(pending) for c in call.stream.chunks(i, pending[i])]
            if not complete:
                return {"chunks": chunks, "last": False} if chunks else None
            if call.online.include_usage:
                chunks.append(call.stream.usage_chunk(self._body(call)["usage"]))
        except Exception as err:
            log.exception("online request %s: no chunks could be made", call.message.request_id)
            with call.lock:
                call.closed = True
            self._retire(call)
            return {**self._error_answer(call, err), "last": True}
        return {"status": 200, "chunks": chunks, "last": True}

    def _body(self, call: _Call) -> dict[str, Any]:
        """The chat completion or completion object of a finished call."""
        build = text_completion_body if call.message.kind == "completion" else chat_completion_body
        bodies = [
            build(request, call.outputs[i], call.model, self.decoder)
            for i, request in enumerate(call.online.requests)
        ]
        return merged_body(bodies, call.online.n)

    def _on_error(self, call: _Call, err: Exception) -> None:
        self._finish(call, self._error_answer(call, err))

    def _error_answer(self, call: _Call, err: Any) -> dict[str, Any]:
        """The answer to a request the engine refused or gave up on (an exception, or an
        output's `RequestFailure`): the request's own fault is a 400 naming its field, the
        engine's a 500 with the request's id, which the log line with the details carries."""
        error = engine_error(err, call.online.requests[0], call.message.request_id)
        param = error.param.removeprefix("body.") if error.param else None
        return error_answer(error.status_code, error.detail, error.code, param)

    def _finish(self, call: _Call, answer: dict[str, Any]) -> None:
        with call.lock:
            call.closed = True  # a stream's chunks not yet made stay unsent
        self._retire(call)
        self._answer(call.message, answer)

    def _retire(self, call: _Call) -> None:
        """No more of `call` runs: it leaves the calls in flight and the engine."""
        call.over = True
        with self.lock:
            self.calls.pop(call.message.request_id, None)
        unfinished = [
            engine_id for i, engine_id in enumerate(call.engine_ids) if i not in call.outputs
        ]
        if unfinished:
            self.service.abort(unfinished)

    def _abort_overdue(self) -> None:
        now = time.time()
        with self.lock:
            overdue = [c for c in self.calls.values() if c.message.deadline <= now]
        for call in overdue:
            log.warning("online request %s ran past its deadline", call.message.request_id)
            self._abort(call, "deadline")

    def _abort(self, call: _Call, reason: str) -> None:
        call.over = True
        with self.lock:
            if self.calls.pop(call.message.request_id, None) is None:
                return  # it finished meanwhile
        with call.lock:
            call.closed = True  # nobody reads what was not sent
        self.service.abort(call.engine_ids)
        ONLINE_ABORTS.labels(call.model, reason).inc()

    # ---- cancellations (from their own thread) ---------------------------------------------
    def _take_cancels(self) -> None:
        while not self.stopped.is_set():
            try:
                for request_id in self.bus.cancellations(self.stopped):
                    self._cancel(request_id)
            except Exception:  # the bus is away: listen again in a moment
                log.warning("could not take cancellations; retrying", exc_info=True)
                self.stopped.wait(1.0)

    def _cancel(self, request_id: str) -> None:
        """The client of `request_id` went away: stop its sequences (every worker of the model
        hears of it; only the one that runs it has it)."""
        with self.lock:
            call = self.calls.get(request_id)
            if call is None:
                self.early_cancels[request_id] = time.monotonic()
                return
        log.info("online request %s: its client went away; aborted", request_id)
        self._abort(call, "disconnect")

    def _forget_early_cancels(self) -> None:
        cutoff = time.monotonic() - EARLY_CANCEL_SECONDS
        with self.lock:
            for request_id in [r for r, t in self.early_cancels.items() if t < cutoff]:
                del self.early_cancels[request_id]

    # ---- answers ---------------------------------------------------------------------------
    def _answer(self, message: OnlineMessage, answer: dict[str, Any]) -> None:
        answer.setdefault("last", "chunks" not in answer or "status" in answer)
        self.outbox.put((message.request_id, answer))

    def _send(self) -> None:
        while True:
            taken = [self.outbox.get()]
            while len(taken) < ANSWERS_PER_SEND:  # what queued meanwhile goes along
                try:
                    taken.append(self.outbox.get_nowait())
                except queue.Empty:
                    break
            self._send_round(taken)

    def _send_round(self, taken: list[tuple[str, dict[str, Any] | _Call]]) -> None:
        """Send the answers `taken` from the outbox in one round trip, a stream's chunks made
        now from its newest outputs."""
        answers = []
        for request_id, item in taken:
            answer = self._stream_answer(item) if isinstance(item, _Call) else item
            if answer is not None:
                answers.append((request_id, answer))
        if not answers:
            return
        try:
            self.bus.answer(answers)
        except Exception:
            ids = sorted({request_id for request_id, _ in answers})
            log.warning("could not answer online requests %s", ids, exc_info=True)


def error_answer(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """An answer in OpenAI's error shape, with the HTTP status it stands for."""
    return {"status": status, "body": error_body(message, code, param, status=status)}


def internal_error_answer(request_id: str) -> dict[str, Any]:
    """A 500 that tells nothing of the code, only the id that finds the worker's log line."""
    return error_answer(500, internal_error(request_id), INTERNAL_ERROR)


def invalid_body_answer(err: ValidationError) -> dict[str, Any]:
    message, param, code = validation_message(err, prefix="")
    return error_answer(400, message, code, param or None)


def vocabulary_size(engine: Engine, tokenizer: Any) -> int | None:
    """The model's vocabulary size, else the tokenizer's; None when neither says (the echo
    engine)."""
    size = engine.vocab_size
    if isinstance(size, int):
        return size
    try:
        return len(tokenizer)
    except TypeError:
        return None


def check_token_ids(tokens: list[int], vocab_size: int | None) -> None:
    """400 naming `tokens` for an id outside the vocabulary (or past any tokenizer's ids)."""
    limit = vocab_size if vocab_size is not None else MAX_INT + 1
    for token in tokens:
        if not 0 <= token < limit:
            where = f"[0, {vocab_size})" if vocab_size is not None else "the vocabulary"
            raise RequestError(
                f"token id {token} is outside {where}", code=INVALID_REQUEST, param="tokens"
            )


def tokenizer_info(tokenizer: Any, engine: Engine) -> dict[str, Any]:
    """What vLLM's `GET /tokenizer_info` tells of a tokenizer (lm-eval's remote tokenizer reads
    its special tokens and chat template, which it renders chats with itself: the server's)."""
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "eos_token": getattr(tokenizer, "eos_token", None),
        "bos_token": getattr(tokenizer, "bos_token", None),
        "pad_token": getattr(tokenizer, "pad_token", None),
        "chat_template": engine.served_chat_template(),
        "model_max_length": engine.max_model_len,
    }
