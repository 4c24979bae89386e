"""bfloat16, the default on CPUs with fast bfloat16 products: `dtype="auto"` resolves by the
CPU's capabilities, the engine's logprobs stay within a stated tolerance of transformers' in
bfloat16, and greedy decoding agrees with transformers' bfloat16 greedy decoding at the rate
printed (and bounded below) here."""

from __future__ import annotations

import pytest
import torch

from conveyor.engine import LLM, SamplingParams, dtypes
from conveyor.kernels import cpu_build
from tests.hf_reference import ARCHS, random_prompts

# bfloat16 keeps 8 bits of mantissa (a logit of ~10 is known to ~0.04), and the engine sums in
# another order than transformers (paged attention, fused projections), so logprobs differ by
# a few of those steps
LOGPROB_TOLERANCE = 0.05
MIN_GREEDY_AGREEMENT = 0.9  # share of generated tokens equal to transformers' (per position)
# a mixture of experts' router is discontinuous: where two experts' scores nearly tie, a
# rounding difference upstream sends the token to the other expert, and that position's
# logprob moves by more than rounding; that many positions in 100 may (seen: 1 of 357)
ROUTING_FLIPS_PER_100 = 1
MOE_ARCHS = {"mixtral", "qwen2_moe", "qwen3_moe"}


@pytest.fixture(scope="module")
def hf_bf16():
    """transformers' model of a checkpoint in bfloat16, and in float32 (`load(path, float32)`)."""
    from transformers import AutoModelForCausalLM

    models = {}

    def load(path, dtype=torch.bfloat16):
        if (path, dtype) not in models:
            models[path, dtype] = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=dtype
            ).eval()
        return models[path, dtype]

    return load


def test_auto_is_bfloat16_exactly_where_the_cpu_has_fast_bfloat16(monkeypatch):
    cpu = torch.device("cpu")
    for fast, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(dtypes, "cpu_has_fast_bfloat16", lambda fast=fast: fast)
        assert dtypes.resolve_dtype("auto", torch.float32, cpu) == want
    cuda = torch.device("cuda", 0)
    assert dtypes.resolve_dtype("auto", torch.float16, cuda) == torch.float16
    assert dtypes.resolve_dtype("bf16", torch.float32, cpu) == torch.bfloat16
    # a float32 checkpoint (or a config naming no dtype) computes in half precision on a GPU
    for capability, want in (((9, 0), torch.bfloat16), ((7, 5), torch.float16)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _, c=capability: c)
        assert dtypes.resolve_dtype("auto", torch.float32, cuda) == want
    assert dtypes.resolve_dtype("float32", torch.float32, cuda) == torch.float32


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "vendor", "fast"),
    [
        (True, True, "GenuineIntel", True),  # Sapphire Rapids and later
        (False, True, "AuthenticAMD", True),  # Zen 4 and 5
        (False, True, "GenuineIntel", False),  # Cooper Lake, or AMX hidden by a VM
        (False, False, "GenuineIntel", False),
        (False, False, "AuthenticAMD", False),
    ],
)
def test_bfloat16_is_fast_where_its_products_outrun_float32(
    monkeypatch, amx, avx512_bf16, vendor, fast
):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(cpu_build, "cpu_vendor", lambda: vendor)
    dtypes.cpu_has_fast_bfloat16.cache_clear()
    try:
        assert dtypes.cpu_has_fast_bfloat16() is fast
    finally:
        dtypes.cpu_has_fast_bfloat16.cache_clear()


def test_auto_keeps_a_16_bit_checkpoint_that_float32_would_not_fit(monkeypatch, caplog):
    cpu = torch.device("cpu")
    monkeypatch.setattr(dtypes, "cpu_has_fast_bfloat16", lambda: False)
    monkeypatch.setattr(dtypes, "total_memory_bytes", lambda: 16 * 2**30)
    fits, too_big = (lambda: 4 * 2**30), (lambda: 10 * 2**30)  # in float32, of 16 GiB
    assert dtypes.resolve_dtype("auto", torch.bfloat16, cpu, fits) == torch.float32
    with caplog.at_level("WARNING", logger="conveyor.engine.dtypes"):
        assert dtypes.resolve_dtype("auto", torch.bfloat16, cpu, too_big) == torch.bfloat16
    assert "10.0 GiB of 16.0 GiB" in caplog.text
    assert dtypes.resolve_dtype("auto", torch.float16, cpu, too_big) == torch.float16
    assert dtypes.resolve_dtype("auto", torch.float32, cpu, too_big) == torch.float32
    assert dtypes.resolve_dtype("float32", torch.bfloat16, cpu, too_big) == torch.float32
    monkeypatch.setattr(dtypes, "cpu_has_fast_bfloat16", lambda: True)
    assert dtypes.resolve_dtype("auto", torch.bfloat16, cpu, too_big) == torch.bfloat16


