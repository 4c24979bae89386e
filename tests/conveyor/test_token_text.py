"""A token's logprob `bytes` are the tokenizer's own, for every token of each layout the tests
run on: what the tokenizer writes for the token in the middle of a text, byte for byte, where
that is whole characters; a piece of a character is its raw bytes, which put together with the
rest of the character are the character's UTF-8. Special and added tokens are their text."""

from __future__ import annotations

from typing import Any

import pytest

from conveyor.demo_model import build_tokenizer
from conveyor.wire_format.token_text import TokenDecoder, byte_table
from tests.tiny_tokenizers import NAMES, TEXTS, tokenizer

TABLED = ("byte_level", "sentencepiece")  # the layouts llguidance reads: bytes of their own


def in_context(tok: Any, ids: list[int]) -> str:
    """What `ids` decode to after a plain token: as in the middle of a text (a sentencepiece
    tokenizer strips the space of the first token of a text only)."""
    anchor = tok.encode("a", add_special_tokens=False)
    return tok.decode(anchor + ids, skip_special_tokens=False)[len(tok.decode(anchor)) :]


@pytest.mark.parametrize("name", TABLED)
def test_every_token_has_the_bytes_the_tokenizer_writes(name: str) -> None:
    tok = tokenizer(name)
    decoder = TokenDecoder(tok)
    special = set(tok.all_special_ids)
    for token_id in range(len(tok)):
        raw = bytes(decoder.bytes(token_id))
        written = tok.decode([token_id]) if token_id in special else in_context(tok, [token_id])
        if "\ufffd" in written:  # a piece of a character: written as U+FFFD, kept whole here
            assert raw.decode("utf-8", "replace") == written, (token_id, raw, written)
        else:
            assert raw == written.encode("utf-8"), (token_id, raw, written)


@pytest.mark.parametrize("name", TABLED)
@pytest.mark.parametrize("text", TEXTS)
def test_the_bytes_of_a_text_s_tokens_are_its_utf8(name: str, text: str) -> None:
    # accents, CJK and an emoji: characters split across tokens (byte-level pieces, byte fallback)
    tok = tokenizer(name)
    ids = tok.encode(text, add_special_tokens=False)
    decoder = TokenDecoder(tok)
    assert b"".join(bytes(decoder.bytes(i)) for i in ids) == in_context(tok, ids).encode()


@pytest.mark.parametrize(("name", "piece"), [("byte_level", "ÿ"), ("sentencepiece", "<0xFF>")])
def test_the_byte_0xff_is_itself(name: str, piece: str) -> None:
    # never in UTF-8 text, and llguidance's own mark of a special token: still one byte, 255
    tok = tokenizer(name)
    assert TokenDecoder(tok).bytes(tok.convert_tokens_to_ids(piece)) == [0xFF]


def test_special_and_added_tokens_are_as_the_tokenizer_writes_them() -> None:
    tok = build_tokenizer()
    tok.add_tokens(["café"])
    tok.add_special_tokens({"additional_special_tokens": ["<|tool▁call|>"]})
    decoder = TokenDecoder(tok)
    special, added = tok.convert_tokens_to_ids(["<|tool▁call|>", "café"])
    assert bytes(decoder.bytes(special)) == "<|tool▁call|>".encode()  # its ▁ is no space
    # a token added to a byte-level tokenizer goes through its byte table as the others do
    # (the tokenizer writes it `caf\ufffd`): its é is the one byte 0xE9
    assert bytes(decoder.bytes(added)) == b"caf\xe9" and decoder.text(added) == "caf\ufffd"


def test_wordpiece_has_no_table_and_gives_each_token_s_text() -> None:
    tok = tokenizer("wordpiece")
    assert byte_table(tok) is None  # llguidance reads no WordPiece decoder
    decoder = TokenDecoder(tok)
    for token_id in range(len(tok)):
        assert decoder.bytes(token_id) == list(decoder.text(token_id).encode())


@pytest.mark.parametrize("name", NAMES)
def test_an_id_past_the_vocabulary_is_its_text(name: str) -> None:
    # a model's embedding may be wider than its tokenizer: such an id decodes to its text
    tok = tokenizer(name)
    decoder = TokenDecoder(tok)
    assert decoder.bytes(len(tok) + 3) == list(tok.decode([len(tok) + 3]).encode())


def test_without_a_tokenizer_a_token_is_its_id() -> None:
    decoder = TokenDecoder(None)
    assert decoder.text(7) == "token_id:7" and decoder.bytes(7) == list(b"token_id:7")
    assert decoder.decode([7, 8]) == "token_id:7token_id:8"
