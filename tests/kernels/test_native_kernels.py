"""The AVX512-BF16 attention kernels (`kernels.native_paged`) against the reference on the same
bfloat16 inputs, decode and prefill (the prefill on AMX's tile unit too), their build cache, and
which kernel the compiled backend picks."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels import cpu_build, get_attention_backend, native_experts, native_paged
from conveyor.kernels import torch_paged as ref
from tests.kernels.test_kernels import on_thread_counts, paged_setup, poison_past_contexts

pytestmark = pytest.mark.skipif(
    not cpu_build.cpu_has_avx512_bf16(), reason="this CPU has no AVX512-BF16"
)


# each prefill kernel: on AMX's tile unit (where this CPU has it) and on the dot products
PREFILL = [
    pytest.param("amx", id="amx",
                 marks=pytest.mark.skipif(not cpu_build.cpu_has_amx_bf16(), reason="no AMX")),
    pytest.param("avx512_bf16", id="avx512_bf16"),
]  # fmt: skip


def prefill_cases(*shapes):
    """Each prefill kernel with each (heads, kv_heads, head_dim): AMX's tiles take heads of a
    multiple of 32 only."""
    return [pytest.param(isa.values[0], *shape, marks=isa.marks,
                         id="-".join(map(str, (isa.values[0], *shape))))
            for isa in PREFILL for shape in shapes
            if isa.values[0] != "amx" or shape[2] in native_paged.AMX_HEAD_DIMS]  # fmt: skip


def setup(lens, heads, kv_heads, head_dim, seed=0):
    k_cache, v_cache, tables, g = paged_setup(
        lens, 16, kv_heads, head_dim, seed=seed, dtype=torch.bfloat16
    )
    tables = torch.cat([tables, torch.zeros(len(lens), 2, dtype=tables.dtype)], 1)  # spare cols
    query = torch.randn(len(lens), heads, head_dim, generator=g).to(torch.bfloat16)
    return query, k_cache, v_cache, tables, torch.tensor(lens)


@pytest.mark.parametrize(
    "lens",
    [
        [1, 17, 300, 5, 64, 129, 2, 33],
        [1],
        [16, 32, 48],  # whole blocks only
        [7, 15, 1000],  # a long one beside short ones
    ],
)
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim",
    [(8, 4, 64), (4, 4, 128), (16, 1, 64), (8, 1, 128), (6, 2, 64), (16, 4, 64),
     (4, 2, 16), (8, 4, 32), (8, 2, 96), (4, 2, 256), (3, 1, 16)],
)  # fmt: skip
def test_native_decode_matches_dense(lens, heads, kv_heads, head_dim) -> None:
    query, k_cache, v_cache, tables, context = setup(lens, heads, kv_heads, head_dim, len(lens))
    assert native_paged.covers(query, k_cache)
    got, lse = native_paged.decode_attention(
        query, k_cache, v_cache, tables, context, 0.17, return_lse=True
    )
    # the reference in float32 on the same bfloat16 values, rounded once at the end
    want = ref.dense_decode_attention(
        query.float(), k_cache.float(), v_cache.float(), tables, context, 0.17
    )
    torch.testing.assert_close(got, want.to(torch.bfloat16), rtol=1.6e-2, atol=4e-3)
    _, want_lse = ref.decode_attention(
        query.float(), k_cache.float(), v_cache.float(), tables, context, 0.17, return_lse=True
    )
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 4, 64), (16, 8, 128), (8, 1, 64)])
def test_native_decode_of_many_sequences_is_the_same_on_any_number_of_threads(
    heads, kv_heads, head_dim
) -> None:
    """With enough sequences a thread takes all of one sequence's KV heads in a row: every
    row's result is the reference's, and the same bit for bit however many threads share them."""
    lens = [1 + (37 * i) % 230 for i in range(40)]
    query, k_cache, v_cache, tables, context = setup(lens, heads, kv_heads, head_dim, seed=5)
    want = ref.dense_decode_attention(
        query.float(), k_cache.float(), v_cache.float(), tables, context, 0.17
    )
    got = on_thread_counts(
        lambda: native_paged.decode_attention(
            query, k_cache, v_cache, tables, context, 0.17, return_lse=True
        )
    )
    torch.testing.assert_close(got[1][0], want.to(torch.bfloat16), rtol=1.6e-2, atol=4e-3)
    for n in (2, 3):
        assert torch.equal(got[n][0], got[1][0]) and torch.equal(got[n][1], got[1][1])


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim", [(8, 4, 64), (8, 1, 128), (6, 2, 64), (4, 2, 16), (4, 2, 96)]
)
def test_native_decode_ignores_what_lies_past_a_context(heads, kv_heads, head_dim) -> None:
    """The decode reads whole blocks: NaN and infinity in a last block's rows past the context
    (a pool's stale or unwritten rows) change nothing."""
    lens = [1, 17, 40, 9]
    query, k_cache, v_cache, tables, context = setup(lens, heads, kv_heads, head_dim)
    want = native_paged.decode_attention(query, k_cache, v_cache, tables, context, 0.17)
    poison_past_contexts(k_cache, v_cache, tables, lens)
    got = native_paged.decode_attention(query, k_cache, v_cache, tables, context, 0.17)
    assert torch.isfinite(got.float()).all()
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "isa, heads, kv_heads, head_dim",
    prefill_cases((8, 4, 64), (4, 4, 128), (6, 2, 64), (16, 1, 64), (4, 2, 16), (8, 4, 32),
                  (8, 2, 96), (4, 2, 256), (3, 1, 16)),
)  # fmt: skip
def test_native_prefill_matches_the_reference(isa, heads, kv_heads, head_dim) -> None:
    """Chunks with nothing cached before them and chunks after a cached context, of 1 to 120
    rows: whole tiles of query vectors and partial ones, diagonal blocks partly masked."""
    lens = [40, 17, 300, 1, 16, 29]  # tokens in the cache after this step's chunk
    chunks = [40, 5, 120, 1, 16, 13]  # this step's queries of each (the rest was cached)
    k_cache, v_cache, tables, g = paged_setup(lens, 16, kv_heads, head_dim, seed=3,
                                              dtype=torch.bfloat16)  # fmt: skip
    starts = [0]
    for n in chunks:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], heads, head_dim, generator=g).to(torch.bfloat16)
    got, lse = native_paged.prefill_attention(
        query, k_cache, v_cache, tables, starts, lens, 0.2, return_lse=True, isa=isa
    )
    want, want_lse = ref.prefill_attention(
        query.float(), k_cache.float(), v_cache.float(), tables, starts, lens, 0.2,
        return_lse=True,
    )  # fmt: skip
    torch.testing.assert_close(got, want.to(torch.bfloat16), rtol=1.6e-2, atol=4e-3)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window, softcap", [(1, None), (16, None), (40, None), (None, 2.0),
                                             (23, 0.5), (5000, 30.0)])  # fmt: skip
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim", [(8, 4, 64), (4, 4, 128), (8, 1, 64), (4, 2, 16), (4, 1, 256)]
)
def test_native_decode_honours_a_window_and_a_soft_cap(window, softcap, heads, kv_heads, head_dim):
    """Windows that start inside a block, on a block's edge, past the longest context; caps
    low enough to flatten the scores (Gemma 2's attention cap is 50)."""
    lens = [1, 17, 300, 5, 64, 129, 2, 33, 1000]
    query, k_cache, v_cache, tables, context = setup(lens, heads, kv_heads, head_dim, seed=4)
    query = query * 4  # scores well past the caps
    got, lse = native_paged.decode_attention(
        query, k_cache, v_cache, tables, context, 0.17, True, window, softcap
    )
    want, want_lse = ref.decode_attention(
        query.float(), k_cache.float(), v_cache.float(), tables, context, 0.17, True, window,
        softcap,
    )  # fmt: skip
    torch.testing.assert_close(got, want.to(torch.bfloat16), rtol=1.6e-2, atol=4e-3)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window, softcap", [(1, None), (16, None), (37, None), (None, 1.5),
                                             (20, 0.5)])  # fmt: skip
