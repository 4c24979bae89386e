"""The documentation: a README a user reads in minutes, and the site under docs/, built with
`--strict` (a broken link or a missing page fails it), its generated parts generated."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from conveyor.cli.engine_options import add_engine_arguments

ROOT = Path(__file__).resolve().parents[1]
README_MOST_LINES = 250


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    # no -q: mkdocs counts warnings for --strict only as it logs them
    env = os.environ | {"NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_the_readme_is_short_and_links_to_pages_that_exist() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MOST_LINES
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert links, "the README points to the documentation"
    for link in links:
        assert (ROOT / link).is_file(), link


def test_the_site_builds_strictly_with_its_generated_parts(tmp_path: Path) -> None:
    built = build(ROOT, tmp_path / "site")
    assert built.returncode == 0, built.stderr
    configuration = (tmp_path / "site" / "configuration" / "index.html").read_text()
    parser = __import__("argparse").ArgumentParser()
    for dest in add_engine_arguments(parser):  # every engine flag, from EngineConfig
        assert f"CONVEYOR_{dest.upper()}" in configuration, dest
    benchmarks = (tmp_path / "site" / "benchmarks" / "index.html").read_text()
    assert "{{" not in benchmarks and "{{" not in configuration
    for record in sorted((ROOT / "bench" / "results").glob("*.jsonl")):
        assert f"bench/results/{record.name}" in benchmarks, record.name


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copytree(ROOT / "bench" / "results", copy / "bench" / "results")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    page = copy / "docs" / "service.md"
    page.write_text(page.read_text() + "\nSee [the missing page](missing.md).\n")
    built = build(copy, tmp_path / "site")
    assert built.returncode != 0
    assert "missing.md" in built.stderr
