"""The CPU backends: the torch reference (the test oracle), and the same with its decode
attention compiled by torch.compile."""

from __future__ import annotations

import torch

from conveyor.kernels import cascade, native_paged, native_paged_f32, torch_paged


class TorchPagedAttention:
    name = "torch"
    cascade = True  # reads a prefix shared by many sequences once for all (kernels.cascade)
    write_kv = staticmethod(torch_paged.write_kv)
    decode_attention = staticmethod(torch_paged.decode_attention)
    prefill_attention = staticmethod(torch_paged.prefill_attention)

    def forward(  # noqa: D102
        self, query, key, value, k_cache, v_cache, meta, scale, window=None, softcap=None
    ):
        self.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        plan = meta.cascade
        # a shared prefix may lie outside the window; capped scores merge in no cascade
        if plan is None or window is not None or softcap is not None:
            return self._attend(
                query, key, value, k_cache, v_cache, meta, scale, False, window, softcap
            )[0]
        out, lse = self._attend(query, key, value, k_cache, v_cache, plan.suffix, scale, True)
        for prefix in plan.prefixes:
            cascade.merge_prefix(out, lse, query, k_cache, v_cache, prefix, scale)
        return out

    def _attend(
        self, query, key, value, k_cache, v_cache, meta, scale, return_lse, window=None,
        softcap=None,
    ):  # fmt: skip
        """Attention of every query over the cache `meta` describes, and with `return_lse`
        the log-sum-exp of its scores (else None)."""
        d = meta.num_decode_tokens
        parts = []
        if d:
            parts.append(
                self.decode_attention(
                    query[:d],
                    k_cache,
                    v_cache,
                    meta.decode_block_tables,
                    meta.decode_context_lens,
                    scale,
                    return_lse=return_lse,
                    window=window,
                    softcap=softcap,
                )
            )
        if meta.num_prefills:
            parts.append(
                self.prefill_attention(
                    query[d:],
                    k_cache,
                    v_cache,
                    meta.prefill_block_tables,
                    meta.prefill_query_start,
                    meta.prefill_context_lens,
                    scale,
                    key[d:],  # a prompt with nothing cached attends to these, no gather
                    value[d:],
                    return_lse=return_lse,
                    window=window,
                    softcap=softcap,
                )
            )
        if not return_lse:
            return (parts[0] if len(parts) == 1 else torch.cat(parts)), None
        if len(parts) == 1:
            return parts[0]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


class CompiledPagedAttention(TorchPagedAttention):
    """The torch path with its attention compiled (CPU): no gathered K/V copies. In bfloat16 on
    a CPU with AVX512-BF16 the decode, the prefill and the write of the step's K/V are
    `native_paged`'s kernels; in float32 on a CPU with AVX2 `native_paged_f32`'s (the prefill
    where it is faster than torch's: `runs_prefill`); elsewhere the decode is the one inductor
    compiles (`compiled_paged`) and the prefill and write torch's."""

    name = "compiled"

    def __init__(self) -> None:
        from conveyor.kernels import compiled_paged

        if problem := compiled_paged.compiler_missing():
            raise ValueError(f"attention_backend='compiled' needs inductor's C++ build: {problem}")
        self.inductor_decode = compiled_paged.decode_attention

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping):
        for native in (native_paged, native_paged_f32):
            if native.covers(key, k_cache):
                return native.write_kv(key, value, k_cache, v_cache, slot_mapping)
        torch_paged.write_kv(key, value, k_cache, v_cache, slot_mapping)

    def decode_attention(
        self, query, k_cache, v_cache, block_tables, context_lens, scale, return_lse=False,
        window=None, softcap=None,
    ):  # fmt: skip
        for native in (native_paged, native_paged_f32):
            if native.covers(query, k_cache):
                return native.decode_attention(
                    query, k_cache, v_cache, block_tables, context_lens, scale, return_lse,
                    window, softcap,
                )  # fmt: skip
        return self.inductor_decode(
            query, k_cache, v_cache, block_tables, context_lens, scale, return_lse, window, softcap
        )

    def prefill_attention(
        self, query, k_cache, v_cache, block_tables, query_start, context_lens, scale, key=None,
        value=None, return_lse=False, window=None, softcap=None,
    ):  # fmt: skip
        if native_paged.covers(query, k_cache):
            native = native_paged
        elif native_paged_f32.runs_prefill(query, k_cache, context_lens):
            native = native_paged_f32
        else:
            return torch_paged.prefill_attention(
                query, k_cache, v_cache, block_tables, query_start, context_lens, scale, key,
                value, return_lse, window, softcap,
            )  # fmt: skip
        return native.prefill_attention(
            query, k_cache, v_cache, block_tables, query_start, context_lens, scale, return_lse,
            window, softcap,
        )  # fmt: skip
