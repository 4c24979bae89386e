"""Each setting is declared once (`conveyor.settings.setting`): read from its variable by its
type, refused by its variable's name when out of range, and shown in the documentation's
tables as declared."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.settings import Settings
from docs.hooks import generated as docs_pages

ROOT = Path(__file__).resolve().parents[2]
# a value of each type, as a variable holds it, and as the setting then holds it
SAMPLES = {int: ("7", 7), float: ("2.5", 2.5), Path: ("/x/y", Path("/x/y"))}
WORDS = {"auth": (" Required ", "required"), "log_format": ("JSON", "json")}
# every variable the service has read since before pydantic-settings: none may change its name
VARIABLES = {
    "DATABASE_URL", "REDIS_URL", "CONVEYOR_DATA_DIR", "CONVEYOR_SHARD_SIZE",
    "CONVEYOR_VISIBILITY_TIMEOUT", "CONVEYOR_HEARTBEAT_INTERVAL", "CONVEYOR_HEARTBEAT_TIMEOUT",
    "CONVEYOR_RECONCILE_INTERVAL", "CONVEYOR_UNSERVED_TIMEOUT", "CONVEYOR_AFFINITY_BACKLOG",
    "CONVEYOR_MAX_UPLOAD_BYTES", "CONVEYOR_MAX_LINE_BYTES", "CONVEYOR_MAX_BATCH_LINES",
    "CONVEYOR_AUTH", "CONVEYOR_MAX_TOKENS", "CONVEYOR_MAX_BATCHES_IN_FLIGHT",
    "CONVEYOR_MAX_JSON_BODY_BYTES", "CONVEYOR_MAX_COMPLETION_WINDOW", "CONVEYOR_ONLINE_TIMEOUT",
    "CONVEYOR_MAX_REQUEST_FAILURES", "CONVEYOR_MAX_SHARD_ATTEMPTS", "CONVEYOR_SHUTDOWN_TIMEOUT",
    "CONVEYOR_LOG_FORMAT", "CONVEYOR_GPU_LOCK_DIR", "CONVEYOR_MAX_ONLINE_PROMPTS",
    "CONVEYOR_MAX_ONLINE_REQUEST_SEQUENCES", "CONVEYOR_MAX_ONLINE_SEQUENCES",
    "CONVEYOR_ONLINE_RATE_LIMIT", "CONVEYOR_ONLINE_BURST",
}  # fmt: skip


def sample(name: str) -> tuple[str, object]:
    annotation = Settings.model_fields[name].annotation
    for kind, pair in SAMPLES.items():
        if annotation == kind or annotation == kind | None:
            return pair
    return WORDS.get(
        name, ("9m", "9m") if name == "max_completion_window" else ("postgresql://h/db",) * 2
    )


def test_every_variable_keeps_its_name() -> None:
    assert {Settings.variable(name) for name in Settings.model_fields} == VARIABLES


def test_every_setting_is_read_from_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = {}
    for name in Settings.model_fields:
        raw, value = sample(name)
        monkeypatch.setenv(Settings.variable(name), raw)
        expected[name] = value
    settings = Settings()
    assert {name: getattr(settings, name) for name in expected} == expected


def test_unset_or_blank_variables_leave_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = {name: f.get_default() for name, f in Settings.model_fields.items()}
    for name in Settings.model_fields:
        monkeypatch.delenv(Settings.variable(name), raising=False)
    assert Settings().model_dump() == defaults
    for name in Settings.model_fields:
        monkeypatch.setenv(Settings.variable(name), " ")
    assert Settings().model_dump() == defaults


def test_a_setting_is_given_by_its_name_whatever_its_variable() -> None:
    given = Settings(max_tokens_cap=5, database_url="postgresql://h/db", shard_size=8)
    assert (given.max_tokens_cap, given.database_url, given.shard_size) == (
        5,
        "postgresql://h/db",
        8,
    )


def test_other_variables_of_the_prefix_are_not_settings(monkeypatch) -> None:
    # the engine's flags share the prefix (CONVEYOR_DTYPE, ...): they are not refused here
    monkeypatch.setenv("CONVEYOR_DTYPE", "float32")
    monkeypatch.setenv("CONVEYOR_NOT_A_SETTING", "x")
    assert Settings().shard_size == 32


@pytest.mark.parametrize(
    ("variable", "raw", "says"),
    [
        ("CONVEYOR_HEARTBEAT_TIMEOUT", "soon", "valid number"),
        ("CONVEYOR_SHARD_SIZE", "abc", "valid integer"),
        ("CONVEYOR_SHARD_SIZE", "0", "greater than 0"),
        ("CONVEYOR_MAX_TOKENS", "-1", "greater than or equal to 0"),  # not its field's name
        ("CONVEYOR_MAX_REQUEST_FAILURES", "0", "greater than or equal to 1"),
        ("CONVEYOR_UNSERVED_TIMEOUT", "inf", "finite"),
        ("CONVEYOR_ONLINE_RATE_LIMIT", "nan", "finite"),
        ("CONVEYOR_AUTH", "maybe", "'off' or 'required'"),
        ("CONVEYOR_LOG_FORMAT", "xml", "'text' or 'json'"),
        ("CONVEYOR_MAX_COMPLETION_WINDOW", "7d", "must look like '168h'"),
    ],
)
def test_a_bad_value_is_refused_by_its_variable(monkeypatch, variable, raw, says) -> None:
    monkeypatch.setenv(variable, raw)
    with pytest.raises(ValueError, match=f"^{variable}='{raw}': .*{says}"):
        Settings()


def test_the_documentation_shows_every_setting_once_as_declared() -> None:
    pages = "\n".join(
        docs_pages.on_page_markdown(p.read_text()) for p in sorted((ROOT / "docs").glob("*.md"))
    )
    for name, f in Settings.model_fields.items():
        variable = Settings.variable(name)
        rows = [line for line in pages.splitlines() if line.startswith(f"| `{variable}` |")]
        assert len(rows) == 1, (name, rows)
        assert rows[0].endswith(f"| {f.description} |") or "\\|" in rows[0], rows[0]
    for page in (ROOT / "docs").glob("*.md"):  # the tables come from the code, never by hand
        assert "| `CONVEYOR_SHARD_SIZE` |" not in page.read_text()
