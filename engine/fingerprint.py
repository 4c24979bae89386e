"""A model's fingerprint: one hash over everything that decides what an engine answers, so that
two results can be known to come from the same weights, tokenizer, templates and numerics.

It covers the contents of the checkpoint's weight files, its config, tokenizer files, chat
template and `generation_config.json`, and the engine's numerics (Conveyor's version, the dtype,
the implementation chosen for each piece on this device, batch-invariant mode). The same model
name over other weights gets another fingerprint.

Reading 16 GB of weights takes a while, so each file's digest is cached by its resolved path,
size and modification time (a JSON file under `$XDG_CACHE_HOME/conveyor/`, by default
`~/.cache/conveyor/`, beside the compiled kernels): a restart reads nothing again, and a file
rewritten in place is read anew.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# what a checkpoint holds that changes its answers (weights by suffix, the rest by name)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
)
DIGEST_CACHE = "file_digests.json"
PREFIX = "fp-"


def engine_version() -> str:
    try:
        return importlib.metadata.version("conveyor")
    except importlib.metadata.PackageNotFoundError:  # run from a tree that is not installed
        return "unknown"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "conveyor"


def model_files(model_path: Path) -> list[Path]:
    """The checkpoint's files that decide its answers, by name."""
    found = [
        p
        for p in sorted(model_path.iterdir())
        if p.is_file() and (p.name in MODEL_FILES or p.suffix in WEIGHT_SUFFIXES)
    ]
    if not any(p.suffix in WEIGHT_SUFFIXES for p in found):
        raise ValueError(f"{model_path} holds no weight file to fingerprint")
    return found


class DigestCache:
    """File digests by (resolved path, size, mtime), kept in a JSON file; a cache that cannot
    be read or written only costs a new read of the files."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.entries: dict[str, str] = json.loads(path.read_text())
        except (OSError, ValueError):
            self.entries = {}
        self.changed = False

    def digest(self, file: Path) -> str:
        stat = file.stat()
        key = f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
        if key not in self.entries:
            with file.open("rb") as f:
                self.entries[key] = hashlib.file_digest(f, "blake2b").hexdigest()
            self.changed = True
        return self.entries[key]

    def save(self) -> None:
        if not self.changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.entries, sort_keys=True))
            tmp.replace(self.path)
        except OSError as err:
            log.warning("could not keep the file digests in %s: %s", self.path, err)


def model_fingerprint(model_path: Path, chat_template: str | None, numerics: dict[str, Any]) -> str:
    """The fingerprint of the checkpoint at `model_path` run with `chat_template` (the one in
    force, which may come from a flag) under `numerics`."""
    cache = DigestCache(cache_dir() / DIGEST_CACHE)
    h = hashlib.blake2b(digest_size=16)
    for file in model_files(model_path):
        h.update(f"{file.name}\0{cache.digest(file)}\0".encode())
    cache.save()
    h.update(f"chat_template\0{chat_template or ''}\0".encode())
    h.update(json.dumps(numerics, sort_keys=True, default=str).encode())
    return PREFIX + h.hexdigest()
