"""The float32 attention kernels (`kernels.native_paged_f32`: decode, prefill, the write of a
step's K/V; built for AVX2 and, where the CPU has it, for AVX-512) against the reference on the
same inputs, and which the compiled backend picks in float32."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels import cpu_build, get_attention_backend, native_paged_f32
from conveyor.kernels import torch_paged as ref
from tests.kernels.test_kernels import on_thread_counts, paged_setup, poison_past_contexts

pytestmark = pytest.mark.skipif(not cpu_build.cpu_has_avx2(), reason="this CPU has no AVX2")

# the kernel's builds: each runs where the CPU has its instructions (the other's tests skip)
ISAS = [
    pytest.param("avx512", id="avx512",
                 marks=pytest.mark.skipif(not cpu_build.cpu_has_avx512_f32(),
                                          reason="no AVX-512 (F, DQ) and FMA")),
    pytest.param("avx2", id="avx2"),
]  # fmt: skip


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


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 4, 64), (16, 8, 128), (8, 1, 64)])
def test_decode_of_many_sequences_is_the_same_on_any_number_of_threads(
    heads, kv_heads, head_dim
) -> None:
    """With enough sequences a thread takes all of one sequence's KV heads in a row: every
    row's result is the reference's, and the same bit for bit however many threads share them."""
    lens = [1 + (37 * i) % 230 for i in range(40)]
    query, k_cache, v_cache, tables, context = setup(lens, heads, kv_heads, head_dim, seed=5)
    want = ref.decode_attention(query, k_cache, v_cache, tables, context, 0.17)
    got = on_thread_counts(
        lambda: native_paged_f32.decode_attention(
            query, k_cache, v_cache, tables, context, 0.17, return_lse=True
        )
    )
    torch.testing.assert_close(got[1][0], want, rtol=1e-5, atol=1e-5)
    for n in (2, 3):
        assert torch.equal(got[n][0], got[1][0]) and torch.equal(got[n][1], got[1][1])


@pytest.mark.parametrize("window, softcap", [(None, None), (5, 4.0)])
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim", [(8, 4, 64), (8, 1, 128), (6, 2, 64), (4, 4, 16), (8, 2, 96)]
)
def test_decode_ignores_what_lies_past_a_context(heads, kv_heads, head_dim, window, softcap):
    """The decode's scores read whole blocks: NaN and infinity in a last block's rows past the
    context (a pool's stale or unwritten rows) change nothing."""
    lens = [1, 17, 40, 9, 16]
    query, k_cache, v_cache, tables, context = setup(lens, heads, kv_heads, head_dim, seed=4)
    want = native_paged_f32.decode_attention(
        query, k_cache, v_cache, tables, context, 0.2, False, window, softcap
    )
    poison_past_contexts(k_cache, v_cache, tables, lens)
    got = native_paged_f32.decode_attention(
        query, k_cache, v_cache, tables, context, 0.2, False, window, softcap
    )
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)


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


def prefill_setup(lens, chunks, heads, kv_heads, head_dim, seed, spread=1.0):
    """Caches holding `lens` tokens of each sequence, of which the last `chunks` are this
    step's queries; the queries and their starts."""
    k_cache, v_cache, tables, g = paged_setup(lens, 16, kv_heads, head_dim, seed=seed)
    starts = [0]
    for n in chunks:
        starts.append(starts[-1] + n)
    query = spread * torch.randn(starts[-1], heads, head_dim, generator=g)
    return query, k_cache, v_cache, tables, starts


PREFILL_SHAPES = [(8, 4, 64), (4, 4, 128), (6, 2, 64), (16, 1, 64), (4, 2, 16), (8, 2, 96),
                  (8, 4, 256), (3, 3, 32)]  # fmt: skip


