"""Bad input through the real REST API: every mistake gets its documented answer, never a 5xx.

Most tests share one API process on one fresh database (starting it per test would cost more
than the tests); a test that needs an empty ledger (listing, pagination) uses `stack`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conveyor.settings import normalize_database_url
from conveyor.testing import Stack, batch_lines, databases, service_env, write_jsonl

CHAT = "/v1/chat/completions"
ERROR_KEYS = {"message", "type", "param", "code"}


# ---- one API for the module ------------------------------------------------------------------


@pytest.fixture(scope="module")
def api(
    postgres_server: str,
    redis_server: str,
    template_database: str,
    tmp_path_factory,
    redis_databases,
) -> Iterator[str]:
    root = tmp_path_factory.mktemp("api-validation")
    redis_url = redis_databases.url(redis_server, hold=True)
    with databases.scratch_database(postgres_server, "conveyor_t_", template_database) as url:
        env = service_env(normalize_database_url(url), redis_url, root)
        stack = Stack(env=env, root=root)
        try:
            yield stack.start_api()
        finally:
            stack.stop()


# ---- helpers ---------------------------------------------------------------------------------


def no_5xx(r: httpx.Response) -> httpx.Response:
    assert r.status_code < 500, f"{r.request.method} {r.request.url}: {r.status_code} {r.text}"
    return r


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    """The response is `status` with OpenAI's error shape; returns its `error` object."""
    no_5xx(r)
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == ERROR_KEYS, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code, error
    return error


def upload_bytes(api: str, data: bytes, name: str = "in.jsonl", purpose: str = "batch"):
    return no_5xx(
        httpx.post(
            f"{api}/v1/files",
            files={"file": (name, data, "application/jsonl")},
            data={"purpose": purpose},
            timeout=120,
        )
    )


def upload(api: str, lines: list, name: str = "in.jsonl") -> str:
    """Upload JSONL lines (dicts, or raw strings written as they are); returns the file id."""
    text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    r = upload_bytes(api, text.encode(), name)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def create_batch(api: str, file_id: str, endpoint: str = CHAT, **extra) -> httpx.Response:
    body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h", **extra}
    return no_5xx(httpx.post(f"{api}/v1/batches", json=body, timeout=120))


def batch_from(api: str, lines: list, endpoint: str = CHAT) -> dict:
    r = create_batch(api, upload(api, lines), endpoint)
    assert r.status_code == 200, r.text
    batch = r.json()
    # what the API answered is what it stored
    stored = no_5xx(httpx.get(f"{api}/v1/batches/{batch['id']}", timeout=30)).json()
    assert stored == batch
    return batch


def failed_errors(batch: dict) -> list[tuple[str, int | None]]:
    """A failed batch's listed errors as (code, line), in file order."""
    assert batch["status"] == "failed", batch
    assert batch["failed_at"] is not None
    assert batch["in_progress_at"] is None
    assert batch["output_file_id"] is None and batch["error_file_id"] is None
    assert batch["errors"]["object"] == "list"
    errors = batch["errors"]["data"]
    for e in errors:
        assert e["message"], e
    return [(e["code"], e["line"]) for e in errors]


def results(api: str, batch_id: str) -> list[dict]:
    r = no_5xx(httpx.get(f"{api}/v1/batches/{batch_id}/results", timeout=30))
    assert r.status_code == 200, r.text
    return [json.loads(x) for x in r.text.splitlines() if x.strip()]


def chat(custom_id: str, model: str = "tiny", **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {
            "model": model,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": f"hello {custom_id}"}],
            **body,
        },
    }


# ---- lines that fail the whole batch ---------------------------------------------------------


def test_line_not_json(api: str):
    lines = [chat("a"), chat("b"), '{"custom_id": "c", "method": "POST",', chat("d")]
    batch = batch_from(api, lines)
    assert failed_errors(batch) == [("invalid_json", 3)]
    assert batch["request_counts"] == {"total": 0, "completed": 0, "failed": 0, "reused": 0}


def test_line_that_is_json_but_not_an_object(api: str):
    batch = batch_from(api, [chat("a"), "[1, 2, 3]", '"just a string"'])
    assert failed_errors(batch) == [("invalid_json", 2), ("invalid_json", 3)]


def test_line_not_utf8(api: str):
    data = json.dumps(chat("a")).encode() + b"\n" + b'{"custom_id": "\xff\xfe"}\n'
    r = create_batch(api, upload_bytes(api, data).json()["id"])
    assert r.status_code == 200, r.text
    assert failed_errors(r.json()) == [("invalid_json", 2)]


