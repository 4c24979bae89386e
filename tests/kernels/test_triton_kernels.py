"""The Triton paged-attention kernels against the torch reference: compiled, on the GPU, where
there is one; on Triton's CPU interpreter elsewhere.

Every kernel runs on randomly drawn shapes: shuffled, non-contiguous block tables, context
lengths that are not multiples of the block size, several GQA ratios, head sizes and block
sizes, fp32 and bf16 caches. References are computed in float64. Outputs are poisoned with NaN
before each run so that an element a kernel forgets to write fails the test.
"""

from __future__ import annotations

import os

import torch

# before triton compiles anything: without a GPU, run on the CPU
COMPILED = torch.cuda.is_available()
if not COMPILED:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = "cuda" if COMPILED else "cpu"

import random  # noqa: E402

import pytest  # noqa: E402

from conveyor.kernels import torch_paged as ref  # noqa: E402
from conveyor.kernels import triton_paged as tk  # noqa: E402
from tests.hf_reference import assert_greedy_matches_hf_through  # noqa: E402

TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 2e-2}
HEAD_SIZES = (64, 80, 96, 128, 256)


@pytest.fixture(autouse=True)
def on_the_kernels_device():
    """The tests' tensors on the GPU where the kernels run compiled."""
    with torch.device(DEVICE):
        yield


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "the kernel left elements unwritten (NaN poison)"
    return ((out.double() - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def random_cache(
    rng: random.Random,
    contexts: list[int],
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
):
    """Caches with each sequence's blocks scattered at random over a pool with spare blocks."""
    needed = [-(-n // block_size) for n in contexts]
    num_blocks = sum(needed) + 7
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    width = max(needed + [1])
    tables = torch.zeros(len(contexts), width, dtype=torch.long)
    at = 0
    for i, n in enumerate(needed):
        tables[i, :n] = torch.tensor(ids[at : at + n], dtype=torch.long)
        at += n
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape).to(dtype)
    v_cache = torch.randn(shape).to(dtype)
    return k_cache, v_cache, tables


def reference_decode(
    q, k_cache, v_cache, tables, contexts, scale, window=None, softcap=None
) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[1]
    for i, n in enumerate(contexts):
        if n == 0:
            continue
        first = 0 if window is None else max(0, n - window)
        k = ref.gather_context(k_cache.double(), tables[i], n)[:, first:]
        v = ref.gather_context(v_cache.double(), tables[i], n)[:, first:]
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        s = torch.einsum("hd,hnd->hn", q[i].double(), k) * scale
        p = (s if softcap is None else torch.tanh(s / softcap) * softcap).softmax(-1)
        out[i] = torch.einsum("hn,hnd->hd", p, v)
    return out


DECODE_CASES = [
    # (seed, batch, kv_heads, group, head_dim, block_size, dtype, num_splits)
    (0, 5, 2, 1, 64, 16, torch.float32, None),
    (1, 4, 2, 4, 80, 8, torch.float32, 3),
    (2, 3, 1, 8, 96, 32, torch.float32, 1),
    (3, 4, 2, 2, 128, 16, torch.bfloat16, 4),
    (4, 2, 1, 4, 256, 16, torch.float32, 2),
    (5, 4, 2, 3, 64, 32, torch.bfloat16, None),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"seed{c[0]}")
def test_paged_decode_matches_reference(case):
    seed, batch, kv_heads, group, head_dim, block_size, dtype, splits = case
    rng = random.Random(seed)
    torch.manual_seed(seed)
    contexts = [1] + [rng.randint(2, 2000) for _ in range(batch - 1)]
    contexts = [n + 1 if n % block_size == 0 else n for n in contexts]
    k_cache, v_cache, tables = random_cache(rng, contexts, kv_heads, head_dim, block_size, dtype)
    heads = kv_heads * group
    q = torch.randn(batch, heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    tk.paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(contexts), scale, num_splits=splits, out=out
    )
    want = reference_decode(q, k_cache, v_cache, tables, contexts, scale)
    assert rel_err(out, want) < TOLERANCE[dtype]


def test_decode_empty_and_single_token_contexts_give_no_nan():
    rng = random.Random(7)
    contexts = [0, 1, 0, 5]
    k_cache, v_cache, tables = random_cache(rng, contexts, 2, 64, 16, torch.float32)
    q = torch.randn(4, 4, 64)
    out = torch.full_like(q, float("nan"))
    tk.paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(contexts), 0.125, num_splits=3, out=out
    )
    assert not torch.isnan(out).any()
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], out[0])
    want = reference_decode(q, k_cache, v_cache, tables, contexts, 0.125)
    assert rel_err(out[[1, 3]], want[[1, 3]]) < 1e-3


