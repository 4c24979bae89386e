"""What the engine loop does with a sampled token once the model has run: the stop rules
(grammar end, stop token ids, EOS, stop strings, length), detokenising, and the assembly of
each request's `RequestOutput` (as vLLM v1 keeps them in its output processor, apart from the
scheduling and the forward pass)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from conveyor.engine.detokenizer import TextDecoding
from conveyor.engine.errors import RequestFailure
from conveyor.engine.output_text import OutputText
from conveyor.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from conveyor.engine.prompt_logprobs import PromptLogprobs
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.sequence import Request, Sequence


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: Iterable[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.decoding = None if tokenizer is None else TextDecoding(tokenizer)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def append_token(self, seq: Sequence, token: int, top: TokenLogprobs | None) -> None:
        """Add `token` to `seq`, and set its finish reason if one of the stop rules holds."""
        seq.token_ids.append(token)
        if top is not None:
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(top)
            seq.cumulative_logprob += top[token]
        if seq.matcher is not None:
            if not seq.matcher.consume_token(token):
                raise RuntimeError(
                    f"the structured output's grammar refused token {token}: "
                    f"{seq.matcher.get_error()}"
                )
            if seq.matcher.is_stopped():
                seq.finish_reason = "stop"
        elif seq.deferred_matcher is not None:
            after = seq.request.constraint_after or ()
            output = seq.num_output_tokens
            if output >= len(after) and tuple(seq.token_ids[-len(after) :]) == after:  # it starts
                seq.matcher, seq.deferred_matcher = seq.deferred_matcher, None
        params = seq.request.params
        if seq.finish_reason is None:
            self._check_stop_token(seq, token, params)
        needs_text = seq.text is not None or params.stop or seq.request.stream
        if needs_text and (seq.finish_reason is None or not self._ends_by(seq, token)):
            self.read_text(seq, token)
        if seq.finish_reason is None:
            self._check_length(seq, params)

    def _check_stop_token(self, seq: Sequence, token: int, params: SamplingParams) -> None:
        if len(seq.token_ids) - seq.num_prompt_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
            elif not params.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"

    def read_text(self, seq: Sequence, token: int) -> None:
        """Detokenize `token` where its sequence's text is needed as it comes (stop strings, a
        stream), and end the sequence on the stop string that it completes."""
        if seq.text is None:
            params = seq.request.params
            if self.decoding is None or not (params.stop or seq.request.stream):
                return
            detokenizer = self.decoding.detokenizer(params.skip_special_tokens)
            seq.text = OutputText(detokenizer, params)
        stop = seq.text.append(token, seq.num_output_tokens, ended=seq.finish_reason is not None)
        if stop is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop

    def _check_length(self, seq: Sequence, params: SamplingParams) -> None:
        num_tokens, max_tokens = len(seq.token_ids), params.max_tokens
        if (max_tokens is not None and num_tokens - seq.num_prompt_tokens >= max_tokens) or (
            num_tokens >= self.max_model_len
        ):
            seq.finish_reason = "length"

    def text(self, seq: Sequence) -> str:
        """The output's text so far, or all of it once `seq` has ended. The EOS or stop token
        id that ended it is not part of it (as in vLLM), which shows where special tokens are
        kept (`skip_special_tokens` false)."""
        if seq.text is not None:
            return seq.text.text if seq.finish_reason is None else seq.text.final()
        if self.decoding is None:
            return ""
        ids = seq.output_token_ids
        if seq.finish_reason == "stop" and ids and self._ends_by(seq, ids[-1]):
            ids = ids[:-1]
        return self.decoding.decode(ids, seq.request.params.skip_special_tokens)

    def _ends_by(self, seq: Sequence, token: int) -> bool:
        """Whether `token` is the EOS or stop token id that ended `seq`."""
        if seq.finish_reason != "stop" or isinstance(seq.stop_reason, str):
            return False
        if seq.stop_reason is None:
            return token in self.eos_token_ids and not seq.request.params.ignore_eos
        return seq.stop_reason == token

    def request_output(self, request: Request, finished: bool = True) -> RequestOutput:
        """The request's output so far (`finished=False`: a streamed request's), or its last."""
        if finished:
            request.metrics.finished_time = time.monotonic()
        outputs = [
            CompletionOutput(
                index=seq.index,
                text=self.text(seq),
                token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=seq.logprobs,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for seq in sorted(request.seqs, key=lambda s: s.index)
        ]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=PromptLogprobs.output(request),
            outputs=outputs,
            finished=finished,
            num_cached_tokens=request.num_cached_tokens or 0,
            metrics=request.metrics,
        )

    @staticmethod
    def failed_output(request: Request, err: BaseException) -> RequestOutput:
        """The last output of a request the engine gave up on: the tokens it had, no text,
        and why (`error`)."""
        request.metrics.finished_time = time.monotonic()
        outputs = [
            CompletionOutput(
                index=seq.index,
                text="",
                token_ids=seq.output_token_ids,
                cumulative_logprob=None,
                logprobs=None,
                finish_reason="error",
            )
            for seq in sorted(request.seqs, key=lambda s: s.index)
        ]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=None,
            outputs=outputs,
            finished=True,
            num_cached_tokens=request.num_cached_tokens or 0,
            metrics=request.metrics,
            error=RequestFailure.of(err),
        )
