"""The CUDA backend: Triton kernels that read and write the KV pages in place."""

from __future__ import annotations

import torch


class TritonPagedAttention:
    """The CUDA path: Triton kernels that read and write the KV pages in place."""

    name = "triton"

    def __init__(self) -> None:
        from conveyor.kernels import triton_paged

        self.kernels = triton_paged

    def warm_up(self, kv_caches, heads: int, max_context_len: int, softcap=None) -> None:
        """Compile the kernels' variants before traffic (the caches of every layer share a
        shape, so the first layer's compiles them all)."""
        k_cache, v_cache = kv_caches[0]
        self.kernels.warm_up(k_cache, v_cache, heads, max_context_len, softcap)

    def forward(  # noqa: D102
        self, query, key, value, k_cache, v_cache, meta, scale, window=None, softcap=None
    ):
        tk = self.kernels
        tk.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        d = meta.num_decode_tokens
        out = torch.empty_like(query)
        if d:
            tk.paged_decode_attention(
                query[:d],
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                scale,
                max_context_len=meta.decode_max_context_len or None,
                out=out[:d],
                window=window,
                softcap=softcap,
                num_splits=meta.decode_splits,
            )
        if meta.num_prefills:
            query_start, context_lens = (
                meta.prefill_query_start_tensor,
                meta.prefill_context_lens_tensor,
            )
            if query_start is None or context_lens is None:
                query_start = torch.tensor(meta.prefill_query_start, device=query.device)
                context_lens = torch.tensor(meta.prefill_context_lens, device=query.device)
            tk.paged_prefill_attention(
                query[d:],
                k_cache,
                v_cache,
                meta.prefill_block_tables,
                query_start,
                context_lens,
                scale,
                max_query_len=meta.prefill_max_query_len or None,
                out=out[d:],
                window=window,
                softcap=softcap,
            )
        return out
