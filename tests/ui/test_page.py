"""The web page in a real browser: Debian's chromium, driven by Playwright.

One ledger for the module, with one echo worker and two APIs on it: one with authentication off
(everything in the `default` project, as `conveyor serve` runs) and one with it required. Each
test opens a fresh browser context (a tab with its own sessionStorage) on the one browser.

With CONVEYOR_UI_SCREENSHOT=PATH, the progress test saves the batch list, mid-run, there (the
docs/ui.png, on the web page's documentation page).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from conveyor.settings import normalize_database_url
from conveyor.testing import (
    ApiKey,
    Stack,
    batch_lines,
    create_key,
    databases,
    stack_env,
    upload_file,
    wait_for,
    write_jsonl,
)

CHROMIUM = "/usr/bin/chromium"
CHAT = "/v1/chat/completions"
HOSTILE_IDS = (
    '<img src=x onerror="window.__xss=1;alert(1)">',
    "<script>window.__xss=2;alert(2)</script>",
)
HOSTILE_MODEL = '<img src=x onerror="window.__xss=3;alert(3)">'
HOSTILE_NOTE = "<b>bold</b><img src=x onerror=alert(4)>"


@dataclass
class Service:
    open_api: str  # CONVEYOR_AUTH=off: the default project
    secured_api: str  # CONVEYOR_AUTH=required
    env: dict[str, str]


@pytest.fixture(scope="module")
def service(
    postgres_server: str,
    redis_server: str,
    template_database: str,
    tmp_path_factory,
    redis_databases,
) -> Iterator[Service]:
    root = tmp_path_factory.mktemp("ui")
    (root / "secured").mkdir()
    redis_url = redis_databases.url(redis_server, hold=True)
    with databases.scratch_database(postgres_server, "conveyor_t_", template_database) as url:
        env = stack_env(normalize_database_url(url), redis_url, root)
        # two requests a quarter second: a batch of 40 takes about 5 s, long enough to watch
        env["CONVEYOR_ECHO_STEP_SECONDS"] = "0.25"
        stacks = [
            Stack(env=env, root=root),
            Stack(env=env | {"CONVEYOR_AUTH": "required"}, root=root / "secured"),
        ]
        try:
            stacks[0].start_worker("w1", "echo", "--max-num-seqs", "2", served="", wait=False)
            apis = [stack.start_api() for stack in stacks]
            stacks[0].wait_worker_ready("w1")
            yield Service(apis[0], apis[1], env)
        finally:
            for stack in stacks:
                stack.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"no {CHROMIUM}: install Debian's chromium (apt-get install chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@dataclass
class Tab:
    page: Page
    console_errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)


def open_tab(browser: Browser) -> Tab:
    page = browser.new_context(viewport={"width": 1280, "height": 760}).new_page()
    tab = Tab(page)
    page.on("console", lambda m: m.type == "error" and tab.console_errors.append(m.text))
    page.on("pageerror", lambda err: tab.console_errors.append(str(err)))

    def dialog(d) -> None:
        tab.dialogs.append(d.message)
        d.dismiss()

    page.on("dialog", dialog)
    return tab


@pytest.fixture
def tab(browser: Browser) -> Iterator[Tab]:
    tab = open_tab(browser)
    yield tab
    tab.page.context.close()


def batch_row(page: Page, batch_id: str):
    return page.locator(f'#batches-body tr[data-batch-id="{batch_id}"]')


def create_batch(
    api: str, tmp_path: Path, name: str, lines: list[dict], key: ApiKey | None = None, **extra
) -> str:
    headers = key.headers if key else None
    file_id = upload_file(api, write_jsonl(tmp_path / f"{name}.jsonl", lines), headers)
    body = {"input_file_id": file_id, "endpoint": CHAT, **extra}
    created = httpx.post(f"{api}/v1/batches", json=body, headers=headers, timeout=60)
    assert created.status_code == 200, created.text
    return created.json()["id"]


def screenshot(page: Page, path: str) -> None:
    """The top bar and the batch list, down to the table's end."""
    table = page.locator("#batches-table").bounding_box()
    assert table is not None
    height = table["y"] + table["height"] + 24
    page.screenshot(path=path, clip={"x": 0, "y": 0, "width": 1280, "height": height})


