"""Hostile input at the API's door, against the real servers (PostgreSQL, Redis, the API
process): bodies are refused before they are read when the key is missing or the declared size
is over a limit, and cut off as they arrive otherwise, without the API's memory or disk growing;
ids and parameters the ledger cannot hold are a 4xx; nothing closes a kept-alive connection."""

from __future__ import annotations

import http.client
import json
import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
import uvicorn
from fastapi import FastAPI

from conveyor.api import errors
from conveyor.settings import normalize_database_url, window_seconds
from conveyor.testing import (
    Stack,
    batch_lines,
    create_key,
    download,
    free_port,
    resident_kib,
    upload_file,
    wait_for,
    write_jsonl,
)

MiB = 1024 * 1024
HUGE = 64 * MiB
ERROR_KEYS = {"message", "type", "param", "code"}
CHAT = "/v1/chat/completions"


# ---- helpers ---------------------------------------------------------------------------------


def api_pid(stack: Stack) -> int:
    return stack.procs[0].pid  # the first process a test starts is its API


def new_key(stack: Stack) -> str:
    return create_key(stack.env, "door").secret


def openai_error(r: httpx.Response | dict, status: int, code: str | None = None) -> dict:
    """`r` is `status` in OpenAI's error shape; returns its `error` object."""
    if isinstance(r, httpx.Response):
        assert r.status_code == status, r.text
        body = r.json()
    else:
        assert r["status"] == status, r
        body = json.loads(r["body"])
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


def send_until_answered(api: str, head: str, body: Iterator[bytes], timeout: float = 60) -> dict:
    """Send `head` and then `body`'s chunks on a raw socket, stopping as soon as the server
    answers; returns the answer's status and body and how many body bytes were sent."""
    host, port = api.removeprefix("http://").split(":")
    sent = 0
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head.encode("latin-1"))
        deadline = time.monotonic() + timeout
        for chunk in body:
            if select.select([sock], [], [], 0)[0]:
                break  # the answer is there: stop sending
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
            assert time.monotonic() < deadline, "no answer in time"
        else:  # everything went out: wait for the answer
            select.select([sock], [], [], max(deadline - time.monotonic(), 0))
        answer = _read_answer(sock)
    return {**answer, "sent": sent}


def _read_answer(sock: socket.socket) -> dict:
    data = b""
    while b"\r\n\r\n" not in data:
        got = sock.recv(65536)
        assert got, f"the connection closed without an answer: {data!r}"
        data += got
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    headers = {k.lower(): v for k, v in headers.items()}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        got = sock.recv(65536)
        assert got, "the connection closed in the middle of the answer"
        rest += got
    return {"status": int(lines[0].split()[1]), "headers": headers, "body": rest[:length]}


