"""The wheel, installed for real (not editable) into a fresh virtual environment: what a
`pip install conveyor` user and the CPU worker image get. Its dependencies come from this
environment (a path entry, with none of this environment's `.pth` hooks, so the editable
install here is not seen); the commands run outside the repository."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conveyor.testing import batch_lines, write_jsonl
from tests.system.test_embedded import embedded_env, serving

ROOT = Path(__file__).resolve().parents[2]
OLD_TOP_LEVEL = ("api", "engine", "kernels", "ledger", "migrations", "worker")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built from a copy of the working tree's files (tracked, or new and not ignored): a
    `build/` left in the repository would lend the wheel files the package list forgets."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.split("\0")  # fmt: skip
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (built,) = out.glob("conveyor-*.whl")
    return built


@pytest.fixture(scope="module")
def venv_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    # this environment's packages as a plain path entry, after the venv's own
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return python


def run(python: Path, code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)} | env
    return subprocess.run([python, "-c", code], cwd=cwd, env=environ, capture_output=True,
                          text=True, timeout=600)  # fmt: skip


def test_the_wheel_holds_one_import_name_and_the_kernel_sources(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"conveyor"}
    for needed in ("conveyor/kernels/csrc/simd_bf16.h", "conveyor/kernels/csrc/layers_bf16.cpp",
                   "conveyor/kernels/csrc/paged_attention_bf16.cpp", "conveyor/api/ui/index.html",
                   "conveyor/migrations/env.py", "conveyor/migrations/script.py.mako"):  # fmt: skip
        assert needed in names, needed
    assert any(n.startswith("conveyor/migrations/versions/") for n in names)


def test_installed_conveyor_imports_alone(venv_python: Path, tmp_path: Path) -> None:
    code = (
        "import importlib.util, json, sys, conveyor\n"
        "from conveyor import LLM, SamplingParams\n"
        "print(json.dumps({'file': conveyor.__file__, 'engine': LLM.__module__,"
        f" 'old': {{n: s.origin for n in {OLD_TOP_LEVEL!r}"
        " if (s := importlib.util.find_spec(n))}}))\n"
    )
    done = run(venv_python, code, tmp_path)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    installed = venv_python.parents[1]
    assert seen["file"].startswith(str(installed))  # the wheel's, not the repo's
    assert seen["engine"] == "conveyor.engine.llm"
    # a name may be another installed package's (transformers brings Hugging Face's `kernels`),
    # never this repository's folder nor one the wheel put in the environment
    for name, origin in seen["old"].items():
        assert not origin.startswith(str(installed)), (name, origin)
        assert Path(origin).parent != ROOT / name, (name, origin)


def test_the_installed_cpu_kernels_build(venv_python: Path, tmp_path: Path) -> None:
    """The kernels' sources build from the installed package (a compiler does not need the
    instructions it compiles), and load and run where the CPU has the instructions: AVX512-BF16
    (and AMX) for the bfloat16 kernels, AVX2 and FMA for the float32 ones."""
    code = (
        "import torch\n"
        "from conveyor.kernels import cpu_build, native_experts, native_layers, native_paged\n"
        "from conveyor.kernels import native_paged_f32\n"
        "compiler = cpu_build.cxx()\n"
        "experts = native_experts.SOURCES\n"
        "for source, flags in ((native_layers.SOURCE, cpu_build.AVX512_BF16_FLAGS),\n"
        "                      (native_paged.SOURCE, cpu_build.AVX512_BF16_FLAGS),\n"
        "                      (native_layers.SOURCE_F32, cpu_build.AVX2_UNFUSED_FLAGS),\n"
        "                      (native_paged_f32.SOURCE, cpu_build.AVX2_FLAGS),\n"
        "                      (experts['avx2'], cpu_build.AVX2_FLAGS),\n"
        "                      (experts['avx512_bf16'], cpu_build.AVX512_BF16_FLAGS),\n"
        "                      (experts['amx'], cpu_build.AMX_FLAGS)):\n"
        "    built = cpu_build.build_library(compiler, source, flags)\n"
        "    assert built.is_file(), built\n"
        "print(native_layers.available(torch.bfloat16), cpu_build.cpu_has_avx512_bf16(),\n"
        "      native_layers.available(torch.float32), cpu_build.cpu_has_avx2(),\n"
        "      [isa for isa, _ in native_experts.kernels(torch.bfloat16)] ==\n"
        "      ['amx'] * cpu_build.cpu_has_amx_bf16()\n"
        "      + ['avx512_bf16'] * cpu_build.cpu_has_avx512_bf16())\n"
    )
    done = run(venv_python, code, tmp_path, XDG_CACHE_HOME=str(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr
    bf16, has_bf16, f32, has_avx2, experts_as_the_cpu_has = done.stdout.split()
    assert (bf16, f32, experts_as_the_cpu_has) == (has_bf16, has_avx2, "True")


def test_installed_serve_answers_a_batch(venv_python: Path, tmp_path: Path) -> None:
    """The README's first command, from the wheel: `conveyor serve` on embedded defaults (its
    demo model) answers a batch that `conveyor submit --wait` sends."""
    env = embedded_env(tmp_path / "data") | {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    with serving(str(venv_python), tmp_path, env) as (url, _):
        lines = batch_lines(4, max_tokens=4)
        for line in lines:
            del line["body"]["model"]  # `--model demo` fills it in
        path = write_jsonl(tmp_path / "in.jsonl", lines)
        out = tmp_path / "out.jsonl"
        done = subprocess.run(
            [str(venv_python), "-m", "conveyor", "submit", str(path), "--url", url,
             "--model", "demo", "--wait", "--poll", "0.3", "-o", str(out)],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    outputs = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(o["custom_id"] for o in outputs) == sorted(x["custom_id"] for x in lines)
    assert all(o["response"]["status_code"] == 200 for o in outputs), outputs