def test_the_page_loads_with_no_console_errors(service: Service, tab: Tab) -> None:
    page = tab.page
    response = page.goto(f"{service.open_api}/")  # redirected to the page
    assert response is not None and response.ok
    assert page.url == f"{service.open_api}/ui/"
    policy = response.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "default-src 'none'" in policy
    expect(page.locator("#batches-view")).to_be_visible()
    expect(page.locator("#updated")).to_contain_text("Updated")
    expect(page.locator("#login-view")).to_be_hidden()  # no key wanted with auth off
    page.click("#nav-workers")
    expect(page.locator('#workers-body tr[data-worker-id="w1"]')).to_be_visible()
    page.click("#nav-batches")
    expect(page.locator("#batches-view")).to_be_visible()
    page.wait_for_timeout(2500)  # a poll more of each
    assert tab.console_errors == []
    # every script is a file of the page's own; the browser runs no inline script
    html = httpx.get(f"{service.open_api}/ui/").text
    assert html.count("<script") == html.count('<script type="module" src=') == 1
    with pytest.raises(Exception, match="Content Security Policy|Refused"):
        page.add_script_tag(content="window.__inline = 1")
    assert page.evaluate("window.__inline") is None


def test_cancel_asks_first_then_cancels(service: Service, tab: Tab, tmp_path: Path) -> None:
    api, page = service.open_api, tab.page
    # no worker serves this model: the batch stays in progress until cancelled
    batch_id = create_batch(api, tmp_path, "cancel", batch_lines(3, model="llama-3-70b"))
    page.goto(f"{api}/ui/#/batches/{batch_id}")
    expect(page.locator(".notice")).to_contain_text("no live worker serves model 'llama-3-70b'")
    page.click("#cancel-button")
    expect(page.locator("#cancel-dialog")).to_be_visible()
    page.click("#cancel-keep")  # changed their mind: nothing happens
    expect(page.locator("#cancel-dialog")).to_be_hidden()
    page.wait_for_timeout(500)
    assert httpx.get(f"{api}/v1/batches/{batch_id}").json()["status"] == "in_progress"
    page.click("#cancel-button")
    page.click("#cancel-confirm")
    expect(page.locator(".detail-head .badge")).to_have_text("cancelled", timeout=15_000)
    assert httpx.get(f"{api}/v1/batches/{batch_id}").json()["status"] == "cancelled"
    expect(page.locator("#cancel-button")).to_have_count(0)
    group = page.locator('.error-group[data-code="batch_cancelled"]')
    expect(group).to_contain_text("3 lines")
    expect(page.locator(".timeline li", has_text="Cancelled")).to_have_class("reached")
    assert tab.dialogs == [] and tab.console_errors == []


def test_workers_and_queues(service: Service, tab: Tab, tmp_path: Path) -> None:
    api, page = service.open_api, tab.page
    create_batch(api, tmp_path, "queued", batch_lines(5, model="qwen3-32b"))
    page.goto(f"{api}/ui/#/workers")
    worker = page.locator('#workers-body tr[data-worker-id="w1"]')
    expect(worker.locator(".model")).to_have_text("echo")
    expect(worker.locator(".device")).to_have_text("none")  # the echo engine runs on nothing
    expect(worker.locator(".heartbeat")).to_contain_text("s ago")
    queue = page.locator('#queues-body tr[data-model="qwen3-32b"]')
    expect(queue.locator(".queued")).to_have_text("5")
    expect(queue.locator("td").nth(1)).to_have_text("0")  # no worker for it
    workers = httpx.get(f"{api}/v1/workers").json()["data"]
    assert [(w["id"], w["models"], w["device"]) for w in workers] == [("w1", ["echo"], "none")]
    assert tab.console_errors == []


def test_a_new_batch_appears_and_its_progress_bar_advances_to_completed(
    service: Service, tab: Tab, tmp_path: Path
) -> None:
    api, page = service.open_api, tab.page
    page.goto(f"{api}/ui/")
    expect(page.locator("#batches-view")).to_be_visible()
    lines = batch_lines(40, model="echo", prefix="mmlu")
    batch_id = create_batch(
        api, tmp_path, "progress", lines, metadata={"description": "nightly mmlu"}
    )
    row = batch_row(page, batch_id)
    expect(row).to_be_visible(timeout=10_000)  # without reloading the page
    expect(row).to_contain_text("nightly mmlu")
    bar = row.locator('[role="progressbar"]')
    seen: list[float] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        value = float(bar.get_attribute("aria-valuenow") or "nan")
        if not seen or value != seen[-1]:
            seen.append(value)
            if 0 < value < 100 and (shot := os.environ.get("CONVEYOR_UI_SCREENSHOT")):
                screenshot(page, shot)
        if value == 100 and row.locator(".badge").inner_text() == "completed":
            break
        page.wait_for_timeout(100)
    assert seen[-1] == 100, seen
    assert any(0 < v < 100 for v in seen), f"no step between 0 and 100 was shown: {seen}"
    assert seen == sorted(seen), seen
    cells = row.locator("td")
    assert [cells.nth(i).inner_text() for i in (4, 5, 6)] == ["40", "0", "40"]
    # the batch's page: its timeline reached the end, and its output downloads
    page.click(f'a[href="#/batches/{batch_id}"]')
    expect(page.locator(".timeline li", has_text="Completed")).to_have_class("reached")
    expect(page.locator(".chart rect").first).to_be_attached()
    with page.expect_download() as download:
        page.click("text=Download output")
    output = Path(download.value.path()).read_text().splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in output) == sorted(
        line["custom_id"] for line in lines
    )
    assert tab.console_errors == []


