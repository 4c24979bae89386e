"""Each setting is declared once (`conveyor.settings.setting`): read from its variable by its
type, and shown in the documentation's tables as declared."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from conveyor.settings import Settings
from docs.hooks import generated as docs_pages

ROOT = Path(__file__).resolve().parents[2]
# a value of each type, as a variable holds it, and as the setting then holds it
SAMPLES = {"int": ("7", 7), "float": ("2.5", 2.5), "Path": ("/x/y", Path("/x/y"))}


def sample(kind: str, name: str) -> tuple[str, object]:
    for prefix, pair in SAMPLES.items():
        if kind.startswith(prefix):
            return pair
    return {"auth": (" Required ", "required"), "log_format": ("JSON", "json")}.get(
        name, ("9m", "9m") if name == "max_completion_window" else ("postgresql://h/db",) * 2
    )


def test_every_setting_is_read_from_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = {}
    for f in fields(Settings):
        raw, value = sample(str(f.type), f.name)
        monkeypatch.setenv(f.metadata["env"], raw)
        expected[f.name] = value
    settings = Settings.from_env()
    assert {name: getattr(settings, name) for name in expected} == expected


def test_unset_or_blank_variables_leave_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for f in fields(Settings):
        monkeypatch.setenv(f.metadata["env"], " ")
    assert Settings.from_env() == Settings()


def test_a_variable_that_is_not_a_number_is_refused_by_name(monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_HEARTBEAT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="CONVEYOR_HEARTBEAT_TIMEOUT must be a number"):
        Settings.from_env()


def test_the_documentation_shows_every_setting_once_as_declared() -> None:
    pages = "\n".join(
        docs_pages.on_page_markdown(p.read_text()) for p in sorted((ROOT / "docs").glob("*.md"))
    )
    for f in fields(Settings):
        rows = [
            line for line in pages.splitlines() if line.startswith(f"| `{f.metadata['env']}` |")
        ]
        assert len(rows) == 1, (f.name, rows)
        assert rows[0].endswith(f"| {f.metadata['doc']} |") or "\\|" in rows[0], rows[0]
    for page in (ROOT / "docs").glob("*.md"):  # the tables come from the code, never by hand
        assert "| `CONVEYOR_SHARD_SIZE` |" not in page.read_text()
