"""Incremental detokenization: a sequence's text as its tokens come, each token decoded once
with a few before it, never the whole output again.

Text comes out only once no later token can change it: not while it ends in an incomplete
UTF-8 character (U+FFFD), and, where the tokenizer's `decode` cleans up spaces before
punctuation (`clean_up_tokenization_spaces`), not while a later token could take a space
back. Everything that came out, followed by `flush()` at the end, is what `tokenizer.decode`
of all the ids gives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

INCOMPLETE = "\ufffd"  # what a decoder gives for the bytes of a character not all there yet
# DecodeStream's error where a window's text is not the start of the longer window's
_INVALID_PREFIX = "Invalid prefix"
# transformers' clean_up_tokenization removes the space of " ." " ?" " !" " ," " ' " " n't"
# " 'm" " 's" " 've" " 're": only after one of these characters can a later one take text back
_CLEANUP_PENDING = frozenset(" 'nvr")


class Detokenizer(Protocol):
    def step(self, token_id: int) -> str:
        """The text `token_id` completes ("" while it completes none)."""
        ...

    def flush(self) -> str:
        """The text still held back, at the end of the sequence."""
        ...

    @property
    def held(self) -> str:
        """Text held back that a later token could still change (not an incomplete
        character): where stop strings are looked for, it counts as text already."""
        ...


class WindowDetokenizer:
    """vLLM's prefix/read-offset algorithm, over any `decode(ids)`: only the tokens since the
    text before the last one that came out are decoded, twice (with and without the new)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._window: list[int] = []  # from the prefix offset on
        self._read = 0  # how many of the window's tokens are in the text given out
        self._prefix: str | None = ""  # the text of those; None: not decoded yet

    def step(self, token_id: int) -> str:
        self._window.append(token_id)
        return self._emit(self._next_text())

    def flush(self) -> str:
        if self._read == len(self._window):
            return ""
        return self._decode(self._window)[len(self._prefix_text()) :]

    @property
    def held(self) -> str:
        return ""

    def _next_text(self) -> str | None:
        text, prefix = self._decode(self._window), self._prefix_text()
        if len(text) > len(prefix) and not text.endswith(INCOMPLETE):
            return text[len(prefix) :]
        return None

    def _prefix_text(self) -> str:
        if self._prefix is None:
            self._prefix = self._decode(self._window[: self._read])
        return self._prefix

    def _emit(self, text: str | None) -> str:
        if text is None:
            return ""
        del self._window[: self._read]
        self._read, self._prefix = len(self._window), None
        return text


class StreamDetokenizer(WindowDetokenizer):
    """A fast tokenizer's `DecodeStream` (the same algorithm, in Rust); the window is kept
    beside it for `flush` and to start it again where its text goes back on itself."""

    def __init__(self, backend: Tokenizer, skip_special_tokens: bool) -> None:
        super().__init__(lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens))
        self._backend = backend
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        self._window.append(token_id)
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception as err:
            if not str(err).startswith(_INVALID_PREFIX):
                raise
            # as vLLM's: the text past the old text's length, and a stream started again
            text = self._emit(self._next_text())
            self._stream = DecodeStream(skip_special_tokens=self._skip)
            for token in self._window:
                self._stream.step(self._backend, token)
            return text
        return self._emit(text)


class CleanedDetokenizer:
    """The text of `raw` cleaned as the tokenizer's `decode` cleans it. A cleanup rule
    starts at a space and spans at most four characters, all kept but the spaces: text
    cleaned up to a character that starts no rule's tail is cleaned as the whole would be."""

    def __init__(self, raw: Detokenizer, clean: Callable[[str], str]) -> None:
        self._raw = raw
        self._clean = clean
        self._pending = ""  # raw text a later one could still change

    def step(self, token_id: int) -> str:
        self._pending += self._raw.step(token_id)
        end = len(self._pending)
        while end and self._pending[end - 1] in _CLEANUP_PENDING:
            end -= 1
        done, self._pending = self._pending[:end], self._pending[end:]
        return self._clean(done) if done else ""

    def flush(self) -> str:
        text, self._pending = self._pending + self._raw.flush(), ""
        return self._clean(text) if text else ""

    @property
    def held(self) -> str:
        return self._clean(self._pending)


class TextDecoding:
    """How one tokenizer's outputs are decoded: a detokenizer per sequence, as its `decode`
    would give the text (fast tokenizers by their `DecodeStream`, others by windows of their
    `decode`), and the whole `decode`."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if isinstance(backend, Tokenizer) else None
        self._cleans_up = _cleans_up_spaces(tokenizer)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool) -> Detokenizer:
        raw: Detokenizer
        if self._backend is not None:
            raw = StreamDetokenizer(self._backend, skip_special_tokens)
        else:
            raw = WindowDetokenizer(
                lambda ids: self.tokenizer.decode(
                    ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
                )
            )
        if self._cleans_up:
            return CleanedDetokenizer(raw, self.tokenizer.clean_up_tokenization)
        return raw


def _cleans_up_spaces(tokenizer: Any) -> bool:
    """Whether the tokenizer's `decode` cleans up spaces, asked of it (transformers applies
    `clean_up_tokenization_spaces` to some tokenizers and not others, by version)."""
    ids = tokenizer.encode("a . b 's", add_special_tokens=False)
    return tokenizer.decode(ids) != tokenizer.decode(ids, clean_up_tokenization_spaces=False)
