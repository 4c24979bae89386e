"""Schemathesis against the live API: cases generated from its OpenAPI schema for every route,
with a valid API key (so the handlers run) and with none. No 5xx, and every response matches
the schema (documented status code, body shape, content type)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from services import Stack, batch_lines, write_jsonl

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
EXAMPLES_PER_OPERATION = 60


def test_every_route_survives_generated_cases(stack: Stack, tmp_path: Path) -> None:
    stack.env["CONVEYOR_AUTH"] = "required"
    api = stack.start_api()
    made = subprocess.run(
        [sys.executable, "-m", "conveyor", "keys", "create", "--name", "fuzz"],
        env=stack.env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    auth = {"Authorization": f"Bearer {made.stdout.strip().splitlines()[-1]}"}
    # something to find: a file of this project
    path = write_jsonl(tmp_path / "in.jsonl", batch_lines(2))
    with open(path, "rb") as f:
        file_id = httpx.post(
            f"{api}/v1/files", files={"file": f}, data={"purpose": "batch"}, headers=auth
        ).json()["id"]

    schema = schemathesis.openapi.from_url(f"{api}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 11
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
