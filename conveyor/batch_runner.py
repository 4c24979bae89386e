"""Run an OpenAI Batch input file through one engine, writing result lines as requests finish.

The input is read line by line and at most `max_pending` requests are in the engine at once, so
memory stays bounded for large files. Each result or error line is written and flushed as soon
as it is known, so an interrupted run keeps everything written so far. Result lines come in the
order requests finish, not the input order; match them up by `custom_id`.

The engine is duck-typed (`add_request`, `step`, `has_unfinished`, `abort`, `tokenizer`), which
keeps this module free of torch imports until an engine is actually handed in.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO, Any

from conveyor.batch_format.errors import INTERNAL_ERROR, BatchRequestError
from conveyor.batch_format.request_line import BatchLineParser, ParsedRequest, peek_custom_id
from conveyor.batch_format.result_lines import (
    build_output_line,
    dump_line,
    error_line_from_exception,
)
from conveyor.batch_format.token_text import TokenDecoder
from conveyor.engine.errors import InvalidRequestError
from conveyor.engine_request import engine_error, internal_error, prepare_request

log = logging.getLogger(__name__)


@dataclass
class BatchStats:
    lines: int = 0  # non-blank input lines handled
    succeeded: int = 0
    failed: int = 0


class BatchRunner:
    """Feeds batch lines to an engine and writes one output line per input line."""

    def __init__(
        self,
        llm: Any,
        *,
        model_name: str,
        out: IO[str],
        error_out: IO[str] | None = None,
        served_model_names: Iterable[str] | None = None,
        max_pending: int = 1024,
        progress: Any | None = None,
    ) -> None:
        self.llm = llm
        self.model_name = model_name
        self.out = out
        self.error_out = error_out if error_out is not None else out
        self.parser = BatchLineParser(served_model_names)
        self.max_pending = max(1, max_pending)
        self.progress = progress
        self.decoder = TokenDecoder(getattr(llm, "tokenizer", None))
        self.pending: dict[str, ParsedRequest] = {}
        self.stats = BatchStats()

    # ---- output ---------------------------------------------------------------------------
    def _emit(self, obj: dict[str, Any], *, ok: bool) -> None:
        stream = self.out if ok else self.error_out
        stream.write(dump_line(obj) + "\n")
        stream.flush()
        if ok:
            self.stats.succeeded += 1
        else:
            self.stats.failed += 1
        if self.progress is not None:
            self.progress.update(1)
            self.progress.set_postfix(ok=self.stats.succeeded, failed=self.stats.failed)

    def _emit_error(self, err: BatchRequestError) -> None:
        self._emit(error_line_from_exception(err), ok=False)

    # ---- input ----------------------------------------------------------------------------
    def submit(self, lineno: int, raw: bytes | str) -> None:
        """Check one line and hand it to the engine, or write its error line."""
        self.stats.lines += 1
        request_id = f"line-{lineno}"
        try:
            request = self.parser.parse(raw, lineno)
            prompt, params = prepare_request(self.llm, request)
            try:
                self.llm.add_request(request_id, prompt, params)
            except InvalidRequestError as err:
                raise engine_error(err, request, request_id) from None
        except BatchRequestError as err:
            self._emit_error(err)
            return
        except Exception:
            log.exception("request %s: internal error while adding it", request_id)
            with contextlib.suppress(Exception):  # whatever of it the engine kept
                self.llm.abort(request_id)
            self._emit_error(
                BatchRequestError(
                    internal_error(request_id),
                    code=INTERNAL_ERROR,
                    line=lineno,
                    custom_id=peek_custom_id(raw),
                    status_code=500,
                )
            )
            return
        self.pending[request_id] = request

    def finish(self, output: Any) -> None:
        """Write the result line of a finished engine request."""
        request = self.pending.pop(output.request_id, None)
        if request is None:
            return
        if (error := getattr(output, "error", None)) is not None:
            self._emit_error(engine_error(error, request, output.request_id))
            return
        try:
            line = build_output_line(request, output, self.model_name, self.decoder)
        except Exception:
            log.exception(
                "request %s: internal error while formatting its result", output.request_id
            )
            self._emit_internal_error(request, internal_error(output.request_id))
            return
        self._emit(line, ok=True)

    def _emit_internal_error(self, request: ParsedRequest, message: str) -> None:
        self._emit_error(
            BatchRequestError(
                message,
                code=INTERNAL_ERROR,
                line=request.line,
                custom_id=request.custom_id,
                status_code=500,
            )
        )

    # ---- loop -----------------------------------------------------------------------------
    def run(self, lines: Iterable[tuple[int, bytes | str]]) -> BatchStats:
        source = iter(lines)
        exhausted = False
        while True:
            while not exhausted and len(self.pending) < self.max_pending:
                item = next(source, None)
                if item is None:
                    exhausted = True
                    break
                self.submit(*item)
            if self.pending:
                if not self.llm.has_unfinished():
                    self._drop_lost_requests()
                    continue
                for output in self.llm.step():
                    if getattr(output, "finished", True):
                        self.finish(output)
            elif exhausted:
                break
        return self.stats

    def abort_pending(self) -> None:
        for request_id in list(self.pending):
            with contextlib.suppress(Exception):
                self.llm.abort(request_id)

    def _drop_lost_requests(self) -> None:
        """The engine has nothing left but some requests never finished: report them."""
        for request_id, request in list(self.pending.items()):
            del self.pending[request_id]
            self._emit_internal_error(
                request, "the engine dropped this request without finishing it"
            )


__all__ = [
    "BatchRunner",
    "BatchStats",
]
