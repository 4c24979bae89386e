"""transformers as the reference for the engine and the kernels: its greedy continuations and
log-probabilities, random prompts, and the engine's greedy equality with it through one
attention backend."""

from __future__ import annotations

import functools
from pathlib import Path
from unittest import mock

import torch

# the families of `checkpoints` (tests/conftest.py)
ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "olmo2", "phi3", "mixtral", "qwen2_moe",
         "qwen3_moe")  # fmt: skip


@functools.cache
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.cache
def _hf_greedy(
    path: str, prompt: tuple[int, ...], max_new_tokens: int, use_cache: bool = True
) -> tuple[int, ...]:
    """transformers' greedy continuation of one unpadded prompt (it stops at EOS, as we do)."""
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            use_cache=use_cache,
        )
    return tuple(out[0, len(prompt) :].tolist())


def hf_greedy(
    path: Path, prompt: list[int], max_new_tokens: int, use_cache: bool = True
) -> list[int]:
    """transformers' greedy continuation; without its cache, every token comes from a forward
    pass over the whole sequence so far."""
    return list(_hf_greedy(str(path), tuple(prompt), max_new_tokens, use_cache))


def hf_greedy_long_rope(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation under LongRoPE, as its Phi-3 `generate` means it: a
    sequence that grows past the original length has all of its K/V computed again on the long
    factors. Its `generate` does that by dropping its cache at that point, in the versions where
    that override takes effect (transformers 5.17 kept the cache, its keys on the short
    factors); without a cache every step is that computation, in every version."""
    return hf_greedy(path, prompt, max_new_tokens, use_cache=False)


def hf_logprobs(path: Path, token_ids: list[int]) -> torch.Tensor:
    """log-softmax of transformers' logits at every position of `token_ids`: [len, vocab]."""
    with torch.no_grad():
        logits = hf_model(str(path))(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def random_prompts(
    count: int, min_len: int, max_len: int, vocab: int = 512, seed: int = 0
) -> list[list[int]]:
    """`count` random token-id prompts; the first is `min_len` and the second `max_len` long."""
    g = torch.Generator().manual_seed(seed)
    lengths = [min_len, max_len] + torch.randint(
        min_len, max_len + 1, (count - 2,), generator=g, device="cpu"
    ).tolist()
    # avoid the special ids 0..2 so prompts never contain EOS
    return [torch.randint(3, vocab, (n,), generator=g, device="cpu").tolist() for n in lengths]


def assert_greedy_matches_hf_through(
    path: Path,
    attention_backend: str,
    seed: int,
    device: str = "cpu",
    elementwise: str = "auto",
    experts: str = "auto",
) -> None:
    """The engine's greedy equality with transformers through one attention backend (and
    `elementwise` and `experts` kinds): mixed lengths, long prompts split across steps, and a
    prompt whose prefix comes from the cache."""
    from conveyor.engine import LLM, SamplingParams
    from conveyor.kernels.cascade import plan_cascade

    prompts = random_prompts(6, 1, 90, seed=seed)
    max_tokens = [6, 3, 8, 5, 1, 7]
    llm = LLM(
        str(path),
        device=device,
        dtype="float32",
        block_size=8,
        max_num_batched_tokens=48,
        attention_backend=attention_backend,
        elementwise=elementwise,
        experts=experts,
    )
    assert llm.runner.backend.name == attention_backend
    assert elementwise in ("auto", llm.plan.elementwise)
    assert experts in ("auto", llm.plan.experts)
    params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, m, out in zip(prompts, max_tokens, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, m)

    # prompt 1 (90 tokens) left its blocks in the cache; these prompts start with its first
    # five and take them from there; the CPU backends read them once for all four (cascade)
    prefix = prompts[1][:40]
    shared = [prefix + tail for tail in random_prompts(4, 1, 20, seed=seed + 1)]
    plans = []

    def recording_plan(*args):
        plans.append(plan := plan_cascade(*args))
        return plan

    with mock.patch("conveyor.engine.model_runner.plan_cascade", recording_plan):
        again = llm.generate(shared, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    for prompt, out in zip(shared, again, strict=True):
        assert out.num_cached_tokens == 40
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 6)
    used = [plan for plan in plans if plan is not None]
    if attention_backend == "triton":
        assert not used  # its kernels read the pages in place; no cascade there
    else:
        assert any(plan.suffix.num_prefills for plan in used)
        assert any(plan.suffix.num_decode_tokens for plan in used)