@pytest.mark.parametrize(
    "isa, heads, kv_heads, head_dim",
    prefill_cases((8, 4, 64), (4, 4, 128), (16, 1, 64), (4, 2, 16), (4, 1, 256)),
)
def test_native_prefill_honours_a_window_and_a_soft_cap(
    isa, window, softcap, heads, kv_heads, head_dim
):
    """Chunks whose rows' windows begin in different blocks of one tile, after cached context
    and from the first position."""
    lens = [40, 17, 300, 1, 16, 29, 90]
    chunks = [40, 5, 120, 1, 16, 13, 3]
    k_cache, v_cache, tables, g = paged_setup(lens, 16, kv_heads, head_dim, seed=5,
                                              dtype=torch.bfloat16)  # fmt: skip
    starts = [0]
    for n in chunks:
        starts.append(starts[-1] + n)
    query = (4 * torch.randn(starts[-1], heads, head_dim, generator=g)).to(torch.bfloat16)
    got, lse = native_paged.prefill_attention(
        query, k_cache, v_cache, tables, starts, lens, 0.2, True, window, softcap, isa
    )
    want, want_lse = ref.prefill_attention(
        query.float(), k_cache.float(), v_cache.float(), tables, starts, lens, 0.2,
        return_lse=True, window=window, softcap=softcap,
    )  # fmt: skip
    torch.testing.assert_close(got, want.to(torch.bfloat16), rtol=1.6e-2, atol=4e-3)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa, heads, kv_heads, head_dim", prefill_cases((8, 4, 64), (8, 4, 16)))