def test_duplicate_custom_id(api: str):
    batch = batch_from(api, [chat("a"), chat("b"), chat("c"), chat("b")])
    assert failed_errors(batch) == [("duplicate_custom_id", 4)]
    assert "line 2" in batch["errors"]["data"][0]["message"]  # where it was first used
    assert batch["errors"]["data"][0]["param"] == "custom_id"


@pytest.mark.parametrize(
    ("first", "second"),
    [({}, {"temperature": -1}), ({"top_p": 2}, {"temperature": -1}), ({"top_p": 2}, {})],
    ids=["repeat-bad", "both-bad", "first-bad"],
)
def test_duplicate_custom_id_on_lines_with_bad_values(api: str, first: dict, second: dict):
    """A repeated custom_id fails the batch even when a line is also wrong in a way that alone
    would only fail that line: otherwise one custom_id gets two results."""
    batch = batch_from(api, [chat("a", **first), chat("b"), chat("a", **second)])
    assert failed_errors(batch) == [("duplicate_custom_id", 3)]
    assert "line 1" in batch["errors"]["data"][0]["message"]


def test_missing_or_empty_custom_id(api: str):
    no_id = chat("x")
    del no_id["custom_id"]
    batch = batch_from(api, [chat("a"), no_id, chat(""), {**chat("y"), "custom_id": 7}])
    errors = batch["errors"]["data"]
    assert [(e["line"], e["param"]) for e in errors] == [
        (2, "custom_id"),
        (3, "custom_id"),
        (4, "custom_id"),
    ]
    assert batch["status"] == "failed"


def test_unknown_url(api: str):
    bad = {**chat("b"), "url": "/v1/embeddings"}
    batch = batch_from(api, [chat("a"), bad])
    assert failed_errors(batch) == [("invalid_url", 2)]
    assert batch["errors"]["data"][0]["param"] == "url"


def test_missing_url_and_method(api: str):
    no_url, no_method = chat("b"), chat("c")
    del no_url["url"], no_method["method"]
    batch = batch_from(api, [chat("a"), no_url, no_method])
    assert failed_errors(batch) == [("invalid_url", 2), ("invalid_method", 3)]


def test_wrong_method(api: str):
    batch = batch_from(api, [chat("a"), chat("b"), {**chat("c"), "method": "GET"}])
    assert failed_errors(batch) == [("invalid_method", 3)]
    assert batch["errors"]["data"][0]["param"] == "method"


def test_missing_body(api: str):
    no_body = chat("b")
    del no_body["body"]
    batch = batch_from(api, [chat("a"), no_body, {**chat("c"), "body": "text"}])
    errors = batch["errors"]["data"]
    assert batch["status"] == "failed"
    assert [(e["line"], e["param"]) for e in errors] == [(2, "body"), (3, "body")]


def test_missing_body_model(api: str):
    no_model = chat("b")
    del no_model["body"]["model"]
    batch = batch_from(api, [chat("a"), no_model])
    errors = batch["errors"]["data"]
    assert batch["status"] == "failed"
    assert [(e["line"], e["param"]) for e in errors] == [(2, "body.model")]


def test_url_other_than_the_batch_endpoint(api: str):
    completion = {
        "custom_id": "c",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "tiny", "prompt": "hello", "max_tokens": 4},
    }
    batch = batch_from(api, [chat("a"), chat("b"), completion])
    assert failed_errors(batch) == [("invalid_url", 3)]
    assert batch["errors"]["data"][0]["param"] == "url"

    # the other way round: a chat line in a completions batch
    batch = batch_from(api, [completion, chat("a")], endpoint="/v1/completions")
    assert failed_errors(batch) == [("invalid_url", 2)]


def test_url_other_than_the_batch_endpoint_on_a_line_with_bad_values(api: str):
    """The wrong url fails the batch even if the line's body also holds a bad value."""
    completion = {
        "custom_id": "c",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": -1},
    }
    batch = batch_from(api, [chat("a"), completion])
    assert failed_errors(batch) == [("invalid_url", 2)]


def test_mismatched_model(api: str):
    batch = batch_from(api, [chat("a"), chat("b"), chat("c", model="other"), chat("d")])
    assert failed_errors(batch) == [("mismatched_model", 3)]
    assert batch["errors"]["data"][0]["param"] == "body.model"


def test_empty_upload_is_rejected(api: str):
    assert assert_error(upload_bytes(api, b""), 400, "empty_file")["param"] == "file"


