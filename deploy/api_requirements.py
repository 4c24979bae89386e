"""Print the project's dependencies without the engine's (torch and the model stack): what
the API image installs. `python deploy/api_requirements.py > requirements.txt`"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

# packages only the engine (workers, run-batch) needs; the API never imports them
ENGINE_PACKAGES = {"torch", "transformers", "safetensors", "tokenizers", "huggingface-hub", "numpy"}


def project_name(requirement: str) -> str:
    name = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert name, requirement
    return re.sub(r"[-_.]+", "-", name.group(0)).lower()


def api_requirements(pyproject: Path) -> list[str]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if project_name(d) not in ENGINE_PACKAGES]


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[1]
    sys.stdout.write("".join(f"{d}\n" for d in api_requirements(root / "pyproject.toml")))