def zeros(total: int, chunk: int = 64 * 1024) -> Iterator[bytes]:
    block = b"0" * chunk
    for _ in range(total // chunk):
        yield block


def chunked(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """The chunks in HTTP/1.1 chunked transfer coding (the last one is never sent here: the
    body is meant to be refused first)."""
    for data in chunks:
        yield b"%x\r\n%s\r\n" % (len(data), data)


def request_head(api: str, method: str, path: str, headers: dict[str, str]) -> str:
    host = api.removeprefix("http://")
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return "\r\n".join(lines) + "\r\n\r\n"


BOUNDARY = "d00rb0undary"


def multipart_start(purpose: str = "batch", filename: str = "in.jsonl") -> bytes:
    return (
        f"--{BOUNDARY}\r\n"
        f'Content-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'
        f"--{BOUNDARY}\r\n"
        f'Content-Disposition: form-data; name="file"; filename="{filename}"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()


def jsonl_lines(total: int) -> Iterator[bytes]:
    """~`total` bytes of valid JSONL, 64 KiB at a time."""
    line = json.dumps(batch_lines(1)[0]).encode() + b"\n"
    block = line * (64 * 1024 // len(line))
    for _ in range(total // len(block)):
        yield block


def upload_body(total: int) -> Iterator[bytes]:
    yield multipart_start()
    yield from jsonl_lines(total)


def stored_files(data_dir: Path) -> list[Path]:
    files = data_dir / "files"
    return sorted(files.iterdir()) if files.exists() else []


def spooled(pid: int, tmp: Path) -> list[str]:
    """The API's open files in its temp dir (Starlette spools uploads into unnamed ones)."""
    found = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(tmp)):
            found.append(target)
    return found


@pytest.fixture
def door(stack: Stack, tmp_path: Path) -> Stack:
    """The stack with its own temp dir for the API, to see what it spools there."""
    (tmp_path / "api-tmp").mkdir()
    stack.env["TMPDIR"] = str(tmp_path / "api-tmp")
    return stack


# ---- the key before the body -----------------------------------------------------------------


def test_an_unauthenticated_body_is_refused_before_it_is_read(door: Stack, tmp_path: Path):
    door.env["CONVEYOR_AUTH"] = "required"
    api = door.start_api()
    pid, tmp = api_pid(door), tmp_path / "api-tmp"
    httpx.get(f"{api}/healthz")
    before = resident_kib(pid)
    for path, content_type, body in (
        ("/v1/files", f"multipart/form-data; boundary={BOUNDARY}", upload_body(HUGE)),
        ("/v1/batches", "application/json", zeros(HUGE)),
    ):
        head = request_head(
            api, "POST", path, {"Content-Type": content_type, "Content-Length": str(HUGE)}
        )
        answer = send_until_answered(api, head, body)
        openai_error(answer, 401, "invalid_api_key")
        assert answer["sent"] < 16 * MiB, answer["sent"]  # answered long before the end
        assert spooled(pid, tmp) == []
    grown = resident_kib(pid) - before
    assert grown < 8 * 1024, f"the API grew by {grown} KiB"
    assert stored_files(tmp_path / "data") == [] and list(tmp.iterdir()) == []


# ---- size limits as the body arrives ---------------------------------------------------------


def test_an_upload_over_the_limit_is_cut_off_as_it_arrives(door: Stack, tmp_path: Path):
    door.env.update(CONVEYOR_AUTH="required", CONVEYOR_MAX_UPLOAD_BYTES=str(MiB))
    api = door.start_api()
    auth = f"Bearer {new_key(door)}"
    pid, tmp = api_pid(door), tmp_path / "api-tmp"
    httpx.get(f"{api}/healthz")
    before = resident_kib(pid)
    multipart = f"multipart/form-data; boundary={BOUNDARY}"
    # a declared length over the limit: refused before a byte of the body is read
    head = request_head(
        api,
        "POST",
        "/v1/files",
        {"Authorization": auth, "Content-Type": multipart, "Content-Length": str(HUGE)},
    )
    answer = send_until_answered(api, head, iter([]))
    error = openai_error(answer, 413, "file_too_large")
    assert str(MiB) in error["message"] and answer["sent"] == 0
    answer = send_until_answered(api, head, upload_body(HUGE))
    openai_error(answer, 413, "file_too_large")
    assert answer["sent"] < 16 * MiB, answer["sent"]

    # no declared length (chunked): counted as it arrives and cut off past the limit
    head = request_head(
        api,
        "POST",
        "/v1/files",
        {"Authorization": auth, "Content-Type": multipart, "Transfer-Encoding": "chunked"},
    )
    answer = send_until_answered(api, head, chunked(upload_body(HUGE)))
    openai_error(answer, 413, "file_too_large")
    assert answer["sent"] < 16 * MiB, answer["sent"]
    assert spooled(pid, tmp) == []

    grown = resident_kib(pid) - before
    assert grown < 8 * 1024, f"the API grew by {grown} KiB"
    assert stored_files(tmp_path / "data") == [] and list(tmp.iterdir()) == []
    listed = httpx.get(f"{api}/v1/files", headers={"Authorization": auth}).json()
    assert listed["data"] == []


def test_a_chunked_upload_within_the_limit_is_stored_whole(door: Stack, tmp_path: Path):
    door.env["CONVEYOR_MAX_UPLOAD_BYTES"] = str(MiB)
    api = door.start_api()
    lines = b"".join(jsonl_lines(MiB // 2))

    def body() -> Iterator[bytes]:
        yield multipart_start(filename="streamed.jsonl")
        for start in range(0, len(lines), 10_000):  # chunks that split lines
            yield lines[start : start + 10_000]
        yield f"\r\n--{BOUNDARY}--\r\n".encode()

    r = httpx.post(
        f"{api}/v1/files",
        content=body(),
        headers={"content-type": f"multipart/form-data; boundary={BOUNDARY}"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["bytes"] == len(lines) and r.json()["filename"] == "streamed.jsonl"
    content = httpx.get(f"{api}/v1/files/{r.json()['id']}/content")
    assert content.content == lines


def test_an_upload_with_an_unknown_form_field_is_refused(door: Stack, tmp_path: Path):
    api = door.start_api()
    r = httpx.post(
        f"{api}/v1/files",
        files={"file": ("in.jsonl", json.dumps(batch_lines(1)[0]).encode() + b"\n")},
        data={"purpose": "batch", "expires_after[seconds]": "3600"},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "unknown_parameter" and error["param"] == "expires_after[seconds]"
    assert httpx.get(f"{api}/v1/files").json()["data"] == []  # nothing was stored


class KeptAlive:
    """Requests on one HTTP/1.1 connection; each checks the connection is still the first one
    (http.client opens a new one, silently, after the server closed it)."""

    def __init__(self, api: str, headers: dict[str, str] | None = None) -> None:
        host, port = api.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=60)
        self.headers = headers or {}
        self.sock: socket.socket | None = None

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict | None = None
    ) -> dict:
        self.conn.request(method, path, body=body, headers={**self.headers, **(headers or {})})
        response = self.conn.getresponse()
        answer = {
            "status": response.status,
            "body": response.read(),
            "headers": {k.lower(): v for k, v in response.getheaders()},
        }
        assert response.getheader("connection") != "close", (method, path, answer)
        if self.sock is None:
            self.sock = self.conn.sock
        assert self.conn.sock is self.sock, f"{method} {path}: the connection was closed"
        return answer

    def json(self, method: str, path: str, body: bytes, headers: dict | None = None) -> dict:
        return self.request(
            method, path, body, {"Content-Type": "application/json", **(headers or {})}
        )

    def close(self) -> None:
        self.conn.close()


def test_json_bodies_are_bounded_in_size_and_depth(stack: Stack, tmp_path: Path):
    stack.env["CONVEYOR_MAX_JSON_BODY_BYTES"] = str(64 * 1024)
    api = stack.start_api()
    file_id = upload(api, tmp_path)
    client = KeptAlive(api)
    assert client.request("GET", "/v1/batches")["status"] == 200

    big = json.dumps({"input_file_id": file_id, "endpoint": CHAT, "x": "y" * 100_000})
    error = openai_error(client.json("POST", "/v1/batches", big.encode()), 413, "request_too_large")
    assert "65536" in error["message"] and "CONVEYOR_MAX_JSON_BODY_BYTES" in error["message"]
    # the same without a declared length: counted as it arrives
    r = httpx.post(
        f"{api}/v1/batches",
        content=iter([big[i : i + 8192].encode() for i in range(0, len(big), 8192)]),
        headers={"content-type": "application/json"},
    )
    openai_error(r, 413, "request_too_large")

    for nested in ("[" * 5000 + "]" * 5000, '{"a":' * 5000 + "1" + "}" * 5000):
        body = f'{{"input_file_id": "{file_id}", "endpoint": "{CHAT}", "metadata": {nested}}}'
        error = openai_error(client.json("POST", "/v1/batches", body.encode()), 400)
        assert "deeper than 64" in error["message"]
    # 64 levels are fine (and wrong for metadata, which is why this is a plain 400)
    body = (
        f'{{"input_file_id": "{file_id}", "endpoint": "{CHAT}", "metadata": {"[" * 63}{"]" * 63}}}'
    )
    assert (
        openai_error(client.json("POST", "/v1/batches", body.encode()), 400)["param"] == "metadata"
    )
    # brackets in strings are not nesting
    body = json.dumps({"input_file_id": file_id, "endpoint": CHAT, "metadata": {"k": "[" * 500}})
    assert client.json("POST", "/v1/batches", body.encode())["status"] == 200

    created = client.json(
        "POST", "/v1/batches", json.dumps({"input_file_id": file_id, "endpoint": CHAT}).encode()
    )
    assert created["status"] == 200, created
    client.close()


def upload(api: str, tmp_path: Path, headers: dict[str, str] | None = None, lines: int = 2) -> str:
    return upload_file(api, write_jsonl(tmp_path / "in.jsonl", batch_lines(lines)), headers)


def test_ids_and_parameters_the_ledger_cannot_hold_are_4xx(door: Stack, tmp_path: Path):
    door.env["CONVEYOR_AUTH"] = "required"
    api = door.start_api()
    auth = {"Authorization": f"Bearer {new_key(door)}"}
    file_id = upload(api, tmp_path, auth)
    client = KeptAlive(api, auth)

    def answer(method: str, path: str, body: bytes | None = None, **headers: str) -> dict:
        got = client.request(method, path, body, headers)
        assert 400 <= got["status"] < 500, (method, path, got)
        return json.loads(got["body"])["error"]

    for method, path, kind in (
        ("GET", "/v1/batches/batch_a%00b", "batch"),
        ("POST", "/v1/batches/batch_a%00b/cancel", "batch"),
        ("GET", "/v1/batches/batch_a%00b/results", "batch"),
        ("GET", "/v1/files/file-a%00b", "file"),
        ("GET", "/v1/files/file-a%00b/content", "file"),
        ("DELETE", "/v1/files/file-a%00b", "file"),
        ("GET", f"/v1/files/{'f' * 65}", "file"),
        ("GET", "/v1/batches/%ED%B2%80", "batch"),
    ):
        error = answer(method, path)
        assert error["code"] == "not_found" and f"no {kind}" in error["message"], (path, error)

    batch = json.loads(
        client.json(
            "POST",
            "/v1/batches",
            json.dumps({"input_file_id": file_id, "endpoint": CHAT}).encode(),
            {"Content-Type": "application/json"},
        )["body"]
    )
    for path, param in (
        ("/v1/batches?after=batch_a%00b", "after"),
        ("/v1/batches?idempotency_key=k%00", "idempotency_key"),
        (f"/v1/batches?after={'b' * 65}", "after"),
        ("/v1/files?after=file-%00", "after"),
        ("/v1/files?purpose=batch%00", "purpose"),
        (f"/v1/batches/{batch['id']}/results?after=x%00", "after"),
    ):
        assert answer("GET", path)["param"] == param, path
    too_long = {"Idempotency-Key": "k" * 256, "Content-Type": "application/json"}
    create = json.dumps({"input_file_id": file_id, "endpoint": CHAT}).encode()
    assert "idempotency-key" in answer("POST", "/v1/batches", create, **too_long)["param"]

    for input_file_id in ("file-a\x00b", "f" * 65):
        body = json.dumps({"input_file_id": input_file_id, "endpoint": CHAT}).encode()
        error = answer("POST", "/v1/batches", body, **{"Content-Type": "application/json"})
        assert error["param"] == "input_file_id", error
    # lone surrogates, which only JSON escapes can make
    for fields in (
        {"input_file_id": "file-SURROGATE", "endpoint": CHAT},
        {"input_file_id": file_id, "endpoint": CHAT, "metadata": {"SURROGATE": "v"}},
    ):
        body = json.dumps(fields).replace("SURROGATE", "\\ud800").encode()
        error = answer("POST", "/v1/batches", body, **{"Content-Type": "application/json"})
        assert error["param"] in ("input_file_id", "metadata"), error

    # an upload's purpose and file name
    def form(purpose: str, filename: str = "in.jsonl") -> bytes:
        return multipart_start(purpose, filename) + b"{}\n" + f"\r\n--{BOUNDARY}--\r\n".encode()

    multipart = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    assert answer("POST", "/v1/files", form("batch\x00"), **multipart)["param"] == "purpose"
    assert answer("POST", "/v1/files", form("batch", "a\x00.jsonl"), **multipart)["param"] == "file"
    assert answer("POST", "/v1/files", form("b" * 10_000), **multipart)["param"] == "purpose"

    assert client.request("GET", "/v1/batches")["status"] == 200  # still the same connection
    client.close()

    # a NUL in a header value: the HTTP server refuses the request itself (400) and, not
    # knowing where it ends, closes the connection; the API never sees it
    head = request_head(api, "GET", "/v1/batches", {**auth, "Idempotency-Key": "a\x00b"})
    assert send_until_answered(api, head, iter([]))["status"] == 400
    assert httpx.get(f"{api}/v1/batches", headers=auth).status_code == 200


def test_an_unexpected_error_is_a_500_that_keeps_the_connection(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """On uvicorn, as the API runs: an exception no handler takes is a 500 in OpenAI's shape,
    and the client's next request on the same connection is answered."""
    app = FastAPI()
    errors.install(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("no handler for this")

    @app.get("/fine")
    async def fine() -> dict:
        return {"ok": True}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        client = KeptAlive(f"http://127.0.0.1:{port}")
        for _ in range(2):
            got = client.request("GET", "/boom")
            assert got["status"] == 500
            error = json.loads(got["body"])["error"]
            # no internals: the id of the request, which the log line with them carries
            request_id = got["headers"]["x-request-id"]
            assert error == {
                "message": f"internal error (request {request_id}); the service's log has "
                "the details",
                "type": "server_error",
                "param": None,
                "code": None,
            }
            assert b"RuntimeError" not in got["body"] and b"no handler" not in got["body"]
            logged = [r for r in caplog.records if request_id in r.getMessage()]
            assert logged and logged[0].exc_info is not None
            assert client.request("GET", "/fine")["status"] == 200
        client.close()
    finally:
        server.should_exit = True
        thread.join(10)


# ---- the in-flight limit -----------------------------------------------------------------------


def racing_creates(api: str, file_id: str, n: int) -> list[int]:
    body = {"input_file_id": file_id, "endpoint": CHAT}
    start = threading.Barrier(n)

    def create(_: int) -> int:
        start.wait()
        return httpx.post(f"{api}/v1/batches", json=body, timeout=120).status_code

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(create, range(n)))


def test_the_in_flight_limit_holds_under_concurrent_creates(stack: Stack, tmp_path: Path):
    stack.env["CONVEYOR_MAX_BATCHES_IN_FLIGHT"] = "5"
    api = stack.start_api()
    # a file whose validation takes a while, the gap a create without the lock raced through
    statuses = racing_creates(api, upload(api, tmp_path, lines=1000), 30)
    assert sorted(statuses) == [200] * 5 + [429] * 25, statuses
    batches = httpx.get(f"{api}/v1/batches", params={"limit": 100}).json()["data"]
    assert len(batches) == 5 and {b["status"] for b in batches} == {"in_progress"}


def test_the_in_flight_limit_holds_on_the_embedded_ledger(stack: Stack, tmp_path: Path):
    """The same on SQLite (no DATABASE_URL, no REDIS_URL), without its in-process worker."""
    env = {k: v for k, v in stack.env.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(CONVEYOR_DATA_DIR=str(tmp_path / "embedded"), CONVEYOR_MAX_BATCHES_IN_FLIGHT="5")
    embedded = Stack(env=env, root=tmp_path)
    try:
        api = embedded.start_api("--no-worker")
        statuses = racing_creates(api, upload(api, tmp_path, lines=1000), 30)
        assert sorted(statuses) == [200] * 5 + [429] * 25, statuses
    finally:
        embedded.stop()


# ---- idempotency keys --------------------------------------------------------------------------


def test_an_idempotency_key_reused_for_another_request_is_a_conflict(stack: Stack, tmp_path):
    api = stack.start_api()
    first_file, second_file = upload(api, tmp_path), upload(api, tmp_path)
    body = {"input_file_id": first_file, "endpoint": CHAT, "metadata": {"run": "1"}}

    def create(key: str, **change) -> httpx.Response:
        headers = {"Idempotency-Key": key}
        return httpx.post(f"{api}/v1/batches", json={**body, **change}, headers=headers)

    first = create("nightly")
    assert first.status_code == 200, first.text
    again = create("nightly", completion_window="24h")  # the default, said out loud
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]

    for change, params in (
        ({"input_file_id": second_file}, ["input_file_id"]),
        ({"endpoint": "/v1/completions"}, ["endpoint"]),
        ({"completion_window": "48h"}, ["completion_window"]),
        ({"metadata": {"run": "2"}}, ["metadata"]),
        ({"metadata": None}, ["metadata"]),
        ({"input_file_id": second_file, "metadata": None}, ["input_file_id", "metadata"]),
    ):
        error = openai_error(create("nightly", **change), 409, "idempotency_key_reused")
        assert error["param"] == params[0], (change, error)
        assert all(p in error["message"] for p in params), (change, error)
        assert first.json()["id"] in error["message"]
    assert len(httpx.get(f"{api}/v1/batches").json()["data"]) == 1


# ---- the completion window ---------------------------------------------------------------------


def test_the_completion_window_is_capped(stack: Stack, tmp_path: Path):
    stack.env["CONVEYOR_MAX_COMPLETION_WINDOW"] = "48h"
    api = stack.start_api()
    file_id = upload(api, tmp_path)

    def create(window: str) -> httpx.Response:
        body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": window}
        return httpx.post(f"{api}/v1/batches", json=body)

    for window in ("49h", "172801s", "999999999999h"):
        error = openai_error(create(window), 400)
        assert error["param"] == "completion_window" and error["code"] == "invalid_request", error
        assert "48h" in error["message"] and "CONVEYOR_MAX_COMPLETION_WINDOW" in error["message"]
    for window in ("48h", "172800s", "24h"):
        r = create(window)
        assert r.status_code == 200, r.text
        assert r.json()["expires_at"] - r.json()["created_at"] in range(
            window_seconds(window) - 2, window_seconds(window) + 3
        )


# ---- deleting files ----------------------------------------------------------------------------


def test_deleting_a_batchs_files_erases_what_they_hold(
    stack: Stack, tmp_path: Path, database_url: str
):
    api = stack.start_api()
    stack.start_worker("w1", "echo", served="")
    lines = batch_lines(3, model="echo")
    lines[1]["body"]["temperature"] = -1  # fails alone: a line in the error file
    file_id = upload_file(api, write_jsonl(tmp_path / "in.jsonl", lines))
    body = {"input_file_id": file_id, "endpoint": CHAT}
    batch = wait_for(api, httpx.post(f"{api}/v1/batches", json=body).json()["id"], timeout=120)
    assert batch["status"] == "completed", batch

    def results() -> list[str]:
        r = httpx.get(f"{api}/v1/batches/{batch['id']}/results")
        assert r.status_code == 200, r.text
        return sorted(json.loads(line)["custom_id"] for line in r.text.splitlines())

    assert [x["custom_id"] for x in download(api, batch["output_file_id"])] == ["q-0", "q-2"]
    assert [x["custom_id"] for x in download(api, batch["error_file_id"])] == ["q-1"]
    assert results() == ["q-0", "q-1", "q-2"]

    assert httpx.delete(f"{api}/v1/files/{batch['output_file_id']}").status_code == 200
    openai_error(httpx.get(f"{api}/v1/files/{batch['output_file_id']}/content"), 404)
    assert results() == ["q-1"]  # the error lines stay until the error file goes
    assert [x["custom_id"] for x in download(api, batch["error_file_id"])] == ["q-1"]
    assert httpx.delete(f"{api}/v1/files/{batch['error_file_id']}").status_code == 200
    assert results() == []
    # the batch itself still tells what happened
    got = httpx.get(f"{api}/v1/batches/{batch['id']}").json()
    assert got["request_counts"] == {"total": 3, "completed": 2, "failed": 1, "reused": 0}

    # the input file: its finished batch's copies of the lines go, a running batch keeps its
    stack.kill("w1")
    running = httpx.post(f"{api}/v1/batches", json=body).json()
    assert running["status"] == "in_progress", running
    assert httpx.delete(f"{api}/v1/files/{file_id}").status_code == 200
    engine = sa.create_engine(normalize_database_url(database_url))
    with engine.connect() as conn:
        raw = dict(
            conn.execute(
                sa.text(
                    "SELECT batch_id, string_agg(raw, '') FROM requests WHERE batch_id IN "
                    "(:done, :running) GROUP BY batch_id"
                ),
                {"done": batch["id"], "running": running["id"]},
            ).all()
        )
    engine.dispose()
    assert raw[batch["id"]] == ""
    assert "question number 0" in raw[running["id"]]
