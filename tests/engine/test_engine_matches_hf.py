"""Greedy outputs of our engine equal transformers' `generate`, token for token."""

from __future__ import annotations

import pytest
import torch

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.kv_layout import KVLayout
from conveyor.engine.loader import load_config
from conveyor.engine.models.decoder import layer_windows
from tests.hf_reference import ARCHS, hf_greedy, random_prompts

PROMPTS = random_prompts(24, 1, 300, seed=1)
MAX_TOKENS = [1 + (7 * i) % 24 for i in range(len(PROMPTS))]  # 1..24, mixed

CONFIGS = {
    "default": {},
    "tiny-pool-preempts": {"num_kv_blocks": 24, "max_model_len": 384},
    "chunked-prefill": {"max_num_batched_tokens": 64},
    "block-8": {"block_size": 8},
    "block-32": {"block_size": 32},
    "no-prefix-caching": {"enable_prefix_caching": False},
    "few-seqs": {"max_num_seqs": 3},
}
# every family runs with prefix caching, preemption and chunked prefill; the engine's other
# settings change nothing a family's code sees, so Llama alone runs them
FAMILY_CONFIGS = ("default", "tiny-pool-preempts", "chunked-prefill")
CASES = [(arch, config) for arch in ARCHS for config in CONFIGS
         if arch == "llama" or config in FAMILY_CONFIGS]  # fmt: skip


def run(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize(("arch", "config"), CASES)
def test_greedy_matches_transformers(checkpoints, arch, config):
    path = checkpoints[arch]
    options = dict(CONFIGS[config])
    groups = KVLayout.of(layer_windows(load_config(path))).num_groups
    if "num_kv_blocks" in options:  # a block of each KV group per position (Gemma: two)
        options["num_kv_blocks"] *= groups
    llm = LLM(str(path), device="cpu", dtype="float32", **options)
    outputs = run(llm)
    for prompt, max_tokens, got in zip(PROMPTS, MAX_TOKENS, outputs, strict=True):
        want = hf_greedy(path, prompt, max_tokens)
        assert got == want, f"prompt of {len(prompt)} tokens diverged"
    stats = llm.stats()
    assert stats.kv_blocks_used == 0, "every block is released once all requests end"
    assert stats.num_running == stats.num_waiting == 0
    if config == "tiny-pool-preempts":
        # where windowed layers give their blocks back the pool is no longer short
        # (test_hybrid_kv_cache preempts those)
        assert stats.num_preemptions > 0 or groups > 1
    else:
        assert stats.num_preemptions == 0
    if config == "chunked-prefill":
        # a 300-token prompt needs at least five 64-token steps before its first token
        assert max(len(p) for p in PROMPTS) > 4 * 64
        assert stats.num_steps >= 5
    if config == "no-prefix-caching":
        assert stats.kv_blocks_cached == 0 and stats.prompt_tokens_cached == 0


def test_mixed_prompts_in_one_batch_do_not_disturb_each_other(checkpoints):
    """Requests that arrive while others decode give the same tokens as when run alone."""
    path = checkpoints["llama"]
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=128)
    params = SamplingParams(temperature=0, max_tokens=12)
    llm.add_request("a", PROMPTS[2], params)
    for _ in range(4):
        llm.step()
    llm.add_request("b", PROMPTS[3], params)
    done = {}
    while llm.has_unfinished():
        done.update({o.request_id: o for o in llm.step()})
    assert done["a"].outputs[0].token_ids == hf_greedy(path, PROMPTS[2], 12)
    assert done["b"].outputs[0].token_ids == hf_greedy(path, PROMPTS[3], 12)


def test_bfloat16_runs_and_mostly_agrees(checkpoints):
    """Half precision is a supported dtype; its first greedy token agrees with float32."""
    path = checkpoints["qwen2"]
    llm = LLM(str(path), device="cpu", dtype="bfloat16")
    out = llm.generate(PROMPTS[:8], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    agree = sum(
        o.outputs[0].token_ids == hf_greedy(path, p, 1) for o, p in zip(out, PROMPTS, strict=False)
    )
    assert agree >= 6
    assert llm.runner.kv_caches[0][0].dtype == torch.bfloat16