def test_file_of_blank_lines(api: str):
    r = upload_bytes(api, b"\n\n   \n\t\n")
    assert r.status_code == 200, r.text
    assert r.json()["bytes"] == 8
    r = create_batch(api, r.json()["id"])
    assert r.status_code == 200, r.text
    assert failed_errors(r.json()) == [("empty_file", None)]


def test_a_byte_order_mark_opening_the_file_is_read_past(api: str):
    """A file as Windows tools write it (a UTF-8 mark first, CRLF line ends) makes the batch
    the same file without them makes; its first line is read from where the mark ends."""
    lines = [chat("a", temperature=-1), chat("b")]
    text = "".join(json.dumps(line) + "\r\n" for line in lines)
    r = upload_bytes(api, b"\xef\xbb\xbf" + text.encode())
    assert r.status_code == 200, r.text
    r = create_batch(api, r.json()["id"])
    assert r.status_code == 200, r.text
    batch = r.json()
    assert batch["status"] == "in_progress" and batch["errors"] is None, batch
    assert batch["request_counts"] == {"total": 2, "completed": 0, "failed": 1, "reused": 0}
    [error] = results(api, batch["id"])
    assert (error["custom_id"], error["error"]["line"]) == ("a", 1)
    assert error["error"]["param"] == "body.temperature"


def test_blank_lines_count_in_line_numbers(api: str):
    batch = batch_from(api, [chat("a"), "", "   ", "not json"])
    assert failed_errors(batch) == [("invalid_json", 4)]


def test_line_of_10_mb(api: str, tmp_path: Path):
    """A 10 MB line is over the default 8 MiB limit: the upload is refused (413) naming that
    line, before any batch can start from it, and nothing is stored."""
    big = chat("big")
    big["body"]["messages"][0]["content"] = "x" * (10 * 1024 * 1024)
    path = write_jsonl(
        tmp_path / "big.jsonl", [chat("a"), chat("b"), big, chat("c"), chat("d"), chat("e")]
    )
    assert path.stat().st_size > 10 * 1024 * 1024
    with open(path, "rb") as f:
        r = no_5xx(httpx.post(f"{api}/v1/files", files={"file": f}, data={"purpose": "batch"}))
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == "line_too_large" and error["param"] == "file"
    assert "line 3 " in error["message"] and str(8 * 1024 * 1024) in error["message"]
    stored = httpx.get(f"{api}/v1/files").json()["data"]
    assert not any(f["filename"] == "big.jsonl" for f in stored)


def test_several_errors_are_all_listed(api: str):
    no_body = chat("f")
    del no_body["body"]
    lines = [
        chat("a"),  # 1 ok
        "{nope",  # 2
        chat("a"),  # 3 duplicate
        {**chat("c"), "url": "/v1/embeddings"},  # 4
        {**chat("d"), "method": "PUT"},  # 5
        chat("e", temperature=5),  # 6: a line-level error, not listed
        no_body,  # 7
        chat("g", model="other"),  # 8
        chat("h"),  # 9 ok
    ]
    batch = batch_from(api, lines)
    errors = batch["errors"]["data"]
    assert [(e["code"], e["line"]) for e in errors] == [
        ("invalid_json", 2),
        ("duplicate_custom_id", 3),
        ("invalid_url", 4),
        ("invalid_method", 5),
        ("invalid_request", 7),
        ("mismatched_model", 8),
    ]
    failed_errors(batch)


# ---- lines that fail alone -------------------------------------------------------------------


def test_bad_sampling_values_fail_only_their_line(api: str):
    lines = batch_lines(6)
    lines[1]["body"]["temperature"] = -1
    lines[4]["body"]["top_p"] = 2
    lines[5]["body"]["temperature"] = "hot"
    batch = batch_from(api, lines)
    assert batch["status"] == "in_progress", batch
    assert batch["errors"] is None
    assert batch["in_progress_at"] is not None and batch["expires_at"] is not None
    assert batch["request_counts"] == {"total": 6, "completed": 0, "failed": 3, "reused": 0}
    assert batch["model"] == "tiny"

    errors = {e["custom_id"]: e for e in results(api, batch["id"])}
    assert set(errors) == {"q-1", "q-4", "q-5"}
    expected = {"q-1": (2, "body.temperature"), "q-4": (5, "body.top_p"), "q-5": (6, None)}
    for custom_id, (line, param) in expected.items():
        e = errors[custom_id]
        assert e["error"]["line"] == line
        assert e["error"]["code"] == "invalid_request"
        assert f"line {line}" in e["error"]["message"]
        assert e["response"]["status_code"] == 400
        assert e["response"]["body"]["error"]["code"] == "invalid_request"
        if param:
            assert e["error"]["param"] == param
    assert errors["q-5"]["error"]["param"] == "body.temperature"


