"""Incremental detokenization equals the whole decode: the text as it comes, where a stop
string ends it, and the streamed deltas, over a byte-level BPE tokenizer (tokens that split
UTF-8 characters), a sentencepiece-like one (byte fallback, a leading space stripped) and a
WordPiece one whose `decode` cleans up spaces; fast tokenizers by their DecodeStream, others
by windows of their `decode`; special tokens skipped and kept.

Stop strings never hold U+FFFD: the whole decode of a prefix shows an unfinished character
as U+FFFD, where the text as it comes waits for the character."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.engine.detokenizer import INCOMPLETE, TextDecoding
from conveyor.engine.output_text import OutputText
from conveyor.engine.outputs import CompletionOutput, RequestOutput
from conveyor.engine.sampling_params import SamplingParams
from conveyor.wire_format.request_line import parse_request_line
from conveyor.wire_format.streaming import ChunkStream
from conveyor.wire_format.token_text import TokenDecoder
from tests.tiny_tokenizers import TEXTS, tokenizer


class PythonOnly:
    """A tokenizer without a `tokenizers` backend, as a python-only one is."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        if name == "backend_tokenizer":
            raise AttributeError(name)
        return getattr(self._tokenizer, name)


@cache
def decoding(name: str, fast: bool) -> TextDecoding:
    tok = tokenizer(name)
    return TextDecoding(tok if fast else PythonOnly(tok))


@cache
def likely_ids(name: str) -> list[int]:
    """Ids of the sample texts and the special tokens: where characters split across tokens."""
    tok = tokenizer(name)
    ids = {i for text in TEXTS for i in tok.encode(text, add_special_tokens=False)}
    return sorted(ids | set(tok.all_special_ids))


@cache
def whole_characters(name: str) -> list[list[int]]:
    """The byte-fallback ids of each sample character that has them."""
    tok = tokenizer(name)
    chars = [tok.encode(c, add_special_tokens=False) for c in set("".join(TEXTS))]
    return [ids for ids in chars if any(_is_byte(tok, i) for i in ids)]


def _is_byte(tok: Any, token_id: int) -> bool:
    return tok.convert_ids_to_tokens(token_id).startswith("<0x")


TOKENIZERS = st.sampled_from(["byte_level", "sentencepiece", "wordpiece"])


def _pieces(name: str) -> st.SearchStrategy[list[int]]:
    """Ids a stream is made of: any one id, but where bytes fall back to byte tokens, a
    character's bytes whole (ByteFallback makes every byte of a run that is not UTF-8 U+FFFD,
    those of characters given out already too)."""
    tok = tokenizer(name)
    one = st.one_of(st.sampled_from(likely_ids(name)), st.integers(0, len(tok) - 1))
    if not whole_characters(name):
        return one.map(lambda i: [i])
    one = one.filter(lambda i: not _is_byte(tok, i)).map(lambda i: [i])
    return st.one_of(one, st.sampled_from(whole_characters(name)))


@st.composite
def token_streams(draw: st.DrawFn) -> tuple[str, bool, bool, list[int]]:
    name, fast, skip = draw(TOKENIZERS), draw(st.booleans()), draw(st.booleans())
    encoded = st.sampled_from(TEXTS).map(
        lambda text: tokenizer(name).encode(text, add_special_tokens=False)
    )
    pieces = st.lists(_pieces(name), max_size=30).map(lambda ps: [i for p in ps for i in p])
    return name, fast, skip, draw(st.one_of(pieces, encoded))


def decode(name: str, ids: list[int], skip: bool) -> str:
    return tokenizer(name).decode(ids, skip_special_tokens=skip)


@settings(max_examples=400, deadline=None)
@given(stream=token_streams())
def test_the_text_as_it_comes_is_the_whole_decode(stream):
    name, fast, skip, ids = stream
    detokenizer = decoding(name, fast).detokenizer(skip)
    text = ""
    for k, token in enumerate(ids, 1):
        text += detokenizer.step(token)
        assert not text.endswith(INCOMPLETE)
        so_far = decode(name, ids[:k], skip)
        if not so_far.endswith(INCOMPLETE):  # (ByteFallback makes a whole run of bytes U+FFFD)
            assert text + detokenizer.held == so_far
    assert text + detokenizer.flush() == decode(name, ids, skip)


def whole_decode_stop(name, ids, skip, stops, include):
    """Where the whole decode of each prefix first holds a stop string: the token, the stop
    string and the text."""
    for k in range(1, len(ids) + 1):
        text = decode(name, ids[:k], skip)
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            pos, stop = min(hits)
            return k, stop, text[: pos + len(stop) if include else pos]
    return None, None, decode(name, ids, skip)


