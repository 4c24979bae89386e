"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, never a bare 500."""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.wire_format.errors import (
    DATABASE_UNAVAILABLE,
    INVALID_REQUEST,
    NOT_FOUND,
    error_body,
)

log = logging.getLogger(__name__)

HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = (
            status,
            message,
            code,
            param,
            type,
        )
        self.headers = headers

    @property
    def body(self) -> dict:
        """The error in OpenAI's shape."""
        return _body(self.message, self.type, self.code, self.param)


def not_found(kind: str, object_id: str) -> APIError:
    return APIError(404, f"no {kind} with id {object_id!r}", code=NOT_FOUND)


def _body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict:
    return error_body(message, code, param, type=type)


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body, err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        problems = []
        param = None
        for item in err.errors():
            loc = [str(p) for p in item.get("loc", ()) if p not in ("body", "query", "path")]
            param = param or ".".join(loc) or None
            msg = str(item.get("msg", "invalid")).removeprefix("Value error, ")
            problems.append(f"{'.'.join(loc) or 'request'}: {msg}")
        return JSONResponse(
            _body("; ".join(problems), "invalid_request_error", INVALID_REQUEST, param), 400
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        headers = getattr(err, "headers", None)
        if err.status_code == 405:  # Starlette's names one route's methods: the path's are wanted
            headers = {**(headers or {}), "Allow": ", ".join(_methods_of(request))}
        return JSONResponse(
            _body(_http_message(request, err, headers), "invalid_request_error"),
            err.status_code,
            headers=headers,
        )

    @app.exception_handler(OperationalError)
    async def _database_down(_: Request, err: OperationalError) -> JSONResponse:
        log.warning("the ledger database is unreachable: %s", err.orig or err)
        return JSONResponse(
            _body(
                "the ledger database is unavailable; retry shortly",
                "server_error",
                DATABASE_UNAVAILABLE,
            ),
            503,
            headers={"Retry-After": "5"},
        )

    app.add_middleware(UnexpectedErrors)


def _http_message(
    request: Request, err: StarletteHTTPException, headers: dict[str, str] | None
) -> str:
    """The router's "Not Found" and "Method Not Allowed" in words a client can act on: the
    method and path it sent (as OpenAI's "Invalid URL (POST /v1/...)"), and the methods the
    path takes."""
    sent = f"{request.method} {request.url.path}"
    if err.status_code == 404 and err.detail == "Not Found":
        return f"Invalid URL ({sent}): this server has no such endpoint (/docs lists those it has)"
    if err.status_code == 405 and err.detail == "Method Not Allowed":
        allowed = (headers or {}).get("Allow")
        takes = f": {request.url.path} takes {allowed}" if allowed else ""
        return f"Method not allowed ({sent}){takes}"
    return str(err.detail)


def _methods_of(request: Request) -> list[str]:
    """Every method some route of the app takes at the request's path (a path can be served by
    several routes, one a method: Starlette's 405 names only the first's)."""
    routes = request.app.router.routes
    return [
        method
        for method in HTTP_METHODS
        if any(r.matches({**request.scope, "method": method})[0] == Match.FULL for r in routes)
    ]


class UnexpectedErrors:
    """An exception no handler took becomes a 500 in OpenAI's shape on a connection that stays
    open. (Starlette's ServerErrorMiddleware sends its 500 and then re-raises, and uvicorn
    closes the connection of a request whose app raised: a keep-alive client's next request
    would fail too.) Sits inside ServerErrorMiddleware, which still gets what it cannot answer:
    an exception after the response started."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_noting_start(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_noting_start)
        except Exception as err:
            if started:
                raise
            request_id = f"req_{uuid.uuid4().hex[:24]}"
            log.exception("request %s: unhandled error: %s", request_id, type(err).__name__)
            message = f"internal error (request {request_id}); the service's log has the details"
            response = JSONResponse(
                _body(message, "server_error"), 500, headers={"X-Request-Id": request_id}
            )
            await response(scope, receive, send)
