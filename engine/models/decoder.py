"""The decoder-only transformer every family shares; each family's module (`llama.py`,
`qwen3_moe.py`, ...) subclasses `DecoderForCausalLM` and states only how it differs.

Read off the config: `attention_bias`, `mlp_bias`, tied embeddings and an explicit `head_dim`;
stated by a family: q/k/v bias (`qkv_bias`), q/k RMSNorm (`qk_norm`: per head or over the whole
projection), each layer's MLP (`make_mlp`: dense SwiGLU here, a mixture of experts in the MoE
families) and the layer itself (`layer_class`, where the norms sit elsewhere). Parameter names match
the Hugging Face checkpoints, except that q/k/v and gate/up are packed into one matmul each
(`PACKED`: the loader fills their rows). K/V live only in the paged cache.
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.engine.batch_invariant import in_row_tiles, tiles_for
from conveyor.engine.models.layers import (
    COMPILED,
    EAGER,
    GATED_ACTIVATIONS,
    NATIVE,
    TRITON,
    Linear,
    LongRope,
    PackedLinear,
    PrepackedLinear,
    RMSNorm,
    Rope,
    RotaryEmbedding,
    RowTiled,
    RunsActivation,
    RunsExperts,
    apply_rope,
    compiled_apply_rope,
    per_layer_type_rope,
    rotary_dim,
    triton_layers,
)
from conveyor.kernels import AttentionBackend, AttentionMetadata, native_layers

KVCache = tuple[torch.Tensor, torch.Tensor]

# The most a warm-up product run may cost (one of each projection shape and the output layer
# at one row count): past it a decode step's products take ~10 ms or more on a CPU and hide the
# ~0.3 ms of a new shape's kernel, while warming every row count up to 256 costs all their
# products: ~2 minutes for a Qwen2.5-0.5B in float32 on a 2-core CPU (its 151,936-way output
# layer), where this bound stops at 6 rows.
WARM_UP_ROW_FLOPS = 2e9
# The most row counts a warm-up runs: a step of more sequences is batch traffic, which pays a
# shape's kernel build once in the run as it would have at the start (a model small enough to
# reach this bound builds ~6 kernels a row count, ~1 ms each: 0.3 s to 64 rows, 1.3 s to 256)
WARM_UP_MAX_ROWS = 64

# checkpoint module name -> (our packed module name, shard)
PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


# where a family normalises queries and keys before rope: each head's (Qwen3), or the whole
# q and k projections' outputs (OLMo 2)
QK_NORM_PER_HEAD, QK_NORM_FULL_WIDTH = "per_head", "full_width"


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding attention window in tokens, None for full attention. A config's
    `sliding_window` counts where the family uses it: in Mistral's (and Mixtral's, Phi-3's)
    every layer; where the config has `use_sliding_window` (Qwen2, Qwen3) only when that is
    true, and then in the layers its `layer_types` name `sliding_attention`."""
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window or not getattr(config, "use_sliding_window", True):
        return [None] * layers
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * layers
    return [int(window) if kind == "sliding_attention" else None for kind in types]


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Attention(nn.Module):
    def __init__(self, config, qk_norm: str | None, qkv_bias: bool):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        self.rotary_dim = rotary_dim(config, self.head_dim)  # the rest pass rope unchanged
        self.scale = self.head_dim**-0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(
            config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=qkv_bias
        )
        o_bias = bool(getattr(config, "attention_bias", False))  # Qwen2 biases q/k/v only
        self.window: int | None = None  # a sliding window, set by the model per layer
        # Gemma 2's soft cap on the attention scores, where the config has one
        self.softcap: float | None = getattr(config, "attn_logit_softcapping", None)
        self.o_proj = Linear(q_size, config.hidden_size, bias=o_bias)
        self.impl = EAGER  # how rope runs (see `DecoderForCausalLM.use_elementwise`)
        self.qk_norm = qk_norm
        if qk_norm is not None:
            full = qk_norm == QK_NORM_FULL_WIDTH
            self.q_norm = RMSNorm(q_size if full else self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(kv_size if full else self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        rope: Rope,
        x: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.forward_shards(x)
        if self.qk_norm == QK_NORM_FULL_WIDTH:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.impl == TRITON and self.rotary_dim == self.head_dim:
            q, k = self._norm_rope_in_place(rope, q, k)
        else:
            if self.qk_norm == QK_NORM_PER_HEAD:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self._rope(rope, q, k)
        out = backend.forward(
            q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.window, self.softcap
        )
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))

    def _rope(self, rope: Rope, q: torch.Tensor, k: torch.Tensor):
        if self.rotary_dim < self.head_dim:
            return self._partial_rope(rope, q, k)
        if self.impl == NATIVE:
            return native_layers.rope(*rope, q, k)
        return (compiled_apply_rope() if self.impl == COMPILED else apply_rope)(rope, q, k)

    def _partial_rope(self, rope: Rope, q: torch.Tensor, k: torch.Tensor):
        """Rope over each head's first `rotary_dim` channels (the native and Triton kernels
        turn whole heads, so beside them this runs eager)."""
        d = self.rotary_dim
        turn = compiled_apply_rope() if self.impl == COMPILED else apply_rope
        q_rot, k_rot = turn(rope, q[..., :d], k[..., :d])
        return torch.cat((q_rot, q[..., d:]), -1), torch.cat((k_rot, k[..., d:]), -1)

    def _norm_rope_in_place(self, rope: Rope, q: torch.Tensor, k: torch.Tensor):
        """The q/k norms and rope, one kernel each for q and k, written over the q and k
        views of the packed projection's output."""
        fused = triton_layers()
        if self.qk_norm == QK_NORM_PER_HEAD:
            q_norm, k_norm = self.q_norm, self.k_norm
            return (fused.norm_rope_(q, *rope, q_norm.weight, q_norm.eps),
                    fused.norm_rope_(k, *rope, k_norm.weight, k_norm.eps))  # fmt: skip
        return fused.norm_rope_(q, *rope), fused.norm_rope_(k, *rope)