def test_choose_num_splits():
    assert tk.choose_num_splits(batch=64, kv_heads=8, max_context_len=2048, num_sms=132) == 1
    few_long = tk.choose_num_splits(batch=8, kv_heads=8, max_context_len=32768, num_sms=132)
    assert few_long >= 4  # a few long sequences still fill the GPU
    assert tk.choose_num_splits(batch=1, kv_heads=1, max_context_len=100, num_sms=132) == 1


def test_warm_up_split_counts_cover_every_compiled_variant():
    """Every split count a step can choose compiles as the same variant (merge width, and
    the 1 / multiple-of-16 specialisations) as one that warm-up runs."""
    for most in (1, 7, 64):
        warmed = tk.split_counts_to_warm(most)
        assert max(warmed) <= most

        def variant(n: int) -> tuple[int, bool, bool]:
            return (tk._p2(n), n == 1, n % 16 == 0)

        assert {variant(n) for n in range(1, most + 1)} == {variant(n) for n in warmed}
    assert tk.split_counts_to_warm(64) == [1, 2, 3, 5, 9, 16, 17, 32, 33, 48]


def test_warm_up_runs_each_variant_over_each_kind_of_table_width(monkeypatch):
    """Decode at each split count and prefill, with block tables of 1, 2 and 16 columns."""
    rng = random.Random(3)
    k_cache, v_cache, _ = random_cache(rng, [40], 2, 64, 16, torch.bfloat16)
    decoded, prefilled = [], []
    decode, prefill = tk.paged_decode_attention, tk.paged_prefill_attention

    def spy_decode(q, kc, vc, tables, lens, scale, **kw):
        decoded.append((kw["num_splits"], tables.shape[1]))
        out = decode(q, kc, vc, tables, lens, scale, **kw)
        assert not torch.isnan(out).any()
        return out

    def spy_prefill(q, kc, vc, tables, *args, **kw):
        prefilled.append(tables.shape[1])
        return prefill(q, kc, vc, tables, *args, **kw)

    monkeypatch.setattr(tk, "paged_decode_attention", spy_decode)
    monkeypatch.setattr(tk, "paged_prefill_attention", spy_prefill)
    tk.warm_up(k_cache, v_cache, heads=4, max_context_len=4096)
    most = tk.choose_num_splits(1, 1, 4096, tk._num_sms(k_cache.device))
    counts = tk.split_counts_to_warm(most)
    assert sorted(decoded) == sorted((n, w) for n in counts for w in (1, 2, 16))
    assert sorted(prefilled) == [1, 2, 16]


def test_the_engine_warm_up_compiles_the_attention_variants(checkpoints, monkeypatch):
    from conveyor.engine import LLM

    calls = []
    monkeypatch.setattr(
        tk, "warm_up", lambda kc, vc, heads, longest, cap: calls.append((heads, longest, cap))
    )
    llm = LLM(str(checkpoints["qwen3"]), device=DEVICE, attention_backend="triton", dtype="float32")
    llm.warm_up()
    assert calls == [(llm.runner.model.num_heads, llm.max_model_len, None)]


