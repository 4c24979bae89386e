"""`conveyor`: an lm-evaluation-harness model type whose requests run as durable batches on a
Conveyor service. Importing this module registers it with lm-eval (which has no plugin entry
point); it is the one module that imports lm-eval.

It is lm-eval's own `local-completions` model with another transport. Each request type lm-eval
asks for (loglikelihood, loglikelihood_rolling, generate_until) becomes one batch of
`/v1/completions` lines, or several when it is over `max_batch_lines` or `max_batch_bytes`. A
line's body is what `local-completions` would POST for that one prompt (`_create_payload`), with
the prompt as a list of token ids when a tokenizer is known. Results come back by custom_id and
are read with lm-eval's own `parse_logprobs` / `parse_generations`; every result is handed to
lm-eval's cache hook (`--use_cache`).

A batch's idempotency key is a hash of its JSONL, so running the same evaluation again (after a
crash, a Ctrl-C, or to reread finished results) attaches to the batches it made before instead
of computing them again. A batch that was cancelled or expired is submitted again under the
next key (`KEY:2`, `KEY:3`, ...). A request without a result fails the evaluation with an
`EvaluationError` naming it: nothing is dropped in silence.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from lm_eval import utils as lm_utils
from lm_eval.api.registry import register_model
from lm_eval.models.api_models import LMEVAL_MODEL_NONE_ANSWER_PLACEHOLDER, JsonChatStr
from lm_eval.models.openai_completions import LocalCompletionsAPI

from conveyor.client import DEFAULT_URL, ConveyorClient
from conveyor.ledger.states import BatchStatus
from conveyor.wire_format.bodies import CHAT_URL, COMPLETIONS_URL

MODEL_TYPE = "conveyor"
BATCH_LINES = 50_000  # the service's default CONVEYOR_MAX_BATCH_LINES
BATCH_BYTES = 100 * 1024 * 1024  # half the service's default upload limit
KEY_PREFIX = "conveyor-eval"
# batches that will never finish: their requests are submitted again under the next key
DEAD = (BatchStatus.CANCELLING, BatchStatus.CANCELLED, BatchStatus.EXPIRED)
SHOWN_FAILURES = 10


class EvaluationError(RuntimeError):
    """The evaluation cannot go on: a request got no result, or the service cannot serve it."""


def api_root(base_url: str | None) -> str:
    """The service's root URL from `base_url` (default $CONVEYOR_URL, else the local default),
    which may also name its `/v1` or `/v1/completions` (as `local-completions` wants)."""
    url = (base_url or os.environ.get("CONVEYOR_URL") or DEFAULT_URL).rstrip("/")
    for suffix in ("/v1/completions", "/v1/chat/completions", "/v1"):
        if url.endswith(suffix):
            return url[: -len(suffix)]
    return url


def _say(message: str) -> None:
    print(f"conveyor eval: {message}", file=sys.stderr, flush=True)


def _jsonl_chunks(lines: Sequence[bytes], max_lines: int, max_bytes: int) -> Iterator[list[bytes]]:
    """`lines` in order, in chunks of at most `max_lines` lines and `max_bytes` bytes (a single
    longer line makes a chunk of its own)."""
    chunk: list[bytes] = []
    size = 0
    for line in lines:
        if chunk and (len(chunk) >= max_lines or size + len(line) > max_bytes):
            yield chunk
            chunk, size = [], 0
        chunk.append(line)
        size += len(line)
    if chunk:
        yield chunk


def _failure(line: dict[str, Any] | None) -> str | None:
    """Why a result line holds no answer (`code: message`), or None when it holds one."""
    if line is None:
        return "no result line"
    response = line.get("response") or {}
    error = line.get("error") or (response.get("body") or {}).get("error")
    if error or response.get("status_code") != 200:
        error = error or {}
        return f"{error.get('code')}: {error.get('message')}"
    return None


def _about_text(text: str, width: int = 60) -> str:
    return repr(text if len(text) <= width else "..." + text[-width:])


@register_model(MODEL_TYPE)
class ConveyorLM(LocalCompletionsAPI):
    """Model args: `base_url` (default $CONVEYOR_URL), `model` (default: the one model the
    service serves), `tokenizer` (path or Hugging Face name; default: the service's tokenizer
    endpoints when it has them), `poll` (seconds between status polls), `completion_window`,
    `max_batch_lines`, `max_batch_bytes`, and `local-completions`' own (`max_length`,
    `max_gen_toks`, `seed`, `tokenized_requests`, ...). $CONVEYOR_API_KEY is sent as Bearer."""

    def __init__(
        self,
        base_url: str | None = None,
        model: str | None = None,
        tokenizer: str | None = None,
        tokenizer_backend: str | None = None,
        poll: float = 1.0,
        completion_window: str = "24h",
        max_batch_lines: int = BATCH_LINES,
        max_batch_bytes: int = BATCH_BYTES,
        **kwargs: Any,
    ) -> None:
        self.root = api_root(base_url)
        self.client = ConveyorClient(self.root)
        self.poll = float(poll)
        self.completion_window = str(completion_window)
        self.max_batch_lines = int(max_batch_lines)
        self.max_batch_bytes = int(max_batch_bytes)
        model = model or kwargs.pop("pretrained", None) or self._served_model()
        api_key = os.environ.get("CONVEYOR_API_KEY") or None
        if tokenizer_backend is None:
            tokenizer_backend = "huggingface" if tokenizer else self._server_tokenizer(api_key)
        super().__init__(
            base_url=self.root,
            model=str(model),
            tokenizer=tokenizer,
            tokenizer_backend=tokenizer_backend,
            auth_token=api_key,
            **kwargs,
        )

    def _served_model(self) -> str:
        names = self.client.models()
        if len(names) == 1:
            return names[0]
        if not names:
            raise EvaluationError(
                f"no live worker of the service at {self.root} serves a model: start one, or "
                "name the model to queue for with --model_args model=NAME"
            )
        raise EvaluationError(
            f"the service at {self.root} serves {', '.join(sorted(names))}: choose one with "
            "--model_args model=NAME"
        )

    def _server_tokenizer(self, api_key: str | None) -> str | None:
        """lm-eval's `remote` tokenizer backend when the service has the tokenizer endpoints
        it uses (/tokenizer_info, /tokenize, /detokenize); else None: no tokenizer."""
        if lm_utils.check_remote_tokenizer_support(self.root, auth_token=api_key):
            return "remote"
        _say(
            f"the service at {self.root} offers no tokenizer (/tokenizer_info, /tokenize), so "
            "generation requests go as text and loglikelihood tasks cannot run; give the "
            "model's tokenizer with --model_args tokenizer=PATH_OR_NAME"
        )
        return None

    def _need_tokenizer(self, request_type: str) -> None:
        if self.tokenizer is None:
            raise EvaluationError(
                f"{request_type} requests need the model's tokenizer to tell the context's "
                f"tokens from the continuation's, and the service at {self.root} offers none: "
                "give it with --model_args tokenizer=PATH_OR_NAME (the model's directory or "
                "Hugging Face name)"
            )

    # ---- the request types --------------------------------------------------------------

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple]:
        self._need_tokenizer("loglikelihood")
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def _loglikelihood_tokens(
        self,
        requests: list,
        disable_tqdm: bool = False,
        request_type: str = "loglikelihood",
        about: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        """(logprob, is_greedy) of each (cache key, context tokens, continuation tokens), as
        `local-completions` computes them, from one durable batch."""
        inputs, ctxlens, cache_keys = self.batch_loglikelihood_requests([requests])
        if about is None:
            about = [
                f"context {_about_text(key[0])}, continuation {_about_text(key[1])}"
                if key is not None
                else f"{len(tokens)} tokens"
                for key, tokens in zip(cache_keys, inputs, strict=True)
            ]
        bodies = [
            self._create_payload(tokens, generate=False, seed=self._seed) for tokens in inputs
        ]
        outputs = self._run(request_type, COMPLETIONS_URL, bodies, about)
        answers = []
        for output, tokens, ctxlen, key in zip(outputs, inputs, ctxlens, cache_keys, strict=True):
            (answer,) = self.parse_logprobs(outputs=[output], tokens=[tokens], ctxlens=[ctxlen])
            if key is not None:  # rolling windows have none
                self.cache_hook.add_partial("loglikelihood", key, answer)
            answers.append(answer)
        return answers

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Each document's loglikelihood, summed over its windows (as `local-completions` cuts
        them), with the windows of all documents in one batch."""
        self._need_tokenizer("loglikelihood_rolling")
        windows, owners, about = [], [], []
        for doc, (text,) in enumerate(req.args for req in requests):
            token_windows = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length - 1,
                context_len=1,
            )
            for n, window in enumerate(map(lm_utils.make_disjoint_window, token_windows)):
                windows.append((None, *window))
                owners.append(doc)
                about.append(f"document {doc} {_about_text(text)}, window {n}")
        answers = self._loglikelihood_tokens(
            windows, request_type="loglikelihood_rolling", about=about
        )
        totals = [0.0] * len(requests)
        for doc, (logprob, _) in zip(owners, answers, strict=True):
            totals[doc] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Each request's generation, from one durable batch: completions of the prompt's
        tokens, or chat completions of its messages when lm-eval gives messages (a chat
        template with no tokenizer here)."""
        if any(len(req.args) > 2 for req in requests):
            raise EvaluationError("multimodal requests are not supported by the conveyor model")
        args = [req.args for req in requests]
        chat = bool(args) and self._messages(args[0][0]) is not None
        bodies = [self._generation_body(context, gen_kwargs) for context, gen_kwargs in args]
        about = [f"context {_about_text(str(context))}" for context, _ in args]
        outputs = self._run("generate_until", CHAT_URL if chat else COMPLETIONS_URL, bodies, about)
        texts = []
        for output, (context, gen_kwargs) in zip(outputs, args, strict=True):
            if chat:
                text = output["choices"][0]["message"]["content"]
            else:
                (text,) = self.parse_generations(outputs=[output])
            if text is None:
                text = LMEVAL_MODEL_NONE_ANSWER_PLACEHOLDER
            else:
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            texts.append(text)
        return texts

    @staticmethod
    def _messages(context: Any) -> list[dict] | None:
        if isinstance(context, JsonChatStr):
            return json.loads(context.prompt)
        if isinstance(context, list) and all(isinstance(m, dict) for m in context):
            return context
        return None

    def _generation_body(self, context: Any, gen_kwargs: dict) -> dict[str, Any]:
        """What `local-completions` would POST for this one context (left-truncated to leave
        room for max_gen_toks, as it does), or its chat-completions form for messages."""
        gen_kwargs = copy.deepcopy(gen_kwargs)
        messages = self._messages(context)
        if messages is not None:
            body = self._create_payload(
                messages, generate=True, gen_kwargs=gen_kwargs, seed=self._seed, eos=None
            )
            body["messages"] = body.pop("prompt")
            return body
        prompt: str | list[int] = context
        if self.tokenized_requests:
            max_gen_toks = gen_kwargs.get("max_gen_toks", self._max_gen_toks)
            tokens = self.tok_encode(context, add_special_tokens=self.add_bos_token)
            prompt = tokens[-max(self.max_length - max_gen_toks, 1) :]
        return self._create_payload(
            prompt, generate=True, gen_kwargs=gen_kwargs, seed=self._seed, eos=self.eos_string
        )

    # ---- durable batches ----------------------------------------------------------------

    def _run(
        self, request_type: str, endpoint: str, bodies: list[dict], about: Sequence[str]
    ) -> list[dict[str, Any]]:
        """The response bodies of `bodies`, in order, from durable batches on the service."""
        if not bodies:
            return []
        lines = [
            {"custom_id": f"{request_type}-{i}", "method": "POST", "url": endpoint, "body": body}
            for i, body in enumerate(bodies)
        ]
        encoded = [json.dumps(line, separators=(",", ":")).encode() + b"\n" for line in lines]
        chunks = list(_jsonl_chunks(encoded, self.max_batch_lines, self.max_batch_bytes))
        with tempfile.TemporaryDirectory(prefix="conveyor-eval-") as tmp:
            batches = [
                self._batch_of(request_type, endpoint, chunk, Path(tmp) / f"{n}.jsonl")
                for n, chunk in enumerate(chunks)
            ]
            desc = f"{request_type}: {len(lines)} requests in {len(batches)} batch(es)"
            batches = self.client.wait([b["id"] for b in batches], self.poll, desc=desc)
            for batch in batches:
                self._check_ended(batch)
            results = self._result_lines(batches, Path(tmp))
        failures = []
        for line, what in zip(lines, about, strict=True):
            why = _failure(results.get(line["custom_id"]))
            if why is not None:
                failures.append(f"{line['custom_id']} ({what}): {why}")
        if failures:
            self._fail(request_type, failures, len(lines), batches)
        return [results[line["custom_id"]]["response"]["body"] for line in lines]

    def _batch_of(self, request_type: str, endpoint: str, chunk: list[bytes], path: Path) -> dict:
        """The batch of these JSONL lines: the one made earlier from the same lines if it can
        still finish, else a new one."""
        data = b"".join(chunk)
        path.write_bytes(data)
        key = f"{KEY_PREFIX}:{request_type}:{hashlib.sha256(data).hexdigest()}"
        for attempt in itertools.count(1):
            attempt_key = key if attempt == 1 else f"{key}:{attempt}"
            batch, reused = self.client.find_or_create_batch(
                path,
                endpoint,
                self.completion_window,
                {"lm_eval_request_type": request_type},
                attempt_key,
            )
            if batch["status"] not in DEAD:
                verb = "attached to" if reused else "submitted"
                _say(f"{verb} batch {batch['id']} ({len(chunk)} {request_type} requests)")
                return batch
            _say(f"batch {batch['id']} was {batch['status']}; submitting its requests again")
        raise AssertionError("unreachable")

    def _check_ended(self, batch: dict) -> None:
        status = batch["status"]
        if status == BatchStatus.FAILED:
            errors = [
                f"line {e.get('line')}: {e.get('code')}: {e.get('message')}"
                for e in (batch.get("errors") or {}).get("data") or []
            ]
            raise EvaluationError(
                f"batch {batch['id']} failed validation:\n  "
                + "\n  ".join(errors[:SHOWN_FAILURES] or ["(no errors listed)"])
            )
        if status != BatchStatus.COMPLETED:
            counts = batch["request_counts"]
            raise EvaluationError(
                f"batch {batch['id']} was {status} after {counts['completed']} of "
                f"{counts['total']} requests; run the same command again to submit the "
                "requests again"
            )

    def _result_lines(self, batches: list[dict], tmp: Path) -> dict[str, dict]:
        """The output and error lines of the batches, by custom_id."""
        results: dict[str, dict] = {}
        for batch in batches:
            for file_id in (batch.get("output_file_id"), batch.get("error_file_id")):
                if not file_id:
                    continue
                target = tmp / f"{file_id}.jsonl"
                self.client.download(file_id, target)
                with open(target, "rb") as f:
                    for raw in f:
                        if raw.strip():
                            line = json.loads(raw)
                            results[line["custom_id"]] = line
        return results

    @staticmethod
    def _fail(request_type: str, failures: list[str], total: int, batches: list[dict]) -> None:
        shown = failures[:SHOWN_FAILURES]
        if len(failures) > len(shown):
            shown.append(f"... and {len(failures) - len(shown)} more")
        raise EvaluationError(
            f"{len(failures)} of {total} {request_type} requests got no result "
            f"(batch {', '.join(b['id'] for b in batches)}):\n  " + "\n  ".join(shown)
        )
