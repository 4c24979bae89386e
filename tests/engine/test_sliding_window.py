"""A model whose attention keeps a sliding window (Mistral's `sliding_window`) is never run past
it with full attention: the engine serves sequences no longer than the window, where the window
holds them whole and full attention gives transformers' answer, and refuses a longer
max_model_len in words."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.demo_model import write_tiny_model
from conveyor.engine import LLM, SamplingParams
from conveyor.engine.loader import attention_window, load_config
from tests.hf_reference import hf_greedy, random_prompts

WINDOW = 24
ENGINE = dict(device="cpu", dtype="float32", block_size=8, num_kv_blocks=64)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("mistral"), "mistral", sliding_window=WINDOW)


def test_the_window_is_read_where_the_family_uses_it(tmp_path: Path, mistral: Path) -> None:
    assert attention_window(load_config(mistral)) == WINDOW
    full = write_tiny_model(tmp_path / "full", "mistral", with_tokenizer=False)
    assert attention_window(load_config(full)) is None
    # Qwen2 configs carry a sliding_window that only use_sliding_window turns on
    qwen2 = write_tiny_model(tmp_path / "q", "qwen2", with_tokenizer=False, sliding_window=8)
    assert attention_window(load_config(qwen2)) is None


def test_sequences_are_capped_at_the_window_and_match_transformers(mistral: Path) -> None:
    llm = LLM(str(mistral), **ENGINE)
    assert llm.max_model_len == WINDOW
    prompts = random_prompts(3, 6, 12, seed=3)
    params = SamplingParams(temperature=0, max_tokens=WINDOW, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        ids = out.outputs[0].token_ids
        assert len(prompt) + len(ids) == WINDOW  # stopped at the window, never past it
        assert out.outputs[0].finish_reason == "length"
        assert ids == hf_greedy(mistral, prompt, len(ids))


def test_a_max_model_len_past_the_window_is_refused_in_words(mistral: Path) -> None:
    with pytest.raises(ValueError, match=r"sliding attention window \(24 tokens\)"):
        LLM(str(mistral), max_model_len=WINDOW * 2, **ENGINE)
    assert LLM(str(mistral), max_model_len=16, **ENGINE).max_model_len == 16