def _launch_keys(kernel_class, monkeypatch) -> dict[str, set]:
    """The variants Triton would compile, recorded per phase as the kernels launch: each
    argument as Triton keys it (a tensor's dtype and 16-byte alignment, an integer as 1, a
    multiple of 16 or neither, unless the kernel says not to specialize on it), and the
    constexpr and launch settings."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    keys: dict[str, set] = {"phase": "warm-up", "warm-up": set(), "traffic": set()}
    run = kernel_class.run

    def key(arg, specialize: bool):
        if isinstance(arg, torch.Tensor | int | float) and not isinstance(arg, bool):
            return native_specialize_impl(BaseBackend, arg, False, specialize, True)
        return repr(arg)

    def recording_run(self, *args, grid, warmup, **kwargs):
        settings = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
        # by name, as the kernels give it (the interpreter's keep it in `kwargs`)
        kernel_settings = getattr(self, "kwargs", None) or vars(self)
        unspecialized = kernel_settings.get("do_not_specialize") or ()
        specialize = [name not in unspecialized for name in self.arg_names]
        keys[keys["phase"]].add((self.__name__, tuple(map(key, args, specialize)), settings))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(kernel_class, "run", recording_run)
    return keys


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_after_warm_up_traffic_meets_no_new_variant(checkpoints, monkeypatch, family):
    """Triton compiles a variant at its first launch: one met first in traffic is a stall of
    seconds in the middle of a step on a GPU. Mixed prompt lengths (block tables of every kind
    of width), chunked prefill beside decodes, a cached prefix and n > 1."""
    from conveyor.engine import LLM, SamplingParams

    keys = _launch_keys(type(tk._decode_split_kernel), monkeypatch)
    llm = LLM(str(checkpoints[family]), device=DEVICE, dtype="float32", attention_backend="triton",
              elementwise="triton", block_size=4, max_num_batched_tokens=32)  # fmt: skip
    llm.warm_up()
    keys["phase"] = "traffic"
    rng = random.Random(0)
    # tables 1 to 16 blocks wide; the longest prompt in two chunks beside the others' decodes
    prompts = [[rng.randrange(10, 200) for _ in range(n)] for n in (1, 6, 17, 61)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (2, 3, 4, 5)]
    llm.generate(prompts, params, use_tqdm=False)
    cached = prompts[3][:40] + [7, 8, 9]  # its first ten blocks from the cache
    llm.generate([cached, prompts[1]], SamplingParams(n=2, temperature=1.0, max_tokens=2, seed=1),
                 use_tqdm=False)  # fmt: skip
    assert keys["traffic"], "nothing was recorded: the hook missed the launches"
    new = sorted(keys["traffic"] - keys["warm-up"], key=str)
    assert not new, f"variants first launched in traffic: {new}"


def reference_prefill(
    q, k_cache, v_cache, tables, query_start, contexts, scale, window=None, softcap=None
):
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[1]
    for i, n in enumerate(contexts):
        a, b = query_start[i], query_start[i + 1]
        k = ref.gather_context(k_cache.double(), tables[i], n).repeat_interleave(group, dim=0)
        v = ref.gather_context(v_cache.double(), tables[i], n).repeat_interleave(group, dim=0)
        pos = torch.arange(n - (b - a), n)
        mask = torch.arange(n)[None, :] <= pos[:, None]
        if window is not None:
            mask &= torch.arange(n)[None, :] > pos[:, None] - window
        s = torch.einsum("qhd,hnd->hqn", q[a:b].double(), k) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        p = s.masked_fill(~mask, float("-inf")).softmax(-1)
        out[a:b] = torch.einsum("hqn,hnd->qhd", p, v)
    return out


PREFILL_CASES = [
    # (seed, kv_heads, group, head_dim, block_size, dtype, [(query_len, context_len), ...])
    (0, 2, 1, 64, 16, torch.float32, [(37, 37), (5, 150), (1, 1)]),
    (1, 2, 4, 80, 8, torch.float32, [(20, 300), (45, 45)]),
    (2, 1, 8, 96, 32, torch.bfloat16, [(33, 33), (17, 70)]),
    (3, 2, 2, 128, 16, torch.float32, [(16, 1999)]),  # a chunk after a long cached prefix
    (4, 1, 2, 256, 16, torch.bfloat16, [(9, 9), (30, 61)]),
]


def prefill_inputs(case):
    """A prefill case's queries, caches, tables, query starts, context lengths and scale."""
    seed, kv_heads, group, head_dim, block_size, dtype, shapes = case
    rng = random.Random(seed)
    torch.manual_seed(seed)
    contexts = [c for _, c in shapes]
    k_cache, v_cache, tables = random_cache(rng, contexts, kv_heads, head_dim, block_size, dtype)
    query_start = [0]
    for q_len, _ in shapes:
        query_start.append(query_start[-1] + q_len)
    q = torch.randn(query_start[-1], kv_heads * group, head_dim).to(dtype)
    scale = head_dim**-0.5
    return q, k_cache, v_cache, tables, query_start, contexts, scale


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"seed{c[0]}")
def test_paged_prefill_matches_reference(case):
    q, k_cache, v_cache, tables, query_start, contexts, scale = prefill_inputs(case)
    dtype = case[5]
    out = torch.full_like(q, float("nan"))
    tk.paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        tables,
        torch.tensor(query_start),
        torch.tensor(contexts),
        scale,
        out=out,
    )
    want = reference_prefill(q, k_cache, v_cache, tables, query_start, contexts, scale)
    assert rel_err(out, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_only_its_slots(dtype):
    torch.manual_seed(0)
    num_blocks, kv_heads, block_size, head_dim = 12, 2, 16, 80
    k_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim).to(dtype)
    slots = torch.tensor([5, -1, 17, 190, -1, 33, 0])
    key = torch.randn(len(slots), kv_heads, head_dim).to(dtype)
    value = torch.randn(len(slots), kv_heads, head_dim).to(dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    ref.write_kv(key[keep], value[keep], want_k, want_v, slots[keep])
    tk.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)  # the whole cache