def test_each_build_loads_where_the_cpu_has_its_instructions() -> None:
    want = ["avx512", "avx2"] if cpu_build.cpu_has_avx512_f32() else ["avx2"]
    assert [isa for isa, _ in native_paged_f32.libraries()] == want


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("heads, kv_heads, head_dim", PREFILL_SHAPES)
def test_prefill_matches_the_reference(heads, kv_heads, head_dim, isa) -> None:
    """Chunks with nothing cached before them and chunks after a cached context, of 1 to 120
    rows: whole tiles of query vectors and partial ones, diagonal blocks partly masked."""
    lens = [40, 17, 300, 1, 16, 29]  # tokens in the cache after this step's chunk
    chunks = [40, 5, 120, 1, 16, 13]  # this step's queries of each (the rest was cached)
    query, k_cache, v_cache, tables, starts = prefill_setup(lens, chunks, heads, kv_heads,
                                                            head_dim, seed=3)  # fmt: skip
    assert native_paged_f32.covers(query, k_cache)
    got, lse = native_paged_f32.prefill_attention(
        query, k_cache, v_cache, tables, starts, lens, 0.2, return_lse=True, isa=isa
    )
    want, want_lse = ref.prefill_attention(
        query, k_cache, v_cache, tables, starts, lens, 0.2, return_lse=True
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert torch.equal(native_paged_f32.prefill_attention(
        query, k_cache, v_cache, tables, starts, lens, 0.2, isa=isa
    ), got)  # fmt: skip


@pytest.mark.skipif(not cpu_build.cpu_has_avx512_f32(), reason="no AVX-512 (F, DQ) and FMA")
@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (37, 2.0)])
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim",
    [(8, 4, 64), (12, 4, 64), (6, 2, 96), (16, 1, 32), (4, 4, 128), (8, 2, 256)],
)
def test_the_prefill_builds_agree_bit_for_bit(heads, kv_heads, head_dim, window, softcap) -> None:
    """AVX-512's build tiles 16 query vectors where AVX2's tiles 8, so a query meets other
    neighbours and blocks (3 query heads a KV head: rows straddle tiles differently); a float32
    result must not depend on which the CPU has."""
    lens = [300, 17, 1000, 64, 1]
    chunks = [300, 5, 200, 64, 1]
    query, k_cache, v_cache, tables, starts = prefill_setup(lens, chunks, heads, kv_heads,
                                                            head_dim, seed=7, spread=3)  # fmt: skip
    got = {isa: native_paged_f32.prefill_attention(query, k_cache, v_cache, tables, starts, lens,
                                                   0.2, True, window, softcap, isa=isa)
           for isa in ("avx512", "avx2")}  # fmt: skip
    assert torch.equal(got["avx512"][0], got["avx2"][0])
    assert torch.equal(got["avx512"][1], got["avx2"][1])