def test_every_line_failing_alone_completes_the_batch(api: str):
    """With no runnable line left the batch finishes at once, with only an error file."""
    batch = batch_from(api, [chat("a", temperature=-1), chat("b", top_p=2)])
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 2, "completed": 0, "failed": 2, "reused": 0}
    assert batch["output_file_id"] is None
    r = no_5xx(httpx.get(f"{api}/v1/files/{batch['error_file_id']}/content"))
    assert r.status_code == 200, r.text
    errors = [json.loads(x) for x in r.text.splitlines()]
    assert sorted((e["custom_id"], e["error"]["line"]) for e in errors) == [("a", 1), ("b", 2)]


# ---- values the database cannot hold must not become 500s ------------------------------------


@pytest.mark.parametrize(
    ("custom_id", "why"),
    [("x" * 513, "longer than 512"), ("b\u0000c", "NUL"), ("\ud800", "surrogate")],
    ids=["long", "nul", "surrogate"],
)
def test_custom_id_the_ledger_cannot_hold(api: str, custom_id: str, why: str):
    batch = batch_from(api, [chat("a"), chat(custom_id), chat("b")])
    assert failed_errors(batch) == [("invalid_request", 2)]
    assert batch["errors"]["data"][0]["param"] == "custom_id"
    assert why in batch["errors"]["data"][0]["message"]
    # 512 characters is fine
    assert batch_from(api, [chat("a"), chat("y" * 512)])["status"] == "in_progress"


@pytest.mark.parametrize(
    ("model", "why"),
    [("m" * 513, "longer than 512"), ("m\u0000", "NUL"), ("m\udfff", "surrogate")],
    ids=["long", "nul", "surrogate"],
)
def test_model_the_ledger_cannot_hold(api: str, model: str, why: str):
    batch = batch_from(api, [chat("a", model=model), chat("b", model=model)])
    assert failed_errors(batch) == [("invalid_request", 1), ("invalid_request", 2)]
    assert batch["errors"]["data"][0]["param"] == "body.model"
    assert why in batch["errors"]["data"][0]["message"]


def test_bad_value_with_a_lone_surrogate(api: str):
    """A line-level error whose message quotes a lone surrogate is still recorded."""
    batch = batch_from(api, [chat("a"), chat("b", temperature="\ud800"), chat("c", stop=7)])
    assert batch["status"] == "in_progress", batch
    errors = {e["custom_id"]: e["error"] for e in results(api, batch["id"])}
    assert {k: (v["line"], v["param"]) for k, v in errors.items()} == {
        "b": (2, "body.temperature"),
        "c": (3, "body.stop"),
    }


def test_text_with_a_lone_surrogate_fails_alone(api: str):
    """Text no tokenizer or database can take is refused at the door: the line gets its error,
    naming the field, and the rest of the batch runs."""
    deep: list = []
    for _ in range(70):
        deep = [deep]
    lines = [chat("a"), chat("b"), chat("c", user=deep), chat("d")]
    lines[1]["body"]["messages"][0]["content"] = "\ud800"
    batch = batch_from(api, lines)
    assert batch["status"] == "in_progress", batch
    assert batch["request_counts"] == {"total": 4, "completed": 0, "failed": 2, "reused": 0}
    errors = {e["custom_id"]: e for e in results(api, batch["id"])}
    assert set(errors) == {"b", "c"}
    b, c = errors["b"], errors["c"]
    assert (b["error"]["code"], b["error"]["param"], b["error"]["line"]) == (
        "invalid_unicode",
        "body.messages[0].content",
        2,
    )
    assert b["response"]["status_code"] == 400 and "\\ud800" in b["error"]["message"]
    assert (c["error"]["code"], c["error"]["line"]) == ("invalid_request", 3)
    assert c["error"]["param"].startswith("body.user[0]")
    assert "deeper than 64 levels" in c["error"]["message"]


def test_mistake_with_a_lone_surrogate_fails_the_batch(api: str):
    """A batch-fatal message that quotes a lone surrogate is stored in `errors`."""
    batch = batch_from(api, [chat("a"), {**chat("b"), "method": "\udc80"}])
    assert failed_errors(batch) == [("invalid_method", 2)]