def incremental_stop(name, fast, ids, params):
    out = OutputText(decoding(name, fast).detokenizer(params.skip_special_tokens), params)
    texts = []
    for k, token in enumerate(ids, 1):
        stop = out.append(token, k)
        if stop is not None:
            return (k, stop, out.final()), texts
        texts.append(out.text)
    return (None, None, out.final()), texts


@st.composite
def stop_cases(draw: st.DrawFn):
    name, fast, skip, ids = draw(token_streams())
    whole = decode(name, ids, skip)
    inside = st.tuples(st.integers(0, len(whole)), st.integers(1, 6)).map(
        lambda cut: whole[cut[0] : cut[0] + cut[1]]
    )
    stop = st.one_of(inside, st.text(min_size=1, max_size=4), st.sampled_from(["日", "ö", "'s"]))
    stops = draw(st.lists(stop.filter(lambda s: s and INCOMPLETE not in s), min_size=1, max_size=3))
    include = draw(st.booleans())
    params = SamplingParams(
        stop=stops, skip_special_tokens=skip, include_stop_str_in_output=include, max_tokens=None
    )
    return name, fast, ids, params


@settings(max_examples=400, deadline=None)
@given(case=stop_cases())
def test_a_stop_string_ends_the_text_where_the_whole_decode_finds_it(case):
    name, fast, ids, params = case
    want = whole_decode_stop(
        name, ids, params.skip_special_tokens, params.stop, params.include_stop_str_in_output
    )
    got, _ = incremental_stop(name, fast, ids, params)
    assert got == want


def completion_request(params: SamplingParams) -> Any:
    body = {"model": "m", "prompt": "p", "stop": params.stop,
            "include_stop_str_in_output": params.include_stop_str_in_output}  # fmt: skip
    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": body}
    return parse_request_line(json.dumps(line), line=1)


def output_of(text: str, ids: list[int], finished: bool) -> RequestOutput:
    comp = CompletionOutput(0, text, ids, None, None, "stop" if finished else None)
    return RequestOutput("r", None, [1], None, [comp], finished=finished, num_cached_tokens=0)


@settings(max_examples=300, deadline=None)
@given(case=stop_cases())
def test_streamed_deltas_join_to_the_final_text(case):
    name, fast, ids, params = case
    (_, _, final), texts = incremental_stop(name, fast, ids, params)
    stream = ChunkStream([completion_request(params)], 1, "m", TokenDecoder(None), chat=False)
    chunks = []
    for k, text in enumerate(texts, 1):
        chunks += stream.chunks(0, output_of(text, ids[:k], finished=False))
    chunks += stream.chunks(0, output_of(final, ids, finished=True))
    deltas = [c["choices"][0]["text"] for c in chunks]
    assert "".join(deltas) == final
    assert not any(d.endswith(INCOMPLETE) for d in deltas[:-1] if not final.endswith(d))


def test_min_tokens_looks_for_stop_strings_only_in_the_text_after_them():
    tok = tokenizer("byte_level")
    ids = tok.encode("ab cd ab cd", add_special_tokens=False)
    params = SamplingParams(stop=["ab"], min_tokens=3, max_tokens=None)
    (k, stop, text), _ = incremental_stop("byte_level", True, ids, params)
    assert stop == "ab" and text == "ab cd " and decode("byte_level", ids[:k], True) == "ab cd ab"


def test_the_cleanup_and_the_stream_choice_are_asked_of_the_tokenizer():
    assert decoding("wordpiece", True)._cleans_up
    assert not decoding("byte_level", True)._cleans_up
    assert decoding("sentencepiece", True)._backend is not None
    assert decoding("sentencepiece", False)._backend is None


def test_a_stream_whose_text_goes_back_on_itself_goes_on():
    """ByteFallback turns a run of bytes that is not UTF-8 into U+FFFD, a byte given out as
    text already too; the stream then goes on past the old text's length, as vLLM's does."""
    tok = tokenizer("sentencepiece")
    ids = [*tok.convert_tokens_to_ids(["<0x00>", "<0x80>"]), tok.encode("a")[-1]]
    for fast in (True, False):
        detokenizer = decoding("sentencepiece", fast).detokenizer(True)
        assert [detokenizer.step(i) for i in ids] == ["\x00", "", "\ufffda"]
    assert decode("sentencepiece", ids, True) == "\ufffd\ufffda"