@pytest.mark.parametrize("window, softcap", [(1, None), (16, None), (37, None), (None, 1.5),
                                             (20, 0.5), (5000, 30.0)])  # fmt: skip
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 4, 64), (4, 4, 128), (16, 1, 64)])
@pytest.mark.parametrize("isa", ISAS)
def test_prefill_honours_a_window_and_a_soft_cap(window, softcap, heads, kv_heads, head_dim, isa):
    """Chunks whose rows' windows begin in different blocks of one tile, after cached context
    and from the first position; caps low enough to flatten the scores."""
    lens = [40, 17, 300, 1, 16, 29, 90]
    chunks = [40, 5, 120, 1, 16, 13, 3]
    query, k_cache, v_cache, tables, starts = prefill_setup(lens, chunks, heads, kv_heads,
                                                            head_dim, seed=5, spread=4)  # fmt: skip
    got, lse = native_paged_f32.prefill_attention(
        query, k_cache, v_cache, tables, starts, lens, 0.2, True, window, softcap, isa=isa
    )
    want, want_lse = ref.prefill_attention(
        query, k_cache, v_cache, tables, starts, lens, 0.2, return_lse=True, window=window,
        softcap=softcap,
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_prefill_takes_no_rows() -> None:
    query, k_cache, v_cache, tables, _ = prefill_setup([5], [5], 8, 4, 64, seed=0)
    out = native_paged_f32.prefill_attention(query[:0], k_cache, v_cache, tables[:0], [0], [], 1)
    assert out.shape == (0, 8, 64)


def test_write_kv_fills_the_slots_as_the_reference() -> None:
    """Rows to slots in several blocks, out of order; K/V as views with a row stride (the
    projections' output split)."""
    g = torch.Generator().manual_seed(9)
    k_cache, v_cache = torch.zeros(2, 6, 2, 16, 64)
    fused = torch.randn(5, 2 * 2 * 64 + 8, generator=g)
    key = fused[:, : 2 * 64].view(5, 2, 64)
    value = fused[:, 2 * 64 : 4 * 64].view(5, 2, 64)
    slots = torch.tensor([17, 3, 80, 4, 95])
    native_paged_f32.write_kv(key, value, k_cache, v_cache, slots)
    want_k, want_v = torch.zeros(2, 6, 2, 16, 64)
    ref.write_kv(key, value, want_k, want_v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert k_cache.count_nonzero() == 5 * 2 * 64


def test_write_kv_of_a_prompt_on_any_number_of_threads() -> None:
    """A prompt's consecutive slots from the middle of a block, 16 tokens a task, the heads
    one after the other: the reference's cache however many threads share the tasks."""
    g = torch.Generator().manual_seed(3)
    key, value = torch.randn(2, 100, 4, 32, generator=g)
    slots = torch.arange(7, 107)
    want_k, want_v = torch.zeros(2, 8, 4, 16, 32)
    ref.write_kv(key, value, want_k, want_v, slots)

    def write() -> tuple[torch.Tensor, torch.Tensor]:
        k_cache, v_cache = torch.zeros(2, 8, 4, 16, 32)
        native_paged_f32.write_kv(key, value, k_cache, v_cache, slots)
        return k_cache, v_cache

    for k_cache, v_cache in on_thread_counts(write).values():
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


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


def test_the_prefill_kernel_runs_where_it_is_faster(monkeypatch) -> None:
    """Heads of up to 64 always; wider ones, with AVX2's build, up to a step's longest context
    of MAX_WIDE_PREFILL_CONTEXT, past which torch's fused attention runs them; with
    AVX-512's at any context."""
    longest = native_paged_f32.MAX_WIDE_PREFILL_CONTEXT
    avx2 = tuple((isa, lib) for isa, lib in native_paged_f32.libraries() if isa == "avx2")
    monkeypatch.setattr(native_paged_f32, "libraries", lambda: avx2)
    query, k_cache, _, _, _ = setup([5], 8, 4, 64)
    assert native_paged_f32.runs_prefill(query, k_cache, [3, 10 * longest])
    query, k_cache, _, _, _ = setup([5], 8, 4, 128)
    assert native_paged_f32.runs_prefill(query, k_cache, [3, longest])
    assert not native_paged_f32.runs_prefill(query, k_cache, [3, longest + 1])
    assert not native_paged_f32.runs_prefill(query.bfloat16(), k_cache.bfloat16(), [3])
    avx512 = (("avx512", avx2[0][1]),)  # which build runs is all that is asked here
    monkeypatch.setattr(native_paged_f32, "libraries", lambda: avx512)
    assert native_paged_f32.runs_prefill(query, k_cache, [3, 10 * longest])


def test_compiled_backend_runs_float32_through_the_kernels(monkeypatch) -> None:
    backend = get_attention_backend("compiled", torch.device("cpu"))
    query, k_cache, v_cache, tables, context = setup([3, 40], 8, 4, 64)
    calls = []
    for name in ("decode_attention", "prefill_attention", "write_kv"):
        monkeypatch.setattr(native_paged_f32, name, lambda *a, n=name: calls.append(n) or a[0])
    backend.prefill_attention(query, k_cache, v_cache, tables[:1], [0, 2], [3], 0.1)
    backend.write_kv(query[:, :4], query[:, :4], k_cache, v_cache, torch.tensor([0, 1]))
    assert calls == ["prefill_attention", "write_kv"]
    calls.clear()
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