def test_long_filename(api: str):
    data = json.dumps(chat("a")).encode() + b"\n"
    error = assert_error(upload_bytes(api, data, name="f" * 507 + ".jsonl"), 400)
    assert error["param"] == "file"
    r = upload_bytes(api, data, name="f" * 506 + ".jsonl")  # 512 characters
    assert r.status_code == 200, r.text
    assert no_5xx(httpx.get(f"{api}/v1/files/{r.json()['id']}")).json() == r.json()


def test_filename_with_nul(api: str):
    boundary = "b0undary"
    body = (
        f"--{boundary}\r\n"
        'Content-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f"--{boundary}\r\n"
        'Content-Disposition: form-data; name="file"; filename="a\x00b.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
        f"{json.dumps(chat('a'))}\n\r\n"
        f"--{boundary}--\r\n"
    ).encode()
    r = httpx.post(
        f"{api}/v1/files",
        content=body,
        headers={"content-type": f"multipart/form-data; boundary={boundary}"},
    )
    assert assert_error(r, 400)["param"] == "file"


def test_metadata_round_trip(api: str):
    metadata = {"owner": "team-\u00e9", "nul": "a\u0000b", "k" * 64: "v" * 512}
    r = create_batch(api, upload(api, [chat("a")]), metadata=metadata)
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == metadata
    got = no_5xx(httpx.get(f"{api}/v1/batches/{r.json()['id']}")).json()
    assert got["metadata"] == metadata


def post_raw_json(api: str, body: dict) -> httpx.Response:
    """POST `body` with each "SURROGATE" in it written as the JSON escape of a lone surrogate
    (a valid JSON text that httpx, encoding str to UTF-8, cannot send)."""
    text = json.dumps(body).replace("SURROGATE", "\\udc80")
    return no_5xx(
        httpx.post(f"{api}/v1/batches", content=text, headers={"content-type": "application/json"})
    )


def test_lone_surrogates_in_a_create_request(api: str):
    file_id = upload(api, [chat("a")])
    for metadata in ({"k": "SURROGATE"}, {"SURROGATE": "v"}):
        r = post_raw_json(api, {"input_file_id": file_id, "endpoint": CHAT, "metadata": metadata})
        assert assert_error(r, 400, "invalid_request")["param"] == "metadata"
    r = post_raw_json(api, {"input_file_id": "file-SURROGATE", "endpoint": CHAT})
    assert assert_error(r, 400, "invalid_request")["param"] == "input_file_id"
    # ids that are not valid UTF-8 in a URL are just unknown
    assert_error(no_5xx(httpx.get(f"{api}/v1/batches/%ED%B2%80")), 404, "not_found")
    assert_error(no_5xx(httpx.get(f"{api}/v1/files/%ED%B2%80")), 404, "not_found")
    # and nothing stored by the requests above breaks the listing
    assert no_5xx(httpx.get(f"{api}/v1/batches?after=%ED%B2%80")).status_code == 200
    assert no_5xx(httpx.get(f"{api}/v1/batches", params={"limit": 100})).status_code == 200


def test_a_field_batch_creation_does_not_know_is_refused_by_name(api: str):
    """As the online endpoints refuse unknown fields: `extra_body={"reuse": "bogus"}` must not
    be dropped in silence."""
    file_id = upload(api, [chat("a")])
    for field in ("output_expires_after", "endpiont"):
        r = create_batch(api, file_id, **{field: "bogus"})
        error = assert_error(r, 400, "invalid_request")
        assert error["param"] == field and "not permitted" in error["message"], error
    # a reuse mode other than the documented one names the one there is
    error = assert_error(create_batch(api, file_id, reuse="bogus"), 400, "invalid_request")
    assert error["param"] == "reuse" and "'exact'" in error["message"], error


def test_completion_window_too_long_for_the_ledger(api: str):
    r = create_batch(api, upload(api, [chat("a")]), completion_window="1" + "0" * 20 + "h")
    assert assert_error(r, 400, "invalid_request")["param"] == "completion_window"


# ---- API-level errors ------------------------------------------------------------------------


def test_unknown_ids_are_404_in_openai_shape(api: str):
    for method, path in [
        ("GET", "/v1/batches/batch_nope"),
        ("POST", "/v1/batches/batch_nope/cancel"),
        ("GET", "/v1/batches/batch_nope/results"),
        ("GET", "/v1/files/file-nope"),
        ("GET", "/v1/files/file-nope/content"),
        ("DELETE", "/v1/files/file-nope"),
    ]:
        error = assert_error(httpx.request(method, api + path), 404, "not_found")
        assert "nope" in error["message"], (method, path, error)


