"""Token ids as text and as raw bytes, for the logprobs of result lines."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def byte_table(tokenizer: Any) -> Any | None:
    """llguidance's table of each token's bytes (byte-level pieces, byte fallback, `▁` spaces,
    added and special tokens), made from the `tokenizers` backend of `tokenizer`; None where it
    has none or llguidance cannot read its decoder (WordPiece, for one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    import llguidance

    try:
        return llguidance.LLTokenizer(backend.to_str())
    except (ValueError, RuntimeError):  # what llguidance raises for a decoder it cannot read
        return None


class TokenDecoder:
    """Token id -> text (for logprob entries) and raw bytes, cached, from a HF tokenizer.

    A token's bytes are the tokenizer's own, from llguidance's table (made at the first bytes
    asked for): a piece of a character is its bytes, not U+FFFD. Where there is no table (a
    tokenizer without a `tokenizers` backend, or ids past its vocabulary) they are the UTF-8 of
    the token's text. Without a tokenizer, tokens are shown as `token_id:<id>`.
    """

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._table: Any | None = None
        self._table_made = tokenizer is None

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
            if not self._table_made:
                self._table, self._table_made = byte_table(self.tokenizer), True
            if self._table is not None and 0 <= token_id < self._table.vocab_size:
                cached = list(self._table.decode_bytes([token_id]))
                if not cached and self._table.is_special_token(token_id):
                    # llguidance marks a special token by a leading byte 0xFF, so the token of
                    # that byte alone (byte-level `ÿ`, byte fallback `<0xFF>`) reads as empty
                    cached = [0xFF]
            else:
                cached = list(self.text(token_id).encode("utf-8"))
            self._bytes[token_id] = cached
        return cached

    def decode(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return "".join(self.text(t) for t in token_ids)
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)