def test_a_float32_model_of_a_bfloat16_checkpoint_counts_its_experts_at_2_bytes(tmp_path):
    from safetensors.torch import save_file

    from conveyor.engine.loader import float32_weight_bytes

    save_file(
        {
            "model.embed_tokens.weight": torch.zeros(10, 4, dtype=torch.bfloat16),
            "model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(6, 4, dtype=torch.bfloat16),
            "model.layers.0.mlp.shared_expert.up_proj.weight": torch.zeros(
                6, 4, dtype=torch.bfloat16
            ),
            "model.norm.weight": torch.zeros(4, dtype=torch.float32),
        },
        tmp_path / "model.safetensors",
    )
    assert float32_weight_bytes(tmp_path) == 40 * 4 + 24 * 2 + 24 * 4 + 4 * 4


def test_a_cuda_device_with_no_gpu_is_refused_naming_why(monkeypatch):
    from conveyor.engine.llm_engine import _resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA GPU is visible"):
        _resolve_device("cuda")
    with pytest.raises(ValueError, match="no CUDA GPU is visible"):
        _resolve_device("cuda:1")


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_logprobs_and_greedy_agree_with_transformers(checkpoints, hf_bf16, arch):
    flips = ROUTING_FLIPS_PER_100 if arch in MOE_ARCHS else 0
    check_against_transformers(checkpoints[arch], hf_bf16, arch, flips)