class MLP(RunsActivation, nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool, activation: str = "silu"):
        super().__init__()
        self.activation = checked_activation(activation)
        self.gate_up_proj = PackedLinear(hidden, {"gate": inter, "up": inter}, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.silu_and_mul(self.gate_up_proj(x)))


def dense_mlp(config, inter: int | None = None) -> MLP:
    bias = bool(getattr(config, "mlp_bias", False))
    return MLP(config.hidden_size, inter or config.intermediate_size, bias, activation_of(config))


def activation_of(config) -> str:
    """The MLP's gate activation as the config names it (Gemma's `hidden_activation` first)."""
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    return checked_activation(name)


def checked_activation(name: str) -> str:
    if name not in GATED_ACTIVATIONS:
        raise ValueError(
            f"activation {name!r} is not implemented; supported: {', '.join(GATED_ACTIVATIONS)}"
        )
    return name


class DecoderLayer(nn.Module):
    def __init__(self, config, qk_norm: str | None, qkv_bias: bool, mlp: nn.Module):
        super().__init__()
        self.self_attn = Attention(config, qk_norm, qkv_bias)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, x, residual, kv_cache, meta, backend, keep_rows=None):
        """(this layer's MLP output, the residual stream before it): each layer adds the
        previous one's output to the stream in its first norm, the model's last norm adds the
        last layer's. On the first layer `residual` is None and x is the stream. With
        `keep_rows`, everything after attention runs for those rows only."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, h, kv_cache, meta, backend)
        if keep_rows is not None:
            h, residual = h.index_select(0, keep_rows), residual.index_select(0, keep_rows)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, config, family: type[DecoderForCausalLM], qkv_bias: bool, max_positions):
        super().__init__()
        head_dim = head_dim_of(config)
        # where each layer type has rope of its own (Gemma 3), the sliding layers' is local
        per_type = per_layer_type_rope(config)
        self.rotary = RotaryEmbedding(
            config, head_dim, max_positions, "full_attention" if per_type else None
        )
        self.local_rotary = (
            RotaryEmbedding(config, head_dim, max_positions, "sliding_attention")
            if per_type
            else None
        )
        types = config.layer_types if per_type else ["full_attention"] * config.num_hidden_layers
        self.local_rope = [kind == "sliding_attention" for kind in types]
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        scale = family.embed_scale(config)
        # the model's dtype rounds the scale, as transformers does
        embed_scale = None if scale is None else torch.tensor(scale)
        self.register_buffer("embed_scale", embed_scale, persistent=False)
        self.layers = nn.ModuleList(
            family.layer_class(config, family.qk_norm, qkv_bias, family.make_mlp(config, i))
            for i in range(config.num_hidden_layers)
        )
        for layer, window in zip(self.layers, layer_windows(config), strict=True):
            layer.self_attn.window = window
        self.norm = family.norm_class(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta, backend, keep_rows=None):
        """`meta`: the step's attention metadata, or a list of one per layer (a hybrid KV
        layout, `kv_layout`, gives each layer its group's)."""
        x, residual = self.embed_tokens(input_ids), None
        if self.embed_scale is not None:
            x = x * self.embed_scale.to(x.dtype)
        rope = self.rotary.lookup(positions, x.dtype)
        local = rope if self.local_rotary is None else self.local_rotary.lookup(positions, x.dtype)
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            keep = keep_rows if i == last else None
            layer_rope = local if self.local_rope[i] else rope
            layer_meta = meta[i] if isinstance(meta, list) else meta
            x, residual = layer(layer_rope, x, residual, kv_cache, layer_meta, backend, keep)
        return self.norm(x, residual)[0]


