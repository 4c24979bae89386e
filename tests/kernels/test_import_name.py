"""This folder is `conveyor.kernels`; where a checkout's root is on sys.path it is also the
top-level `kernels`, the name of Hugging Face's kernel hub, which transformers imports (a
dependency of it since 5.25). That name must reach the installed package."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

IMPORT_BOTH = """
import sys
import conveyor.kernels
try:
    import kernels
except ImportError as e:
    print("ImportError", e)
    sys.exit(0)
print(kernels.__file__)
print(conveyor.kernels.__file__)
"""


def run_in_checkout(code: str) -> list[str]:
    """`python -c` at the checkout's root: its root first on sys.path, as `python -m pytest`."""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_the_top_level_name_reaches_the_installed_kernels_package():
    lines = run_in_checkout(IMPORT_BOTH)
    try:
        installed = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        assert lines[0].startswith("ImportError no package 'kernels' is installed")
        return
    hub, ours = (Path(line).resolve() for line in lines)
    assert hub == Path(installed.locate_file("kernels/__init__.py")).resolve()
    assert ours == ROOT / "kernels" / "__init__.py"


def test_transformers_models_load_at_the_checkouts_root():
    lines = run_in_checkout(
        "import transformers\n"
        "config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=8,"
        " intermediate_size=8, num_attention_heads=2, vocab_size=16)\n"
        "print(type(transformers.AutoModelForCausalLM.from_config(config)).__name__)"
    )
    assert lines == ["LlamaForCausalLM"]