def test_bfloat16_through_our_kernels_agrees_with_transformers(tmp_path, hf_bf16, monkeypatch):
    """A head size of 64, the commonest: its decode and prefill attention run through
    `native_paged`, and its norms, rope and activation through `native_layers`, which round
    where transformers' eager modules do."""
    from conveyor.demo_model import write_tiny_model
    from conveyor.kernels import native_layers, native_paged

    if not cpu_build.cpu_has_avx512_bf16():
        pytest.skip("this CPU has no AVX512-BF16, so the kernels do not run")
    path = write_tiny_model(
        tmp_path / "llama64", "llama", hidden_size=128, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    calls = set()
    for module, name in ((native_paged, "decode_attention"), (native_layers, "rms_norm"),
                         (native_layers, "rope"), (native_layers, "silu_mul")):  # fmt: skip
        kernel = getattr(module, name)
        counted = lambda *a, k=kernel, n=name, **kw: calls.add(n) or k(*a, **kw)  # noqa: E731
        monkeypatch.setattr(module, name, counted)
    check_against_transformers(path, hf_bf16, "llama, head size 64")
    assert calls == {"decode_attention", "rms_norm", "rope", "silu_mul"}


@pytest.mark.parametrize(
    "arch, shape",
    [
        ("mistral", dict(sliding_window=16)),
        # a windowed layer and a global one, both with capped scores; smaller weights, as at
        # 0.08 this Gemma 2's bfloat16 logprobs stray past the tolerance through any attention
        ("gemma2", dict(sliding_window=16, head_dim=64, query_pre_attn_scalar=64,
                        attn_logit_softcapping=0.5, init_std=0.02)),
    ],
)  # fmt: skip
def test_windowed_and_capped_layers_run_the_bfloat16_kernel_and_agree(
    tmp_path, hf_bf16, monkeypatch, arch, shape
):
    """The bfloat16 attention kernel reads a windowed layer's last `sliding_window` positions
    and caps a layer's scores as transformers does, past the window."""
    from conveyor.demo_model import write_tiny_model
    from conveyor.kernels import native_paged

    if not cpu_build.cpu_has_avx512_bf16():
        pytest.skip("this CPU has no AVX512-BF16, so the kernel does not run")
    path = write_tiny_model(
        tmp_path / arch, arch, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
        **shape,
    )  # fmt: skip
    seen = set()
    for name in ("decode_attention", "prefill_attention"):
        kernel = getattr(native_paged, name)

        def counted(*args, k=kernel, n=name, **kwargs):
            seen.add((n, args[-2], args[-1]))  # the backend passes window, softcap last
            return k(*args, **kwargs)

        monkeypatch.setattr(native_paged, name, counted)
    check_against_transformers(path, hf_bf16, f"{arch} {shape}, head size 64")
    windows = {window for _, window, _ in seen}
    caps = {cap for _, _, cap in seen}
    assert 16 in windows and {n for n, *_ in seen} == {"decode_attention", "prefill_attention"}
    assert caps == ({0.5} if arch == "gemma2" else {None})


def check_against_transformers(
    path, hf, label: str, flips_per_100: int = 0, tolerance: float = LOGPROB_TOLERANCE
) -> None:
    """The engine in bfloat16 against transformers in bfloat16 (`hf(path)`): greedy tokens, and
    every prompt and sampled token's logprob within `tolerance`, except where the two round
    differently and the engine is the nearer of them to the float32 model (`hf(path,
    torch.float32)`): two bfloat16 implementations that round in different places (the
    attention kernels keep scores and weights in float32, transformers' eager attention rounds
    them to bfloat16) may part by more than `tolerance`, and only a parting away from float32
    is an error."""
    model, exact = hf(path), hf(path, torch.float32)
    llm = LLM(str(path), device="cpu", dtype="bfloat16")
    assert llm.dtype == torch.bfloat16
    prompts = random_prompts(8, 8, 80, seed=11)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0, prompt_logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    differences, beyond, agree, total = [], [], 0, 0
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            ids = torch.tensor([prompt + tokens])
            reference = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            truth = torch.log_softmax(exact(ids).logits[0].float(), dim=-1)
        # the prompt's logprobs and the generated tokens' (each given the engine's prefix)
        entries = [(i - 1, prompt[i], entry[prompt[i]])
                   for i, entry in enumerate(out.prompt_logprobs[1:], start=1)]  # fmt: skip
        for j, (token, entry) in enumerate(zip(tokens, out.outputs[0].logprobs, strict=True)):
            row = reference[len(prompt) - 1 + j]
            entries.append((len(prompt) - 1 + j, token, entry[token]))
            agree += int(row.argmax()) == token
            total += 1
        for row, token, logprob in entries:
            bf16, f32 = float(reference[row, token]), float(truth[row, token])
            differences.append(abs(logprob - bf16))
            if abs(logprob - bf16) >= tolerance and abs(logprob - f32) > abs(bf16 - f32):
                beyond.append(abs(logprob - bf16))
    rate = agree / total
    beyond.sort()
    print(f"{label}: bfloat16 greedy agreement {rate:.1%} of {total} tokens, largest logprob "
          f"difference {max(differences):.3f}, {len(beyond)} of {len(differences)} beyond "
          f"{tolerance} and further from float32")  # fmt: skip
    assert len(beyond) <= flips_per_100 * len(differences) / 100, beyond
    assert rate >= MIN_GREEDY_AGREEMENT


def test_after_warm_up_no_step_compiles_again(checkpoints):
    """The worker warms its engine up before taking work; whatever token counts and batch
    sizes come after (1, a count equal to the head count, thousands) reuse the same compiled
    norm and rope graphs: a compile would stall live requests for seconds."""
    import torch._dynamo

    # blocks of 5: the warm-up prompt is 4 tokens, as many as the model's heads, the
    # coincidence duck sizing turned into a graph for "tokens == heads" only
    llm = LLM(str(checkpoints["llama"]), device="cpu", dtype="bfloat16", block_size=5,
              elementwise="compiled")  # fmt: skip
    assert llm.runner.backend.name == "compiled"
    llm.warm_up()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    heads = llm.runner.model.model.layers[0].self_attn.num_heads
    lengths = [1, 2, heads, heads + 1, 37, 300]
    prompts = [[(7 * i + j) % 100 + 3 for j in range(n)] for i, n in enumerate(lengths)]
    llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    llm.generate(prompts[:1], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_the_memory_a_process_may_use_is_its_cgroups_limit_where_lower(monkeypatch, tmp_path):
    import os

    from conveyor.engine import cpu_memory

    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = tmp_path / "memory.max"
    monkeypatch.setattr(cpu_memory, "CGROUP_MEMORY_MAX", limit)
    assert cpu_memory.total_memory_bytes() == machine  # no cgroup file
    for text, want in (("max\n", machine), (f"{2**30}\n", 2**30), (f"{2 * machine}", machine)):
        limit.write_text(text)
        assert cpu_memory.total_memory_bytes() == want, text
