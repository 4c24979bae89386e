"""Schemathesis against the live API: cases generated from its OpenAPI schema for every route,
with a valid API key (so the handlers run) and with none. No 5xx, and every response matches
the schema (documented status code, body shape, content type). A second pass puts hostile values
the schema allows in: NUL, lone surrogates, over-long strings, deep nesting."""

from __future__ import annotations

from pathlib import Path

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from conveyor.testing import Stack, batch_lines, create_key, upload_file, write_jsonl

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
EXAMPLES_PER_OPERATION = 60
HOSTILE_EXAMPLES_PER_OPERATION = 25


def start_with_a_file(stack: Stack, tmp_path: Path) -> tuple[str, dict[str, str], str]:
    """The API with keys required, a key's Authorization header and a file of its project."""
    stack.env["CONVEYOR_AUTH"] = "required"
    api = stack.start_api()
    auth = create_key(stack.env, "fuzz").headers
    file_id = upload_file(api, write_jsonl(tmp_path / "in.jsonl", batch_lines(2)), auth)
    return api, auth, file_id


def operations_of(api: str) -> list:
    schema = schemathesis.openapi.from_url(f"{api}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 11
    return operations


def test_every_route_survives_generated_cases(stack: Stack, tmp_path: Path) -> None:
    api, auth, file_id = start_with_a_file(stack, tmp_path)  # something to find
    operations = operations_of(api)
    cases = 0
    for operation in operations:

        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def run(case) -> None:
            nonlocal cases
            cases += 1
            headers = dict(auth) if cases % 5 else {}  # one case in five without a key
            response = case.call(base_url=api, headers=headers, timeout=60)
            case.validate_response(response, checks=CHECKS)

        run()
    print(f"{cases} generated cases over {len(operations)} operations")
    assert cases >= 500, cases
    # the API still works after it all
    assert httpx.get(f"{api}/v1/files/{file_id}", headers=auth).status_code in (200, 404)
    assert httpx.get(f"{api}/readyz").status_code == 200


# Hostile strings an HTTP client can send in a URL or a form: NUL, and more than any column holds
IN_URL = st.sampled_from(["\x00", "a\x00b", "file-\x00", "batch_\x00", "x" * 300]) | st.text(
    min_size=1, max_size=80
).map(lambda text: text + "\x00")
# ... and in JSON, where escapes can also make lone surrogates
IN_JSON = (
    IN_URL
    | st.sampled_from(["\udc80", "a\ud800", "file-\udfff"])
    | st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=8)
)


def poison(case, data: st.DataObject) -> None:
    """Puts hostile strings into some of the case's path parameters, query parameters and body
    fields (request headers cannot carry NUL: HTTP clients refuse to send one)."""
    for params in (case.path_parameters, case.query):
        for name in list(params or {}):
            if data.draw(st.booleans()):
                params[name] = data.draw(IN_URL)
    if isinstance(case.body, dict):
        strings = IN_JSON if case.media_type == "application/json" else IN_URL
        for name, value in list(case.body.items()):
            if isinstance(value, bytes) or not data.draw(st.booleans()):
                continue
            if isinstance(value, dict):
                case.body[name] = {data.draw(strings): data.draw(strings)}
            else:
                case.body[name] = data.draw(strings)


def test_every_route_survives_hostile_values(stack: Stack, tmp_path: Path) -> None:
    api, auth, file_id = start_with_a_file(stack, tmp_path)
    operations = operations_of(api)
    cases = 0
    for operation in operations:

        @settings(
            max_examples=HOSTILE_EXAMPLES_PER_OPERATION,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(), data=st.data())
        def run(case, data: st.DataObject) -> None:
            nonlocal cases
            cases += 1
            poison(case, data)
            response = case.call(base_url=api, headers=dict(auth), timeout=60)
            case.validate_response(response, checks=[not_a_server_error])

        run()
    print(f"{cases} hostile cases over {len(operations)} operations")
    assert cases >= 200, cases

    # JSON nested past any sensible depth, to every operation (those without a body ignore
    # it), on one kept-alive connection that must stay usable
    with httpx.Client(base_url=api, headers=auth, timeout=60) as client:
        for operation in operations:
            path = operation.path.replace("{file_id}", file_id).replace("{batch_id}", "batch_x")
            for depth in (65, 5000):
                for nested in ("[" * depth + "]" * depth, '{"a":' * depth + "1" + "}" * depth):
                    r = client.request(
                        operation.method.upper(),
                        path,
                        content=f'{{"input_file_id": {nested}}}',
                        headers={"content-type": "application/json"},
                    )
                    assert r.status_code < 500, (operation.method, path, depth, r.text)
        assert client.get("/v1/batches").status_code == 200  # (the file may be deleted)
    assert httpx.get(f"{api}/readyz").status_code == 200