class DecoderForCausalLM(nn.Module):
    qk_norm: str | None = None
    qkv_bias = False
    layer_class: type[nn.Module] = DecoderLayer
    norm_class: type[nn.Module] = RMSNorm  # the model's last norm
    # our module path -> the checkpoint's, where a family names a module otherwise
    checkpoint_renames: dict[str, str] = {}
    # whether the checkpoint stores q/k/v and gate/up already packed, as we do (Phi-3)
    fused_checkpoint = False

    def __init__(self, config, max_positions: int):
        super().__init__()
        qkv_bias = bool(getattr(config, "qkv_bias", self.qkv_bias))  # Qwen2-MoE's flag
        qkv_bias = qkv_bias or bool(getattr(config, "attention_bias", False))
        self.model = DecoderModel(config, type(self), qkv_bias, max_positions)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.packed_lm_head: PrepackedLinear | None = None  # set by `prepack`
        self.logit_tiles: tuple[int, ...] = ()  # set by `use_batch_invariance`
        # Gemma's tanh soft-capping of the logits and of the attention scores, where it has them
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.attention_softcap = getattr(config, "attn_logit_softcapping", None)
        attn = self.model.layers[0].self_attn
        self.num_layers = config.num_hidden_layers
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.long_rope: LongRope | None = self.model.rotary.long_rope  # LongRoPE's, if used

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window, None where it attends to the whole context."""
        return [layer.self_attn.window for layer in self.model.layers]

    @classmethod
    def embed_scale(cls, config) -> float | None:
        """What the embeddings are multiplied by (Gemma: the square root of the width)."""
        return None

    @classmethod
    def make_mlp(cls, config, layer_idx: int) -> nn.Module:
        """Layer `layer_idx`'s MLP: a dense SwiGLU unless the family says otherwise."""
        return dense_mlp(config)

    def activation_widths(self) -> set[int]:
        """The widths SiLU(gate) * up runs at: each dense MLP's and each expert's."""
        return {m.down_proj.in_features if isinstance(m, MLP) else m.inter
                for m in self.modules() if isinstance(m, RunsActivation)}  # fmt: skip

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        keep_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the flattened batch; with `keep_rows` (row indices),
        of those rows only, in that order. Every row's K/V is written either way: only the
        last layer's output projection, MLP and the final norm skip the other rows (a prompt
        chunk's rows before its last feed nothing but the cache), ~10% of a prefill step's
        products."""
        return self.model(input_ids, positions, kv_caches, meta, backend, keep_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        product = self.lm_head if self.packed_lm_head is None else self.packed_lm_head
        tiles = self.logit_tiles
        logits = in_row_tiles(product, hidden, tiles) if tiles else product(hidden)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def use_elementwise(self, impl: str) -> None:
        """Run norms, rope and the activation as `impl` (engine.device_plan chooses): `NATIVE`
        (kernels.native_layers: all three), `TRITON` (kernels.triton_layers: all three, the q/k
        norms fused with rope), `COMPILED` (norms and rope compiled by inductor; its
        activation was no faster than eager's) or `EAGER`."""
        for module in self.modules():
            if isinstance(module, RMSNorm | Attention):
                module.impl = impl
            elif isinstance(module, RunsActivation):
                module.impl = impl if impl in (NATIVE, TRITON) else EAGER

    def expert_widths(self) -> set[int]:
        """Each mixture-of-experts layer's intermediate size (none in a dense model)."""
        return {m.inter for m in self.modules() if isinstance(m, RunsExperts)}

    def use_experts(self, kernel: str) -> None:
        """Run the experts of every mixture-of-experts layer as `kernel` (engine.device_plan
        chooses)."""
        for module in self.modules():
            if isinstance(module, RunsExperts):
                module.use_kernel(kernel)

    def use_batch_invariance(self) -> None:
        """Every product in tiles of fixed rows (`engine.batch_invariant`): a row's result no
        longer depends on how many rows its step has. Each kind of projection is checked once
        (`RowTiled.tile_kind`), not once per layer."""
        known: dict[tuple, tuple[int, ...]] = {}
        for module in self.modules():
            if isinstance(module, RowTiled):
                module.use_row_tiles(known)
        product = self.lm_head if self.packed_lm_head is None else self.packed_lm_head
        hidden = self.model.embed_tokens.weight
        self.logit_tiles = tiles_for([(product, hidden.new_empty(1, hidden.shape[1]))])

    def warm_up_kernels(self) -> None:
        """Compile the Triton kernels of the layers that have their own (the experts) before
        traffic."""
        done: set = set()
        with torch.inference_mode():
            for module in self.model.modules():
                if hasattr(module, "warm_up_kernels"):
                    module.warm_up_kernels(done)

    def warm_up_products(self, max_rows: int) -> int:
        """Run each distinct projection (one layer's and the output layer) at every row count
        up to `max_rows`, a decode step's possible batch sizes, as far as their products at
        that count cost at most `WARM_UP_ROW_FLOPS`, and to `WARM_UP_MAX_ROWS` at most: oneDNN
        builds a product kernel the first time it meets a shape (~0.3 ms), which would
        otherwise fall on live steps. Returns the last row count run (0: none)."""
        if self.packed_lm_head is None:
            return 0
        shapes: dict[tuple[int, int], Linear] = {}
        for module in self.model.modules():
            if isinstance(module, Linear):
                shapes.setdefault((module.in_features, module.out_features), module)
        hidden = self.model.embed_tokens.weight.shape[1]
        projections = [(m, m.in_features) for m in shapes.values()]
        projections.append((self.compute_logits, hidden))
        row_flops = sum(2 * m.in_features * m.out_features for m in shapes.values())
        row_flops += 2 * hidden * self.lm_head.out_features
        last = min(max_rows, WARM_UP_MAX_ROWS, int(WARM_UP_ROW_FLOPS // row_flops))
        dtype = self.model.embed_tokens.weight.dtype
        with torch.inference_mode():
            for rows in range(1, last + 1):
                for projection, features in projections:
                    projection(torch.zeros(rows, features, dtype=dtype))
        return last

    def prepack(self) -> None:
        """Once the weights are loaded: every projection and the output layer in oneDNN's
        layout where that is faster (float32 and bfloat16 on a CPU)."""
        self.packed_lm_head = PrepackedLinear.for_cpu(self.lm_head.weight)
        for module in self.model.modules():
            if callable(getattr(module, "prepack", None)):
                module.prepack()
