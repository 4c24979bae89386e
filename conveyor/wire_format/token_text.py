"""Token ids as text and as raw bytes, for the logprobs of result lines."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-to-printable-character map, inverted."""
    keep = list(range(ord("!"), ord("~") + 1))
    keep += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


class TokenDecoder:
    """Token id -> text (for logprob entries) and raw bytes, cached, from a HF tokenizer.

    Without a tokenizer, tokens are shown as `token_id:<id>`.
    """

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._byte_level = False
        if tokenizer is not None:
            backend = getattr(tokenizer, "backend_tokenizer", None)
            decoder = getattr(backend, "decoder", None)
            self._byte_level = "ByteLevel" in type(decoder).__name__
            if not self._byte_level and backend is not None:
                try:
                    spec = json.loads(backend.to_str()).get("decoder") or {}
                    self._byte_level = "ByteLevel" in json.dumps(spec)
                except Exception:
                    self._byte_level = False
        self._table = _byte_level_table() if self._byte_level else {}

    def text(self, token_id: int) -> str:
        cached = self._text.get(token_id)
        if cached is None:
            if self.tokenizer is None:
                cached = f"token_id:{token_id}"
            else:
                cached = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._text[token_id] = cached
        return cached

    def bytes(self, token_id: int) -> list[int]:
        cached = self._bytes.get(token_id)
        if cached is None:
            cached = self._raw_bytes(token_id)
            self._bytes[token_id] = cached
        return cached

    def decode(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return "".join(self.text(t) for t in token_ids)
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def _raw_bytes(self, token_id: int) -> list[int]:
        if self.tokenizer is not None:
            try:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
            except Exception:
                piece = None
            if isinstance(piece, str):
                special = getattr(self.tokenizer, "all_special_tokens", ()) or ()
                if piece not in special:
                    if self._byte_level and all(c in self._table for c in piece):
                        return [self._table[c] for c in piece]
                    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                        try:  # sentencepiece byte-fallback token
                            return [int(piece[3:5], 16)]
                        except ValueError:
                            pass
                    if not self._byte_level and "\u2581" in piece:
                        return list(piece.replace("\u2581", " ").encode("utf-8"))
        return list(self.text(token_id).encode("utf-8"))
