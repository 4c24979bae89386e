"""What the CPU kernels are built with and where they are kept: the C++ compiler (`$CXX`, else
g++, else c++), and `$XDG_CACHE_HOME/conveyor/`, by default `~/.cache/conveyor/`, so that a
worker's second start loads them instead of compiling again."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# the flags of the AVX512-BF16 kernels in csrc/
AVX512_BF16_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma",
                     "-fopenmp", "-shared", "-fPIC")  # fmt: skip
# and of those that also use the AMX tile unit
AMX_FLAGS = (*AVX512_BF16_FLAGS, "-mamx-tile", "-mamx-bf16")
# the flags of the AVX2 float32 kernels
AVX2_FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
# and of those that round after every product and sum, as torch's eager ops do
AVX2_UNFUSED_FLAGS = (*AVX2_FLAGS, "-ffp-contract=off")
# the flags of a float32 kernel written on csrc/simd_f32.h, built for AVX-512's 16 lanes
AVX512_F32_FLAGS = ("-O3", "-mavx512f", "-mavx512dq", "-mfma", "-DCONVEYOR_AVX512", "-fopenmp",
                    "-shared", "-fPIC")  # fmt: skip


def cache_dir(*parts: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base, "conveyor", *parts)


def cxx() -> str | None:
    """The C++ compiler's path, or None when there is none on PATH."""
    return shutil.which(os.environ.get("CXX") or "g++") or shutil.which("c++")


@functools.cache
def _cpuinfo(field: str) -> str:
    """The first CPU's `field` in /proc/cpuinfo ("" where the kernel gives none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((x for x in text.splitlines() if x.startswith(field)), "")
    return line.partition(":")[2].strip()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags as the kernel reports them (none where it does not)."""
    return frozenset(_cpuinfo("flags").split())


def cpu_vendor() -> str:
    """The CPU's vendor as the kernel reports it ("GenuineIntel", "AuthenticAMD"; "" unknown)."""
    return _cpuinfo("vendor_id")


def cpu_has_avx512_bf16() -> bool:
    return {"avx512_bf16", "avx512bw"} <= cpu_flags()


def cpu_has_amx_bf16() -> bool:
    return {"amx_bf16", "amx_tile"} <= cpu_flags() and cpu_has_avx512_bf16()


def cpu_has_avx2() -> bool:
    return {"avx2", "fma"} <= cpu_flags()


def cpu_has_avx512_f32() -> bool:
    return {"avx512f", "avx512dq", "fma"} <= cpu_flags()


def build_library(compiler: str, source: Path, flags: tuple[str, ...]) -> Path:
    """The shared library of `source`, built once into the cache dir under a name hashed from
    the source, the headers beside it, the flags and the compiler's version."""
    headers = sorted(source.parent.glob("*.h"))
    text = b"".join(path.read_bytes() for path in (source, *headers))
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(text + " ".join(flags).encode() + version.encode()).hexdigest()[:16]
    target = cache_dir("kernels") / f"{source.stem}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # built beside the target and renamed: workers starting together never load half a file
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([compiler, *flags, "-o", str(built), str(source)], check=True,
                           capture_output=True, text=True)  # fmt: skip
            os.replace(built, target)
    return target


def load_avx512_bf16(source: Path, fallback: str) -> ctypes.CDLL | None:
    """One of csrc/'s AVX512-BF16 kernels, built if need be and loaded; None where this CPU
    lacks the instructions, or (logged, with `fallback`: what runs instead) where no compiler
    is found or the build fails."""
    if not cpu_has_avx512_bf16():
        return None
    return _load(source, AVX512_BF16_FLAGS, fallback)


def load_amx(source: Path, fallback: str) -> ctypes.CDLL | None:
    """One of csrc/'s AMX kernels (which use AVX512-BF16 too), as `load_avx512_bf16` loads its
    own."""
    if not cpu_has_amx_bf16():
        return None
    return _load(source, AMX_FLAGS, fallback)


def load_avx2(
    source: Path, fallback: str, flags: tuple[str, ...] = AVX2_FLAGS
) -> ctypes.CDLL | None:
    """One of csrc/'s AVX2 (and FMA) kernels, as `load_avx512_bf16` loads its own."""
    if not cpu_has_avx2():
        return None
    return _load(source, flags, fallback)


def load_avx512_f32(source: Path, fallback: str) -> ctypes.CDLL | None:
    """A float32 kernel written on csrc/simd_f32.h, built for AVX-512's 16 lanes, as
    `load_avx512_bf16` loads its own."""
    if not cpu_has_avx512_f32():
        return None
    return _load(source, AVX512_F32_FLAGS, fallback)


def load_f32_builds(source: Path, what: str, fallback: str) -> list[tuple[str, ctypes.CDLL | None]]:
    """A float32 kernel written on csrc/simd_f32.h, built for AVX-512's 16 lanes and for AVX2's
    8: each build's instruction set and library (None where it cannot be built or run here),
    the wider first. `what` names the kernel where only its AVX2 build loads; `fallback` says
    what runs where neither does."""
    return [
        ("avx512", load_avx512_f32(source, f"{what} uses its AVX2 build")),
        ("avx2", load_avx2(source, fallback)),
    ]


def _load(source: Path, flags: tuple[str, ...], fallback: str) -> ctypes.CDLL | None:
    compiler = cxx()
    if compiler is None:
        log.warning("%s: no C++ compiler; %s", source.name, fallback)
        return None
    try:
        return ctypes.CDLL(str(build_library(compiler, source, flags)))
    except (OSError, subprocess.CalledProcessError) as err:
        log.warning("%s did not build (%s); %s", source.name, err, fallback)
        return None