def test_ledger_text_is_shown_as_text(service: Service, tab: Tab, tmp_path: Path) -> None:
    api, page = service.open_api, tab.page
    lines = batch_lines(3, model="echo")
    for line, custom_id in zip(lines, HOSTILE_IDS, strict=False):
        line["custom_id"] = custom_id
        line["body"][HOSTILE_NOTE] = 1  # an unknown field: the line fails alone, naming it
    batch_id = create_batch(api, tmp_path, "hostile", lines, metadata={"description": HOSTILE_NOTE})
    assert wait_for(api, batch_id, timeout=60)["request_counts"]["failed"] == 2
    waiting = create_batch(api, tmp_path, "hostile-model", batch_lines(1, model=HOSTILE_MODEL))

    page.goto(f"{api}/ui/")
    expect(batch_row(page, waiting).locator(".model")).to_have_text(HOSTILE_MODEL)
    expect(batch_row(page, batch_id)).to_contain_text(HOSTILE_NOTE)
    page.goto(f"{api}/ui/#/batches/{batch_id}")
    examples = page.locator('.error-group[data-code="unknown_parameter"] .custom-id')
    expect(examples).to_have_count(2)
    assert sorted(examples.all_inner_texts()) == sorted(HOSTILE_IDS)
    expect(page.locator(".error-group .message").first).to_contain_text(HOSTILE_NOTE)
    expect(page.locator(".metadata dd")).to_have_text(HOSTILE_NOTE)
    page.goto(f"{api}/ui/#/batches/{waiting}")
    expect(page.locator(".detail-head .model")).to_have_text(HOSTILE_MODEL)
    expect(page.locator(".notice")).to_contain_text(HOSTILE_MODEL)
    # nothing was made of the text: no element, no script run, no dialog
    assert page.locator("img[src='x'], b, main script").count() == 0
    assert page.locator("script").count() == 1  # the page's own module
    assert page.evaluate("window.__xss") is None
    assert tab.dialogs == [] and tab.console_errors == []
    assert httpx.post(f"{api}/v1/batches/{waiting}/cancel").status_code == 200
    wait_for(api, waiting, timeout=30)  # cancelled: the next test counts it


def test_the_filters_ask_the_api_for_a_status_and_a_model(service: Service, tab: Tab) -> None:
    api, page = service.open_api, tab.page
    page.goto(f"{api}/ui/")
    rows = page.locator("#batches-body tr")
    expect(rows).not_to_have_count(0)
    everything = rows.count()
    page.select_option("#status-filter", "cancelled")
    expect(rows.locator(".badge").first).to_have_text("cancelled")
    cancelled = [b["id"] for b in httpx.get(f"{api}/v1/batches").json()["data"]
                 if b["status"] == "cancelled"]  # fmt: skip
    expect(rows).to_have_count(len(cancelled))
    assert 0 < len(cancelled) < everything
    page.select_option("#status-filter", "")
    page.select_option("#model-filter", "llama-3-70b")
    expect(rows).to_have_count(1)
    expect(rows.locator(".model")).to_have_text("llama-3-70b")
    page.select_option("#model-filter", "")
    expect(rows).to_have_count(everything)
    assert tab.console_errors == []