def test_unknown_route_is_404_in_openai_shape(api: str):
    assert_error(httpx.get(f"{api}/v1/nothing-here"), 404)
    assert_error(httpx.delete(f"{api}/v1/batches"), 405)


def test_an_endpoint_the_api_lacks_is_named_with_its_method(api: str):
    """An endpoint Conveyor does not serve (embeddings) or a method a path does not take says
    which request was wrong, as OpenAI's "Invalid URL (POST /v1/...)" does: "Not Found" alone
    leaves a client's user guessing whether the server, the model or the path is missing."""
    error = assert_error(httpx.post(f"{api}/v1/embeddings", json={"input": "x"}), 404)
    assert error["message"].startswith("Invalid URL (POST /v1/embeddings)"), error
    r = httpx.delete(f"{api}/v1/batches")
    error = assert_error(r, 405)
    assert error["message"] == (
        f"Method not allowed (DELETE /v1/batches): /v1/batches takes {r.headers['allow']}"
    ), error
    assert "POST" in r.headers["allow"] and "GET" in r.headers["allow"]


def test_create_batch_from_a_missing_file(api: str):
    error = assert_error(create_batch(api, "file-does-not-exist"), 404, "not_found")
    assert "file-does-not-exist" in error["message"]


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"endpoint": None}, "endpoint"),
        ({"completion_window": "1d"}, "completion_window"),
        ({"completion_window": "0h"}, "completion_window"),
        ({"completion_window": ""}, "completion_window"),
        ({"input_file_id": ""}, "input_file_id"),
        ({"metadata": {"k": 1}}, "metadata.k"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
    ],
)
def test_create_batch_with_bad_fields(api: str, change: dict, param: str):
    body = {"input_file_id": upload(api, [chat("a")]), "endpoint": CHAT, **change}
    r = httpx.post(f"{api}/v1/batches", json=body)
    assert assert_error(r, 400, "invalid_request")["param"] == param