def test_engine_greedy_matches_transformers_through_triton(checkpoints):
    """The CUDA path whole: Triton attention and Triton norms, rope (with Qwen3's q/k norms)
    and activation."""
    assert_greedy_matches_hf_through(
        checkpoints["qwen3"], "triton", seed=3, device=DEVICE, elementwise="triton"
    )


@pytest.mark.parametrize("window", [1, 40, 700])
@pytest.mark.parametrize("case", DECODE_CASES[:4], ids=lambda c: f"seed{c[0]}")
def test_paged_decode_honours_a_sliding_window(case, window):
    """Triton's decode and the torch reference's, over the last `window` tokens only."""
    seed, batch, kv_heads, group, head_dim, block_size, dtype, splits = case
    rng = random.Random(seed)
    torch.manual_seed(seed)
    contexts = [1, window, window + 1] + [rng.randint(2, 2000) for _ in range(batch)]
    k_cache, v_cache, tables = random_cache(rng, contexts, kv_heads, head_dim, block_size, dtype)
    q = torch.randn(len(contexts), kv_heads * group, head_dim).to(dtype)
    scale, lens = head_dim**-0.5, torch.tensor(contexts)
    want = reference_decode(q, k_cache, v_cache, tables, contexts, scale, window)
    out = torch.full_like(q, float("nan"))
    tk.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=splits,
                              out=out, window=window)  # fmt: skip
    assert rel_err(out, want) < TOLERANCE[dtype]
    eager = ref.decode_attention(q, k_cache, v_cache, tables, lens, scale, window=window)
    assert rel_err(eager, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("window", [1, 24, 100])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"seed{c[0]}")
def test_paged_prefill_honours_a_sliding_window(case, window):
    q, k_cache, v_cache, tables, query_start, contexts, scale = prefill_inputs(case)
    dtype = case[5]
    want = reference_prefill(q, k_cache, v_cache, tables, query_start, contexts, scale, window)
    out = torch.full_like(q, float("nan"))
    tk.paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor(query_start),
                               torch.tensor(contexts), scale, out=out, window=window)  # fmt: skip
    assert rel_err(out, want) < TOLERANCE[dtype]
    eager = ref.prefill_attention(q, k_cache, v_cache, tables, query_start, contexts, scale,
                                  window=window)  # fmt: skip
    assert rel_err(eager, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("case", DECODE_CASES[:4], ids=lambda c: f"seed{c[0]}")
def test_decode_and_prefill_soft_cap_the_scores(case):
    """Gemma 2's cap (here 0.7, so that it changes every score) in Triton's kernels and the
    torch reference's, decode and prefill, with and without a window."""
    seed, batch, kv_heads, group, head_dim, block_size, dtype, splits = case
    rng = random.Random(seed)
    torch.manual_seed(seed)
    contexts = [1] + [rng.randint(2, 600) for _ in range(batch)]
    k_cache, v_cache, tables = random_cache(rng, contexts, kv_heads, head_dim, block_size, dtype)
    q = torch.randn(len(contexts), kv_heads * group, head_dim).to(dtype)
    scale, lens, cap = head_dim**-0.5, torch.tensor(contexts), 0.7
    for window in (None, 50):
        want = reference_decode(q, k_cache, v_cache, tables, contexts, scale, window, cap)
        out = torch.full_like(q, float("nan"))
        tk.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=splits,
                                  out=out, window=window, softcap=cap)  # fmt: skip
        assert rel_err(out, want) < TOLERANCE[dtype]
        eager = ref.decode_attention(q, k_cache, v_cache, tables, lens, scale, window=window,
                                     softcap=cap)  # fmt: skip
        assert rel_err(eager, want) < TOLERANCE[dtype]
    # prefill: each sequence's last min(len, 9) tokens as its chunk
    starts = [0]
    for n in contexts:
        starts.append(starts[-1] + min(n, 9))
    pq = torch.randn(starts[-1], kv_heads * group, head_dim).to(dtype)
    for window in (None, 50):
        want = reference_prefill(pq, k_cache, v_cache, tables, starts, contexts, scale, window,
                                 cap)  # fmt: skip
        out = torch.full_like(pq, float("nan"))
        tk.paged_prefill_attention(pq, k_cache, v_cache, tables, torch.tensor(starts), lens,
                                   scale, out=out, window=window, softcap=cap)  # fmt: skip
        assert rel_err(out, want) < TOLERANCE[dtype]
        eager = ref.prefill_attention(pq, k_cache, v_cache, tables, starts, contexts, scale,
                                      window=window, softcap=cap)  # fmt: skip
        assert rel_err(eager, want) < TOLERANCE[dtype]


