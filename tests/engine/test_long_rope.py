"""LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini) and rope over part of each head (Phi-4-mini):
greedy equal to transformers on both sides of `original_max_position_embeddings` — prompts
shorter than it whose output runs past it, and prompts longer than it — with prefix caching,
chunked prefill and preemption on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conveyor.demo_model import write_tiny_model
from conveyor.engine import LLM, SamplingParams
from conveyor.engine.models.layers import LongRope
from tests.hf_reference import hf_greedy_long_rope, random_prompts

ORIGINAL = 48  # original_max_position_embeddings: the long factors start past it
HEAD_DIM = 16


def long_rope_config(rotary_dim: int) -> dict:
    half = rotary_dim // 2
    return dict(
        max_position_embeddings=4 * ORIGINAL,
        original_max_position_embeddings=ORIGINAL,  # Phi3Config copies it into the rope's
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": ORIGINAL,
            # far apart, so that a token read with the wrong set changes the answer
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 3.0 * i for i in range(half)],
        },
    )


@pytest.fixture(scope="module")
def phi(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("long-rope")
    return {
        "longrope": write_tiny_model(root / "longrope", "phi3", **long_rope_config(HEAD_DIM)),
        # Phi-4-mini's shape: LongRoPE over three quarters of each head
        "partial-longrope": write_tiny_model(
            root / "partial-longrope",
            "phi3",
            partial_rotary_factor=0.75,
            **long_rope_config(HEAD_DIM * 3 // 4),
        ),  # fmt: skip
        "partial": write_tiny_model(root / "partial", "phi3", partial_rotary_factor=0.5),
    }


# prompts below ORIGINAL whose outputs cross it, one at it, and prompts past it
PROMPTS = random_prompts(8, 20, 100, seed=11) + [random_prompts(2, ORIGINAL, ORIGINAL, seed=12)[0]]
MAX_TOKENS = [40, 12, 35, 30, 8, 45, 20, 33, 10]
CONFIGS = {
    "default": {},
    "block-8-chunked-prefill": {"block_size": 8, "max_num_batched_tokens": 24},
    "tiny-pool-preempts": {"block_size": 8, "num_kv_blocks": 24, "max_model_len": 160},
    "eager": {"attention_backend": "torch", "elementwise": "eager"},
}


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("model", ["longrope", "partial-longrope", "partial"])
def test_greedy_on_both_sides_of_the_original_length_matches_transformers(phi, model, config):
    path = phi[model]
    llm = LLM(str(path), device="cpu", dtype="float32", **CONFIGS[config])
    long_rope = llm.runner.model.long_rope
    assert (long_rope and long_rope.original_max) == (ORIGINAL if "longrope" in model else None)
    params = [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert any(len(p) < ORIGINAL < len(p) + m for p, m in zip(PROMPTS, MAX_TOKENS, strict=True))
    assert any(len(p) > ORIGINAL for p in PROMPTS)
    for prompt, m, out in zip(PROMPTS, MAX_TOKENS, outputs, strict=True):
        want = hf_greedy_long_rope(path, prompt, m)
        assert out.outputs[0].token_ids == want, f"{len(prompt)} tokens"
    if config == "tiny-pool-preempts":
        assert llm.stats().num_preemptions > 0


def test_long_and_short_sequences_share_cached_blocks_only_with_their_own_kind(phi):
    """A prompt past the original length starts with a short one's cached blocks, computed on
    the short factors: it computes its own. A sequence that grew past that length computed its
    KV again on the long factors, which a long prompt with its tokens then reuses."""
    path = phi["longrope"]
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=8)
    short = random_prompts(2, 40, 40, seed=5)[0]
    long = short + random_prompts(2, 30, 30, seed=6)[0]

    def run(prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
        before = llm.stats().prompt_tokens_cached
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert out == hf_greedy_long_rope(path, prompt, max_tokens)
        return out, llm.stats().prompt_tokens_cached - before

    assert run(short, 6)[1] == 0
    assert run(long, 6)[1] == 0  # not the short prompt's 5 blocks
    assert run(short, 6)[1] == 32  # its own 4 blocks (one token is always computed)
    assert run(long, 6)[1] == 64
    crossed, _ = run(short, 20)  # 40 + 20 tokens: computed again, long, at 49
    assert run(short + crossed[:15], 4)[1] == 48  # the long blocks of the one that crossed


def test_long_rope_rows_follow_the_sequences_factors():
    rope = LongRope(original_max=8, offset=100)
    assert not rope.is_long(8) and rope.is_long(9)
    assert list(rope.rows(6, 3, rope_long=False)) == [6, 7, 8]
    assert list(rope.rows(0, 3, rope_long=True)) == [100, 101, 102]


def test_the_long_factors_change_the_answer(phi, tmp_path):
    """The same weights with the long factors equal to the short ones answer otherwise past the
    original length: the tests above would catch a model that never read the long rows."""
    path = phi["longrope"]
    same = tmp_path / "same"
    shutil.copytree(path, same)
    config = json.loads((same / "config.json").read_text())
    config["rope_parameters"]["long_factor"] = config["rope_parameters"]["short_factor"]
    (same / "config.json").write_text(json.dumps(config))
    prompt, params = PROMPTS[1], SamplingParams(temperature=0, max_tokens=20)
    assert len(prompt) > ORIGINAL
    a = LLM(str(path), device="cpu", dtype="float32").generate([prompt], params, use_tqdm=False)
    b = LLM(str(same), device="cpu", dtype="float32").generate([prompt], params, use_tqdm=False)
    assert a[0].outputs[0].token_ids != b[0].outputs[0].token_ids