@pytest.mark.parametrize("window", [None, 7])
def test_native_prefill_ignores_what_lies_past_a_context(
    isa, heads, kv_heads, head_dim, window
) -> None:
    """NaN in K and infinity in V in the rows past each context change nothing: the scores
    there are masked, and the tile unit's P.V (where 0 times infinity would be NaN) never
    meets those V rows."""
    lens, chunks = [40, 17, 9, 90], [40, 5, 9, 3]
    k_cache, v_cache, tables, g = paged_setup(lens, 16, kv_heads, head_dim, seed=6,
                                              dtype=torch.bfloat16)  # fmt: skip
    starts = [0]
    for n in chunks:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], heads, head_dim, generator=g).to(torch.bfloat16)
    args = (starts, lens, 0.2, False, window, None, isa)
    want = native_paged.prefill_attention(query, k_cache, v_cache, tables, *args)
    poison_past_contexts(k_cache, v_cache, tables, lens)
    got = native_paged.prefill_attention(query, k_cache, v_cache, tables, *args)
    assert torch.isfinite(got.float()).all()
    assert torch.equal(got, want)


def test_the_prefill_runs_on_amx_where_the_cpu_has_it() -> None:
    """First where the CPU has AMX and Linux lends it (as it does for the experts kernel)."""
    isas = [isa for isa, _ in native_paged.prefill_kernels()]
    assert isas[-1] == "avx512_bf16"
    lent = any(isa == "amx" for isa, _ in native_experts.kernels(torch.bfloat16))
    assert (isas[0] == "amx") == (cpu_build.cpu_has_amx_bf16() and lent)


def test_native_decode_takes_no_rows() -> None:
    query, k_cache, v_cache, tables, context = setup([5], 8, 4, 64)
    out = native_paged.decode_attention(query[:0], k_cache, v_cache, tables[:0], context[:0], 0.1)
    assert out.shape == (0, 8, 64)


