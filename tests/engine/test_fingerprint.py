"""The model fingerprint: equal for the same checkpoint and numerics, different when anything
that decides the answers differs (weights under the same name, the template, the dtype), and
each weight file read once across restarts."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from conveyor.demo_model import write_tiny_model
from conveyor.engine import LLM
from conveyor.engine import fingerprint as fp


@pytest.fixture
def model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return write_tiny_model(tmp_path / "model", "llama")


def fingerprint_of(path: Path, **options) -> str:
    return LLM(str(path), **{"device": "cpu", "dtype": "float32", **options}).fingerprint


def test_the_same_checkpoint_gives_the_same_fingerprint_and_a_copy_too(model, tmp_path):
    first = fingerprint_of(model)
    assert first.startswith(fp.PREFIX) and first == fingerprint_of(model)
    copy = shutil.copytree(model, tmp_path / "elsewhere")
    assert fingerprint_of(copy) == first  # contents, not paths


def test_what_decides_the_answers_changes_it(model, tmp_path):
    first = fingerprint_of(model)
    assert fingerprint_of(model, dtype="bfloat16") != first
    assert fingerprint_of(model, batch_invariant=True) != first
    assert fingerprint_of(model, chat_template="{{ messages[0]['content'] }}") != first
    other = write_tiny_model(tmp_path / "other", "llama", seed=1)  # other weights, same config
    assert fingerprint_of(other) != first
    config = json.loads((model / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (model / "config.json").write_text(json.dumps(config))
    assert fingerprint_of(model) != first


def test_a_change_to_the_native_draw_changes_only_its_engines_fingerprints(model, monkeypatch):
    """The native draw's own rules (its top-p) are in the fingerprint of an engine that draws
    natively, and not in one that draws with torch, whose tokens they do not change."""
    from conveyor.engine import sampler
    from conveyor.kernels import native_layers

    if not native_layers.available(torch.float32):
        pytest.skip("no AVX2 and FMA: no native draw here")
    before = {draw: fingerprint_of(model, sampling=draw) for draw in ("native", "torch")}
    monkeypatch.setattr(sampler, "NATIVE_TOP_P", "top-p in the draw: some other rule")
    assert fingerprint_of(model, sampling="native") != before["native"]
    assert fingerprint_of(model, sampling="torch") == before["torch"]


def test_weight_files_are_read_once_until_they_change(model, monkeypatch):
    reads: list[str] = []
    digest = fp.DigestCache.digest

    def counting(self, file):
        key = f"{file.resolve()}|{file.stat().st_size}|{file.stat().st_mtime_ns}"
        if key not in self.entries:
            reads.append(file.name)
        return digest(self, file)

    monkeypatch.setattr(fp.DigestCache, "digest", counting)
    first = fingerprint_of(model)
    assert any(name.endswith(".safetensors") for name in reads)
    reads.clear()
    assert fingerprint_of(model) == first and reads == []  # a restart reads nothing again
    weights = next(model.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the weights rewritten in place
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(0, weights.stat().st_mtime_ns + 1))
    assert fingerprint_of(model) != first
    assert reads == [weights.name]  # only the file that changed
