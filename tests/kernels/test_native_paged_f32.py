"""The AVX2 float32 decode kernel (`kernels.native_paged_f32`) against the reference on the same
inputs, and which decode the compiled backend picks in float32."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels import cpu_build, get_attention_backend, native_paged_f32
from conveyor.kernels import torch_paged as ref
from tests.kernels.test_kernels import paged_setup

pytestmark = pytest.mark.skipif(not cpu_build.cpu_has_avx2(), reason="this CPU has no AVX2")


def setup(lens, heads, kv_heads, head_dim, seed=0):
    k_cache, v_cache, tables, g = paged_setup(lens, 16, kv_heads, head_dim, seed=seed)
    tables = torch.cat([tables, torch.zeros(len(lens), 2, dtype=tables.dtype)], 1)  # spare cols
    query = torch.randn(len(lens), heads, head_dim, generator=g)
    return query, k_cache, v_cache, tables, torch.tensor(lens)


@pytest.mark.parametrize(
    "lens", [[1, 17, 300, 5, 64, 129, 2, 33], [1], [16, 32, 48], [7, 15, 1000]]
)
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim",
    [(8, 4, 64), (4, 4, 128), (16, 1, 64), (8, 1, 128), (6, 2, 64), (16, 4, 64), (4, 2, 16),
     (8, 8, 32), (8, 2, 96), (8, 4, 256)],
)  # fmt: skip
def test_decode_matches_the_reference(lens, heads, kv_heads, head_dim) -> None:
    query, k_cache, v_cache, tables, context = setup(lens, heads, kv_heads, head_dim, len(lens))
    assert native_paged_f32.covers(query, k_cache)
    got, lse = native_paged_f32.decode_attention(
        query, k_cache, v_cache, tables, context, 0.17, return_lse=True
    )
    want, want_lse = ref.decode_attention(
        query, k_cache, v_cache, tables, context, 0.17, return_lse=True
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window, softcap", [(1, None), (20, None), (None, 5.0), (7, 3.0)])
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim", [(8, 4, 64), (4, 4, 128), (6, 2, 64), (4, 2, 16), (8, 4, 256)]
)
def test_decode_honours_a_window_and_a_soft_cap(window, softcap, heads, kv_heads, head_dim):
    query, k_cache, v_cache, tables, context = setup([1, 17, 300, 5, 64, 20, 21], heads,
                                                     kv_heads, head_dim, seed=2)  # fmt: skip
    got, lse = native_paged_f32.decode_attention(
        query, k_cache, v_cache, tables, context, 0.3, True, window, softcap
    )
    want, want_lse = ref.decode_attention(
        query, k_cache, v_cache, tables, context, 0.3, return_lse=True, window=window,
        softcap=softcap,
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_decode_takes_no_rows() -> None:
    query, k_cache, v_cache, tables, context = setup([5], 8, 4, 64)
    out = native_paged_f32.decode_attention(query[:0], k_cache, v_cache, tables[:0], context[:0], 1)
    assert out.shape == (0, 8, 64)


def test_what_the_kernel_covers() -> None:
    query, k_cache, _, _, _ = setup([5], 8, 4, 64)
    assert native_paged_f32.covers(query, k_cache)
    assert not native_paged_f32.covers(query.bfloat16(), k_cache.bfloat16())
    assert not native_paged_f32.covers(query[..., :48], k_cache[..., :48])  # head size 48
    assert not native_paged_f32.covers(query, torch.zeros(4, 4, 32, 64))  # blocks of 32 tokens
    assert not native_paged_f32.covers(torch.zeros(1, 17, 64), torch.zeros(4, 1, 16, 64))  # 17


def test_compiled_backend_decodes_float32_through_the_kernel(monkeypatch) -> None:
    backend = get_attention_backend("compiled", torch.device("cpu"))
    query, k_cache, v_cache, tables, context = setup([3, 40], 8, 4, 64)
    calls = []
    monkeypatch.setattr(native_paged_f32, "decode_attention", lambda *a: calls.append(1) or a[0])
    backend.decode_attention(query, k_cache, v_cache, tables, context, 0.1)
    assert calls == [1]
    # a shape it does not take goes to the inductor kernel, which answers as the reference does
    odd_q, odd_k, odd_v, odd_tables, odd_context = setup([3, 40], 8, 4, 80)
    got = backend.decode_attention(odd_q, odd_k, odd_v, odd_tables, odd_context, 0.1)
    torch.testing.assert_close(
        got, ref.decode_attention(odd_q, odd_k, odd_v, odd_tables, odd_context, 0.1)
    )
    assert calls == [1]