def test_with_auth_a_key_sees_its_project_only(
    service: Service, tab: Tab, browser: Browser, tmp_path: Path
) -> None:
    api, page = service.secured_api, tab.page
    team_a = create_key(service.env, "ui-team-a")
    team_b = create_key(service.env, "ui-team-b")
    lines = batch_lines(4, model="echo", prefix="secret-a")
    lines[0]["body"]["temperature"] = -1  # one error line, with a custom_id to show
    batch_id = create_batch(api, tmp_path, "a", lines, key=team_a)
    wait_for(api, batch_id, timeout=60, headers=team_a.headers)

    def nothing_of_project_a() -> None:  # not shown, nor hidden in the page
        body = page.locator("body").text_content() or ""
        assert batch_id not in body and "secret-a" not in body

    def sign_in(key: str) -> None:
        page.fill("#key-input", key)
        page.click("#login-form button")

    # no key: only the key form, for every view
    for view in ("", f"#/batches/{batch_id}", "#/workers"):
        page.goto(f"{api}/ui/{view}")
        expect(page.locator("#login-view")).to_be_visible()
        for name in ("batches", "detail", "workers"):
            expect(page.locator(f"#{name}-view")).to_be_hidden()
        nothing_of_project_a()
    sign_in("cvy-not-a-key")
    expect(page.locator("#login-error")).to_have_text("That key was not accepted.")
    nothing_of_project_a()

    # the project's own key: its batch, its error lines, its files (fetched with the key)
    page.goto(f"{api}/ui/")
    sign_in(team_a.secret)
    expect(batch_row(page, batch_id)).to_be_visible()
    page.goto(f"{api}/ui/#/batches/{batch_id}")
    expect(page.locator(".custom-id")).to_have_text("secret-a-0")
    with page.expect_download() as download:
        page.click("text=Download output")
    assert len(Path(download.value.path()).read_text().splitlines()) == 3
    assert page.evaluate("sessionStorage.getItem('conveyor.apiKey')") == team_a.secret
    other = open_tab(browser)  # the key stays with its tab: another one asks for a key
    other.page.goto(f"{api}/ui/")
    expect(other.page.locator("#login-view")).to_be_visible()
    other.page.context.close()

    # forgetting the key takes everything of the project off the page
    page.click("#sign-out")
    expect(page.locator("#login-view")).to_be_visible()
    nothing_of_project_a()
    assert page.evaluate("sessionStorage.getItem('conveyor.apiKey')") is None

    # another project's key: its own (empty) project, and no such batch
    sign_in(team_b.secret)
    expect(page.locator("#detail-view h1")).to_have_text("Batch not found")
    page.goto(f"{api}/ui/")
    expect(page.locator("#batches-empty")).to_be_visible()
    expect(page.locator("#batches-body tr")).to_have_count(0)  # nor the default project's
    page.goto(f"{api}/ui/#/workers")
    expect(page.locator("#queues-body tr[data-model='echo'] .queued")).to_have_text("0")
    nothing_of_project_a()
    assert tab.dialogs == []
    # the routes the page reads are the project's too
    for route in ("", "/error_groups", "/throughput"):
        r = httpx.get(f"{api}/v1/batches/{batch_id}{route}", headers=team_b.headers)
        assert r.status_code == 404, (route, r.text)
        assert httpx.get(f"{api}/v1/batches/{batch_id}{route}").status_code == 401
    for route in ("/v1/workers", "/v1/queues"):
        assert httpx.get(f"{api}{route}").status_code == 401


def test_a_batch_shows_what_changed_since_another(service: Service, tab: Tab, tmp_path: Path):
    api, page = service.open_api, tab.page
    lines = batch_lines(3, model="echo", prefix="cmp")
    first = create_batch(api, tmp_path, "cmp-1", lines)
    body = lines[2]["body"]
    question = [*body["messages"][:-1], {"role": "user", "content": "another question"}]
    edited = [*lines[:2], {**lines[2], "body": {**body, "messages": question}}]
    second = create_batch(api, tmp_path, "cmp-2", [*edited, *batch_lines(1, model="echo")])
    for batch_id in (first, second):
        wait_for(api, batch_id, timeout=60)
    page.goto(f"{api}/ui/#/batches/{second}")
    page.fill("#compare-input", first)
    page.click("#compare-button")
    expect(page).to_have_url(f"{api}/ui/#/batches/{second}/since/{first}")
    summary = page.locator(".diff-summary")
    expect(summary).to_contain_text("2 the same, 1 changed, 1 new, 0 gone")
    expect(page.locator(".diff-changed li")).to_have_text(["cmp-2"])
    # the echo model's workers record no run (the CLI and API tests show a recorded one)
    expect(page.locator(".diff-what-ran")).to_have_text(
        "What ran them: not recorded for one or both."
    )
    assert tab.console_errors == []
