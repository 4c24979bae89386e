"""The small tokenizers the tests run on, one of each layout: byte-level BPE (the demo
model's: GPT-2's byte table, tokens that split UTF-8 characters), sentencepiece-like (Llama 2's
`▁` spaces and byte fallback, the first space stripped) and WordPiece (`##` pieces, a `decode`
that cleans up spaces)."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from conveyor.demo_model import build_tokenizer

NAMES = ("byte_level", "sentencepiece", "wordpiece")
SAMPLE = "héllo wörld, €uro 日本語 🙂 it 's n't a . b ? ' c ! 10 + 2 = 12. The fox's den."
TEXTS = [SAMPLE, "Paris is the capital of France. Ça va? Größe 東京 ✓ ok", "ab " * 20]


def sentencepiece_like() -> Any:
    """Llama 2's layout: "▁" for spaces, byte fallback, the first space stripped."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Replace(" ", "▁")
    ascii_texts = [text.encode("ascii", "ignore").decode() for text in TEXTS]  # bytes: the rest
    trainer = trainers.BpeTrainer(vocab_size=200, show_progress=False)
    trained.train_from_iterator(ascii_texts * 4, trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for token in model["vocab"]:
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    return fast


def wordpiece_cleaned_up() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)
    special = ["[UNK]", "[CLS]", "[SEP]"]
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=special, show_progress=False)
    tok.train_from_iterator(TEXTS * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", cls_token="[CLS]",
        clean_up_tokenization_spaces=True,
    )  # fmt: skip


@cache
def tokenizer(name: str) -> Any:
    return {
        "byte_level": build_tokenizer,
        "sentencepiece": sentencepiece_like,
        "wordpiece": wordpiece_cleaned_up,
    }[name]()
