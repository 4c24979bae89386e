"""API keys and project isolation (CONVEYOR_AUTH=required): two projects each with files and
batches; every route with the other project's ids is a 404, lists never show the other's
objects, and no key, an unknown key or a revoked key is a 401."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from conveyor.testing import Stack, batch_lines, create_key, run_keys, wait_for, write_jsonl


def keys(stack: Stack, *args: str) -> subprocess.CompletedProcess:
    return run_keys(stack.env, *args)


def new_key(stack: Stack, name: str) -> tuple[str, str]:
    """(key id, secret) of a new key; the secret is alone on the last line of stdout."""
    key = create_key(stack.env, name)
    assert key.secret.startswith("cvy-") and " " not in key.secret
    return key.id, key.secret


class Project:
    def __init__(self, api: str, secret: str) -> None:
        self.api = api
        self.http = httpx.Client(
            base_url=api, headers={"Authorization": f"Bearer {secret}"}, timeout=60
        )

    def upload(self, path: Path) -> str:
        with open(path, "rb") as f:
            r = self.http.post(
                "/v1/files", files={"file": (path.name, f)}, data={"purpose": "batch"}
            )
        assert r.status_code == 200, r.text
        return r.json()["id"]

    def create(self, file_id: str, key: str | None = None) -> httpx.Response:
        headers = {"Idempotency-Key": key} if key else {}
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
        return self.http.post("/v1/batches", json=body, headers=headers)

    def wait(self, batch_id: str) -> dict:
        return wait_for(self.api, batch_id, timeout=180, headers=dict(self.http.headers))


@pytest.fixture
def secured(stack: Stack) -> Stack:
    stack.env["CONVEYOR_AUTH"] = "required"
    return stack


def test_projects_are_isolated(secured: Stack, chat_model: Path, tmp_path: Path) -> None:
    api = secured.start_api()
    secured.start_worker("w1", chat_model)
    _, secret_a = new_key(secured, "team-a")
    _, secret_b = new_key(secured, "team-b")
    a, b = Project(api, secret_a), Project(api, secret_b)

    objects = {}
    for name, project in (("a", a), ("b", b)):
        source = write_jsonl(tmp_path / f"{name}.jsonl", batch_lines(3, prefix=name))
        file_id = project.upload(source)
        done = project.create(file_id, key="nightly").json()
        assert project.wait(done["id"])["status"] == "completed"
        spare = project.upload(source)
        running = project.create(spare).json()  # a second batch, maybe still running
        objects[name] = {
            "file": file_id,
            "batch": done["id"],
            "output": project.http.get(f"/v1/batches/{done['id']}").json()["output_file_id"],
            "running": running["id"],
        }
    # the same idempotency key in two projects names two batches
    assert objects["a"]["batch"] != objects["b"]["batch"]

    for me, mine, theirs in ((a, objects["a"], objects["b"]), (b, objects["b"], objects["a"])):
        # every route with the other project's ids: 404, exactly as for ids that never existed
        for method, path in [
            ("GET", f"/v1/files/{theirs['file']}"),
            ("GET", f"/v1/files/{theirs['file']}/content"),
            ("GET", f"/v1/files/{theirs['output']}"),
            ("GET", f"/v1/files/{theirs['output']}/content"),
            ("DELETE", f"/v1/files/{theirs['file']}"),
            ("GET", f"/v1/batches/{theirs['batch']}"),
            ("GET", f"/v1/batches/{theirs['batch']}/results"),
            ("POST", f"/v1/batches/{theirs['running']}/cancel"),
        ]:
            r = me.http.request(method, path)
            assert r.status_code == 404, (method, path, r.text)
            assert r.json()["error"]["code"] == "not_found"
        r = me.create(theirs["file"])  # a batch from the other's file
        assert r.status_code == 404, r.text
        # lists show only my own objects, whatever the cursor
        files = {f["id"] for f in me.http.get("/v1/files").json()["data"]}
        assert theirs["file"] not in files and theirs["output"] not in files
        assert mine["file"] in files and mine["output"] in files
        batches = {x["id"] for x in me.http.get("/v1/batches").json()["data"]}
        assert batches == {mine["batch"], mine["running"]}
        after = me.http.get("/v1/batches", params={"after": theirs["batch"]}).json()["data"]
        assert {x["id"] for x in after} <= batches
        keyed = me.http.get("/v1/batches", params={"idempotency_key": "nightly"}).json()["data"]
        assert [x["id"] for x in keyed] == [mine["batch"]]
        # and my own objects still work
        assert me.http.get(f"/v1/files/{mine['output']}/content").status_code == 200
        assert me.http.get(f"/v1/batches/{mine['batch']}").status_code == 200

    # the other project's delete and cancel attempts changed nothing
    assert b.http.get(f"/v1/files/{objects['b']['file']}").status_code == 200
    assert b.http.get(f"/v1/batches/{objects['b']['running']}").json()["status"] != "cancelling"


def test_keys_are_required_and_revocable(secured: Stack, tmp_path: Path) -> None:
    api = secured.start_api()
    key_id, secret = new_key(secured, "team-a")
    project = Project(api, secret)
    file_id = project.upload(write_jsonl(tmp_path / "in.jsonl", batch_lines(2)))

    # every /v1 route in the OpenAPI schema wants a key; health and readiness do not
    schema = httpx.get(f"{api}/openapi.json").json()
    routes = [
        (method.upper(), path.replace("{file_id}", file_id).replace("{batch_id}", "batch_x"))
        for path, ops in schema["paths"].items()
        if path.startswith("/v1/")
        for method in ops
    ]
    assert len(routes) >= 11
    for headers in ({}, {"Authorization": "Bearer cvy-not-a-key"}, {"Authorization": "Basic x"}):
        for method, path in routes:
            r = httpx.request(method, f"{api}{path}", headers=headers)
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{api}/healthz").status_code == 200
    assert httpx.get(f"{api}/readyz").status_code == 200

    assert project.http.get(f"/v1/files/{file_id}").status_code == 200
    listed = keys(secured, "list")
    assert key_id in listed.stdout and secret not in listed.stdout  # only a hash is kept
    revoked = keys(secured, "revoke", key_id)
    assert revoked.returncode == 0, revoked.stderr
    r = project.http.get(f"/v1/files/{file_id}")
    assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]
    assert keys(secured, "revoke", "key_unknown").returncode == 1


def test_joining_a_project_is_explicit(secured: Stack, tmp_path: Path) -> None:
    api = secured.start_api()
    _, secret = new_key(secured, "team-a")
    file_id = Project(api, secret).upload(write_jsonl(tmp_path / "in.jsonl", batch_lines(2)))

    again = keys(secured, "create", "--name", "team-a")  # same name: no silent join
    assert again.returncode == 2 and "--project 'team-a'" in again.stderr
    assert "cvy-" not in again.stdout
    for blank in ("", "   "):
        empty = keys(secured, "create", "--name", blank)
        assert empty.returncode == 2 and "must not be empty" in empty.stderr
    empty = keys(secured, "create", "--name", "x", "--project", " ")
    assert empty.returncode == 2 and "must not be empty" in empty.stderr

    joined = keys(secured, "create", "--name", "team-a-ci", "--project", "team-a")
    assert joined.returncode == 0, joined.stderr
    assert "for project 'team-a'" in joined.stdout
    second = Project(api, joined.stdout.strip().splitlines()[-1])
    assert second.http.get(f"/v1/files/{file_id}").status_code == 200

    _, other = new_key(secured, "team-b")  # a new name is a new project
    assert Project(api, other).http.get(f"/v1/files/{file_id}").status_code == 404