def test_engine_greedy_past_a_sliding_window_matches_transformers_through_triton(checkpoints):
    """Triton's decode and prefill kernels honour a layer's window (Gemma 3's local layer, 16
    tokens, on prompts of up to 90), and Gemma's norms run beside Triton's rope."""
    assert_greedy_matches_hf_through(
        checkpoints["gemma3"], "triton", seed=6, device=DEVICE, elementwise="triton"
    )


def test_engine_greedy_with_long_rope_on_part_of_each_head_matches_transformers_through_triton(
    tmp_path,
):
    """Phi-4-mini's shape beside Triton's kernels: LongRoPE over three quarters of each head
    (rope runs eager on that part); a prompt that grows past the original length, one past it
    from the start."""
    from conveyor.demo_model import write_tiny_model
    from conveyor.engine import LLM, SamplingParams
    from tests.engine.test_long_rope import ORIGINAL, long_rope_config
    from tests.hf_reference import hf_greedy_long_rope, random_prompts

    path = write_tiny_model(tmp_path / "phi", "phi3", partial_rotary_factor=0.75,
                            **long_rope_config(12))  # fmt: skip
    llm = LLM(str(path), device=DEVICE, dtype="float32", attention_backend="triton",
              elementwise="triton", block_size=8)  # fmt: skip
    prompts = random_prompts(2, ORIGINAL - 8, ORIGINAL + 12, seed=8)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=14), use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy_long_rope(path, prompt, 14)


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    from conveyor.kernels import get_attention_backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_attention_backend("triton", torch.device("cpu"))
    assert get_attention_backend("auto", torch.device("cpu")).name == "compiled"


def test_auto_falls_back_to_eager_attention_without_a_compiler(monkeypatch, caplog):
    from conveyor.kernels import compiled_paged, get_attention_backend

    monkeypatch.setattr(compiled_paged, "compiler_missing", lambda: "no C++ compiler (g++)")
    with caplog.at_level("WARNING"):
        assert get_attention_backend("auto", torch.device("cpu")).name == "torch"
    assert "no C++ compiler" in caplog.text


def test_kernel_benchmark_runs_or_says_there_is_no_gpu():
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, on a GPU
    done = subprocess.run(
        [sys.executable, "bench/triton_decode.py"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    expected = "goal:" if torch.cuda.is_available() else "no CUDA GPU"
    assert expected in done.stdout


@pytest.mark.gpu
def test_the_kernels_run_compiled_on_the_gpu():
    """Where there is a GPU, this file's kernels ran compiled on it, never interpreted."""
    assert COMPILED and DEVICE == "cuda"
    assert os.environ.get("TRITON_INTERPRET", "0") != "1"
    case = DECODE_CASES[3]  # bf16, split in 4
    test_paged_decode_matches_reference(case)
