"""The door of the /v1 routes: who is asking, and how much they may send, are settled from the
request's headers before any byte of its body is read. (FastAPI reads and parses a body before
it solves a route's dependencies, so a key check there came after a whole upload was spooled.)
The body is then counted as it arrives, and a JSON body's nesting is bounded before it is
parsed."""

from __future__ import annotations

import operator
import re
from itertools import accumulate, count

from fastapi.concurrency import run_in_threadpool
from fastapi.routing import APIRoute
from fastapi.security.utils import get_authorization_scheme_param
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from conveyor.api.deps import AppState
from conveyor.api.errors import APIError, not_found
from conveyor.api.params import ID_CHARS
from conveyor.ledger.keys import find_key
from conveyor.ledger.models import DEFAULT_PROJECT
from conveyor.settings import Settings
from conveyor.wire_format.errors import INVALID_API_KEY, INVALID_REQUEST, REQUEST_TOO_LARGE
from conveyor.wire_format.text import unstorable

MAX_JSON_DEPTH = 64


class KeyedRoute(APIRoute):
    """A /v1 route. Before its body is read: the API key is looked up (the project goes to
    `request.state.project`, where `api.deps.get_project` finds it), a path id no row can have
    is a 404 and a declared `Content-Length` over the route's limit is refused; then the body
    is counted as it arrives (Starlette's body limit) and, if it is JSON, its nesting is
    checked before it is parsed."""

    @property
    def reads_body(self) -> bool:
        return self.body_field is not None

    def body_limit(self, settings: Settings) -> int:
        return settings.max_json_body_bytes

    def too_large(self, settings: Settings) -> APIError:
        return APIError(
            413,
            f"the request body is larger than the limit of {settings.max_json_body_bytes} "
            "bytes (CONVEYOR_MAX_JSON_BODY_BYTES)",
            code=REQUEST_TOO_LARGE,
        )

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in self.methods:
            await super().handle(scope, receive, send)  # a 405, as for any route
            return
        state: AppState = scope["app"].state.conveyor
        scope.setdefault("state", {})["project"] = (
            DEFAULT_PROJECT if state.settings.auth == "off" else await authenticate(state, scope)
        )
        for name, value in scope["path_params"].items():
            if unstorable(value, ID_CHARS):  # no row has such an id
                raise not_found(name.removesuffix("_id"), value)
        if not self.reads_body:
            await super().handle(scope, receive, send)
            return
        limit = self.body_limit(state.settings)
        declared = declared_length(scope)
        # refused here, not by the body limit: it answers a declared length over the limit in
        # plain text, past the app's error handlers
        if declared is not None and declared > limit:
            raise self.too_large(state.settings)
        await RequestBodyLimitMiddleware(super().handle, limit)(scope, receive, send)

    def get_route_handler(self):  # noqa: ANN201 (FastAPI's handler type)
        handler = super().get_route_handler()
        reads_json = self.body_field is not None
        too_large = self.too_large

        async def bounded(request: Request) -> Response:
            try:
                if reads_json:
                    check_json_depth(await request.body())
                return await handler(request)
            except HTTPException as err:
                if err.status_code != 413:  # the body limit's own error, in plain words
                    raise
                raise too_large(request.app.state.conveyor.settings) from None

        return bounded


async def authenticate(state: AppState, scope: Scope) -> str:
    """The project of the request's API key; 401 for no key or one that is unknown or
    revoked."""
    authorization = Headers(scope=scope).get("authorization")
    scheme, secret = get_authorization_scheme_param(authorization)
    if scheme.lower() != "bearer" or not secret:
        raise unauthorized(
            "no API key: send it as 'Authorization: Bearer <key>' (create one with "
            "`conveyor keys create --name NAME`)"
        )
    project = await run_in_threadpool(_key_project, state, secret)
    if project is None:
        raise unauthorized("the API key is not valid (unknown or revoked)")
    return project


def _key_project(state: AppState, secret: str) -> str | None:
    with state.ledger.reads() as session:
        key = find_key(session, secret)
        return key.project if key is not None else None


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code=INVALID_API_KEY, headers={"WWW-Authenticate": "Bearer"})


def declared_length(scope: Scope) -> int | None:
    raw = Headers(scope=scope).get("content-length")
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


# A JSON string, or an unterminated one up to the end: it never fails to match once started, so
# a body of many quotes costs one pass, not one pass per quote.
_STRING = re.compile(rb'(?s)"[^"\\]*+(?:\\.?[^"\\]*+)*+(?:"|\Z)')
_STEPS = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def json_depth(body: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest (brackets in strings not counted),
    in C-speed passes: Python's own parser would recurse once per level."""
    steps = _STRING.sub(b"", body).translate(_STEPS, _NOT_BRACKETS)
    # the i-th bracket is 2 when it opens and 0 when it closes: the depth after it is the
    # sum of the steps so far minus i
    return max(map(operator.sub, accumulate(steps), count(1)), default=0)


def check_json_depth(body: bytes) -> None:
    opening = body.count(b"[") + body.count(b"{")
    if opening > MAX_JSON_DEPTH and json_depth(body) > MAX_JSON_DEPTH:
        raise APIError(
            400,
            f"the JSON body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels",
            code=INVALID_REQUEST,
        )