def test_what_the_native_kernel_covers() -> None:
    query, k_cache, _, _, _ = setup([5], 8, 4, 64)
    assert native_paged.covers(query, k_cache)
    assert not native_paged.covers(query.float(), k_cache.float())  # float32: inductor's
    assert not native_paged.covers(query[..., :48], k_cache[..., :48])  # head size 48
    wide = torch.zeros(4, 4, 32, 64, dtype=torch.bfloat16)  # blocks of 32 tokens
    assert not native_paged.covers(query, wide)


def test_compiled_backend_decodes_bf16_through_the_native_kernel(monkeypatch) -> None:
    backend = get_attention_backend("compiled", torch.device("cpu"))
    query, k_cache, v_cache, tables, context = setup([3, 40], 8, 4, 64)
    calls = []
    for name in ("decode_attention", "prefill_attention"):
        monkeypatch.setattr(native_paged, name, lambda *a, n=name: calls.append(n) or a[0])
    backend.decode_attention(query, k_cache, v_cache, tables, context, 0.1)
    assert calls == ["decode_attention"]
    backend.decode_attention(query.float(), k_cache.float(), v_cache.float(), tables, context, 0.1)
    assert calls == ["decode_attention"]  # float32 is not this kernel's
    backend.prefill_attention(query, k_cache, v_cache, tables[:1], [0, 2], [3], 0.1)
    assert calls == ["decode_attention", "prefill_attention"]


def test_kernel_is_built_once_and_kept(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    flags = cpu_build.AVX512_BF16_FLAGS
    built = cpu_build.build_library("g++", native_paged.SOURCE, flags)
    assert built.parent == tmp_path / "conveyor" / "kernels" and built.exists()
    stamp = built.stat().st_mtime_ns
    assert cpu_build.build_library("g++", native_paged.SOURCE, flags) == built
    assert built.stat().st_mtime_ns == stamp


def test_a_changed_header_builds_a_new_kernel(tmp_path, monkeypatch) -> None:
    import shutil

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    csrc = shutil.copytree(native_paged.SOURCE.parent, tmp_path / "csrc")
    source, flags = csrc / native_paged.SOURCE.name, cpu_build.AVX512_BF16_FLAGS
    first = cpu_build.build_library("g++", source, flags)
    header = csrc / "simd_bf16.h"
    header.write_text(header.read_text() + "\n// changed\n")
    second = cpu_build.build_library("g++", source, flags)
    assert second != first and first.exists() and second.exists()


def test_native_write_kv_matches_the_reference() -> None:
    """Keys contiguous, values a view into a packed q/k/v row, as the model passes them."""
    tokens, kv_heads, head_dim = 37, 4, 64
    g = torch.Generator().manual_seed(9)
    qkv = torch.randn(tokens, 3 * kv_heads * head_dim, generator=g).to(torch.bfloat16)
    key = qkv[:, : kv_heads * head_dim].reshape(tokens, kv_heads, head_dim).contiguous()
    value = qkv[:, 2 * kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(10 * 16, generator=g)[:tokens]
    want_k, want_v = (torch.zeros(10, kv_heads, 16, head_dim, dtype=torch.bfloat16) for _ in "kv")
    ref.write_kv(key, value, want_k, want_v, slots)
    got_k, got_v = torch.zeros_like(want_k), torch.zeros_like(want_v)
    native_paged.write_kv(key, value, got_k, got_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_a_head_of_16_prefills_on_the_dot_products_where_the_tiles_take_32() -> None:
    lens = [40, 9]
    k_cache, v_cache, tables, g = paged_setup(lens, 16, 2, 16, seed=9, dtype=torch.bfloat16)
    query = torch.randn(49, 4, 16, generator=g).to(torch.bfloat16)
    args = (k_cache, v_cache, tables, [0, 40, 49], lens, 0.25)
    chosen = native_paged.prefill_attention(query, *args)
    assert torch.equal(chosen, native_paged.prefill_attention(query, *args, isa="avx512_bf16"))
    if any(isa == "amx" for isa, _ in native_paged.prefill_kernels()):
        with pytest.raises(ValueError, match="does not cover"):
            native_paged.prefill_attention(query, *args, isa="amx")