def test_create_batch_with_a_body_that_is_not_json(api: str):
    r = httpx.post(
        f"{api}/v1/batches", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert_error(r, 400, "invalid_request")
    r = httpx.post(f"{api}/v1/batches", json={"endpoint": CHAT})
    assert assert_error(r, 400, "invalid_request")["param"] == "input_file_id"


def test_create_batch_from_an_output_file(api: str):
    """An error file (purpose batch_error) is not a batch input file."""
    batch = batch_from(api, [chat("a", temperature=-1)])
    assert batch["status"] == "completed"
    meta = no_5xx(httpx.get(f"{api}/v1/files/{batch['error_file_id']}")).json()
    assert meta["purpose"] != "batch"
    error = assert_error(create_batch(api, batch["error_file_id"]), 400)
    assert error["param"] == "input_file_id"


def test_upload_with_a_purpose_other_than_batch(api: str):
    data = json.dumps(chat("a")).encode() + b"\n"
    for purpose in ("fine-tune", "assistants", ""):
        error = assert_error(upload_bytes(api, data, purpose=purpose), 400)
        assert error["param"] == "purpose"
    r = no_5xx(httpx.post(f"{api}/v1/files", files={"file": ("in.jsonl", data)}))
    assert assert_error(r, 400, "invalid_request")["param"] == "purpose"  # no purpose at all
    r = no_5xx(httpx.post(f"{api}/v1/files", data={"purpose": "batch"}))
    assert assert_error(r, 400, "invalid_request")["param"] == "file"  # no file at all


def test_cancel_finished_batches_is_409(api: str):
    completed = batch_from(api, [chat("a", temperature=-1)])
    assert completed["status"] == "completed"
    failed = batch_from(api, ["not json"])
    assert failed["status"] == "failed"
    for batch in (completed, failed):
        r = httpx.post(f"{api}/v1/batches/{batch['id']}/cancel")
        assert_error(r, 409, "batch_not_cancellable")
        again = no_5xx(httpx.get(f"{api}/v1/batches/{batch['id']}")).json()
        assert again["status"] == batch["status"] and again["cancelling_at"] is None


def test_cancel_a_queued_batch(api: str):
    """With no worker, nothing runs: cancelling ends the batch; cancelling again is harmless."""
    batch = batch_from(api, batch_lines(5))
    r = no_5xx(httpx.post(f"{api}/v1/batches/{batch['id']}/cancel"))
    assert r.status_code == 200, r.text
    assert r.json()["status"] in ("cancelling", "cancelled")
    assert r.json()["cancelling_at"] is not None
    deadline = time.time() + 30
    while (got := httpx.get(f"{api}/v1/batches/{batch['id']}").json())["status"] != "cancelled":
        assert time.time() < deadline, got
        time.sleep(0.2)
    assert got["request_counts"] == {"total": 5, "completed": 0, "failed": 5, "reused": 0}
    assert got["output_file_id"] is None and got["cancelled_at"] is not None
    r = no_5xx(httpx.get(f"{api}/v1/files/{got['error_file_id']}/content"))
    skipped = [json.loads(x) for x in r.text.splitlines()]
    assert sorted(e["custom_id"] for e in skipped) == [f"q-{i}" for i in range(5)]
    assert {e["error"]["code"] for e in skipped} == {"batch_cancelled"}
    r = no_5xx(httpx.post(f"{api}/v1/batches/{batch['id']}/cancel"))
    assert r.status_code in (200, 409), r.text
    assert no_5xx(httpx.get(f"{api}/v1/batches/{batch['id']}")).json()["status"] == "cancelled"


@pytest.mark.parametrize("query", ["limit=0", "limit=101", "limit=-1", "limit=ten"])
def test_list_batches_bad_limit(api: str, query: str):
    r = httpx.get(f"{api}/v1/batches?{query}")
    assert assert_error(r, 400, "invalid_request")["param"] == "limit"


@pytest.mark.parametrize("query", ["limit=0", "order=sideways"])
def test_list_files_bad_query(api: str, query: str):
    assert_error(httpx.get(f"{api}/v1/files?{query}"), 400, "invalid_request")


def test_results_bad_query(api: str):
    batch = batch_from(api, [chat("a"), chat("b", temperature=-1)])
    r = httpx.get(f"{api}/v1/batches/{batch['id']}/results", params={"after": "batch_req_nope"})
    assert assert_error(r, 400)["param"] == "after"
    r = httpx.get(f"{api}/v1/batches/{batch['id']}/results", params={"limit": 0})
    assert assert_error(r, 400, "invalid_request")["param"] == "limit"


def test_file_retrieve_content_and_delete(api: str):
    data = (json.dumps(chat("a")) + "\n" + json.dumps(chat("b"))).encode()  # no final newline
    r = upload_bytes(api, data, name="mine.jsonl")
    assert r.status_code == 200, r.text
    file = r.json()
    assert file["object"] == "file" and file["purpose"] == "batch"
    assert file["filename"] == "mine.jsonl" and file["bytes"] == len(data)
    assert file["id"].startswith("file-")

    assert no_5xx(httpx.get(f"{api}/v1/files/{file['id']}")).json() == file
    content = no_5xx(httpx.get(f"{api}/v1/files/{file['id']}/content"))
    assert content.status_code == 200 and content.content == data
    listed = no_5xx(httpx.get(f"{api}/v1/files", params={"purpose": "batch"})).json()
    assert file in listed["data"]

    r = no_5xx(httpx.delete(f"{api}/v1/files/{file['id']}"))
    assert r.status_code == 200, r.text
    assert r.json() == {"id": file["id"], "object": "file", "deleted": True}
    assert_error(httpx.get(f"{api}/v1/files/{file['id']}"), 404, "not_found")
    assert_error(httpx.get(f"{api}/v1/files/{file['id']}/content"), 404, "not_found")
    assert_error(httpx.delete(f"{api}/v1/files/{file['id']}"), 404, "not_found")
    assert_error(create_batch(api, file["id"]), 404, "not_found")
    listed = no_5xx(httpx.get(f"{api}/v1/files")).json()
    assert file["id"] not in {f["id"] for f in listed["data"]}


def test_batch_keeps_working_after_its_input_file_is_deleted(api: str):
    file_id = upload(api, [chat("a"), chat("b", temperature=-1)])
    r = create_batch(api, file_id)
    assert r.status_code == 200, r.text
    assert no_5xx(httpx.delete(f"{api}/v1/files/{file_id}")).status_code == 200
    batch = no_5xx(httpx.get(f"{api}/v1/batches/{r.json()['id']}")).json()
    assert batch["status"] == "in_progress" and batch["input_file_id"] == file_id
    assert [e["custom_id"] for e in results(api, batch["id"])] == ["b"]


def test_large_upload_streams(api: str, tmp_path: Path):
    """50,000 lines (the default maximum) upload and become one in-progress batch."""
    n = 50_000
    path = tmp_path / "large.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            line = {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": CHAT,
                "body": {
                    "model": "tiny",
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": f"q{i % 97}"}],
                },
            }
            f.write(json.dumps(line) + "\n")
    start = time.time()
    with open(path, "rb") as f:
        r = no_5xx(
            httpx.post(f"{api}/v1/files", files={"file": f}, data={"purpose": "batch"}, timeout=120)
        )
    assert r.status_code == 200, r.text
    assert r.json()["bytes"] == path.stat().st_size
    r = create_batch(api, r.json()["id"])
    assert r.status_code == 200, r.text
    batch = r.json()
    assert batch["status"] == "in_progress", batch
    assert batch["request_counts"] == {"total": n, "completed": 0, "failed": 0, "reused": 0}
    assert time.time() - start < 60

    # one line more is over the limit: the upload is refused, naming the limit
    with open(path, "a") as f:
        f.write(json.dumps(chat("one-more")) + "\n")
    with open(path, "rb") as f:
        r = no_5xx(
            httpx.post(f"{api}/v1/files", files={"file": f}, data={"purpose": "batch"}, timeout=120)
        )
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == "too_many_lines" and f"at most {n} lines" in error["message"]


# ---- listing on an empty ledger --------------------------------------------------------------


def test_batch_pagination(stack: Stack, tmp_path: Path):
    api = stack.start_api()
    empty = no_5xx(httpx.get(f"{api}/v1/batches")).json()
    assert empty == {
        "object": "list",
        "data": [],
        "first_id": None,
        "last_id": None,
        "has_more": False,
    }
    file_id = upload(api, [chat("a")])
    created = []
    for _ in range(5):
        r = create_batch(api, file_id)
        assert r.status_code == 200, r.text
        created.append(r.json()["id"])

    everything = no_5xx(httpx.get(f"{api}/v1/batches")).json()
    order = [b["id"] for b in everything["data"]]
    assert sorted(order) == sorted(created) and not everything["has_more"]
    stamps = [(b["created_at"], b["id"]) for b in everything["data"]]
    assert stamps == sorted(stamps, reverse=True)  # newest first

    pages, after = [], None
    while True:
        params = {"limit": 2} | ({"after": after} if after else {})
        page = no_5xx(httpx.get(f"{api}/v1/batches", params=params)).json()
        ids = [b["id"] for b in page["data"]]
        assert page["first_id"] == ids[0] and page["last_id"] == ids[-1]
        pages.append(ids)
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert pages == [order[0:2], order[2:4], order[4:5]]

    last = no_5xx(httpx.get(f"{api}/v1/batches", params={"after": order[-1]})).json()
    assert last["data"] == [] and last["has_more"] is False and last["first_id"] is None
    exact = no_5xx(httpx.get(f"{api}/v1/batches", params={"limit": 5})).json()
    assert [b["id"] for b in exact["data"]] == order and exact["has_more"] is False


def test_file_pagination(stack: Stack):
    api = stack.start_api()
    ids = [upload(api, [chat(f"f{i}")], name=f"f{i}.jsonl") for i in range(4)]
    desc = [f["id"] for f in no_5xx(httpx.get(f"{api}/v1/files")).json()["data"]]
    assert sorted(desc) == sorted(ids)
    asc = no_5xx(httpx.get(f"{api}/v1/files", params={"order": "asc"})).json()
    assert [f["id"] for f in asc["data"]] == desc[::-1]
    page = no_5xx(httpx.get(f"{api}/v1/files", params={"limit": 3})).json()
    assert [f["id"] for f in page["data"]] == desc[:3] and page["has_more"] is True
    rest = no_5xx(httpx.get(f"{api}/v1/files", params={"after": page["last_id"]})).json()
    assert [f["id"] for f in rest["data"]] == desc[3:] and rest["has_more"] is False


def test_writes_are_committed_before_the_answer(api: str):
    """A client that acts on a 200 at once (on a kept-alive connection) must see the change: a
    deleted file is gone and a cancelled batch is cancelling on the very next request."""
    with httpx.Client(base_url=api, timeout=30) as client:
        for _ in range(50):
            file_id = upload(api, [chat("a")])
            assert no_5xx(client.get(f"/v1/files/{file_id}")).status_code == 200
            assert no_5xx(client.delete(f"/v1/files/{file_id}")).status_code == 200
            assert_error(client.get(f"/v1/files/{file_id}"), 404, "not_found")
        for _ in range(20):
            batch = batch_from(api, [chat("a")])
            assert no_5xx(client.get(f"/v1/batches/{batch['id']}")).status_code == 200
            assert no_5xx(client.post(f"/v1/batches/{batch['id']}/cancel")).status_code == 200
            got = no_5xx(client.get(f"/v1/batches/{batch['id']}")).json()
            assert got["status"] in ("cancelling", "cancelled"), got
