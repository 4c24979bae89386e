"""Building blocks shared by the decoder models."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.engine.batch_invariant import Product, in_row_tiles, tiles_for
from conveyor.kernels import native_layers
from conveyor.kernels.compile_limits import compile_kernel

# How a module runs its elementwise steps (norms, rope, activation): torch's eager ops, fused
# loops compiled by inductor, `kernels.native_layers` (bfloat16, AVX512-BF16 CPUs) or
# `kernels.triton_layers` (CUDA).
EAGER, COMPILED, NATIVE, TRITON = "eager", "compiled", "native", "triton"
# and a mixture-of-experts layer's experts, besides NATIVE and TRITON: torch's grouped products
GROUPED = "grouped"


@functools.cache
def triton_layers():
    """`kernels.triton_layers`, imported on first use: Triton is installed only for GPUs."""
    from conveyor.kernels import triton_layers

    return triton_layers


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # normalise in float32, scale in the model's dtype, as the reference implementation does
    normed = F.rms_norm(x.float(), x.shape[-1:], eps=eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add and the next norm."""
    total = x + residual
    return rms_norm(total, weight, eps), total


@functools.cache
def compiled_rms_norm() -> Callable[..., torch.Tensor]:
    """`rms_norm` as one fused loop (inductor): on the CPU eager bfloat16 makes four passes
    and converts twice, 20x slower at 4,096 tokens. One graph for every token count."""
    compiled = compile_kernel(rms_norm, dynamic=True)

    def run(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        any_token_count(x)
        return compiled(x, weight, eps)

    return run


@functools.cache
def compiled_add_rms_norm() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """`add_rms_norm` as one fused loop (inductor)."""
    compiled = compile_kernel(add_rms_norm, dynamic=True)

    def run(x, residual, weight, eps):
        any_token_count(x, residual)
        return compiled(x, residual, weight, eps)

    return run


def any_token_count(*tensors: torch.Tensor) -> None:
    """Mark dim 0 (tokens) of a compiled function's inputs as one size known only at run
    time. Else dynamo specialises on a count of 1, or on a count that happens to equal another
    dim (duck sizing), and compiles again for the next step's count: seconds each time, after
    the warm-up, on a live request."""
    from torch._dynamo.decorators import mark_unbacked  # dynamo's import takes ~1.6 s: not at start

    for t in tensors:
        mark_unbacked(t, 0, shape_id="tokens")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.impl = EAGER  # see `DecoderForCausalLM.use_elementwise`

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The norm of x; with `residual`, (the norm of x + residual, x + residual). The
        native and Triton kernels write the sum into `residual` itself and return it."""
        if self.impl in (NATIVE, TRITON):
            fused = native_layers if self.impl == NATIVE else triton_layers()
            out = fused.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is None:
            norm = compiled_rms_norm() if self.impl == COMPILED else rms_norm
            return norm(x, self.weight, self.eps)
        add_norm = compiled_add_rms_norm() if self.impl == COMPILED else add_rms_norm
        return add_norm(x, residual, self.weight, self.eps)


class RunsActivation:
    """A module whose act(gate) * up runs as its `impl`: `NATIVE` or `TRITON` (fused kernels,
    SiLU only) or `EAGER` (set by `DecoderForCausalLM.use_elementwise`). `activation` is the
    config's name for act: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU)."""

    impl: str = EAGER
    activation: str = "silu"

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up for rows of [gate | up]."""
        gate, up = gate_up.chunk(2, dim=-1)
        if self.activation != "silu":  # the fused kernels are SiLU's
            return GATED_ACTIVATIONS[self.activation](gate) * up
        if self.impl == NATIVE:
            return native_layers.silu_mul(gate_up)
        if self.impl == TRITON:
            return triton_layers().silu_mul(gate_up)
        return F.silu(gate) * up


class RunsExperts:
    """A mixture-of-experts layer's experts, which run as `kernel`: `NATIVE`
    (kernels.native_experts, x86 CPUs), `TRITON` (kernels.triton_moe, CUDA) or `GROUPED`
    (torch's grouped products; set by `DecoderForCausalLM.use_experts`). `inter` is each
    expert's intermediate size."""

    kernel: str = GROUPED
    inter: int

    def use_kernel(self, kernel: str) -> None:
        self.kernel = kernel


# a config's `hidden_act` / `hidden_activation` -> the function, as transformers' ACT2FN has it
GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}


class RowTiled:
    """A module whose matrix products run in tiles of fixed rows once `row_tiles` holds the
    tile sizes they may use (batch-invariant mode, `engine.batch_invariant`)."""

    row_tiles: tuple[int, ...] = ()

    def tile_products(self) -> list[tuple[Product, torch.Tensor]]:
        """Each product the module runs, with an input row of its width, dtype and device."""
        raise NotImplementedError

    def tile_kind(self) -> tuple:
        """What decides the order of the module's sums (kind, shapes, dtype, device, layout):
        modules of one kind may run the same tiles, whatever their weights hold."""
        raise NotImplementedError

    def use_row_tiles(self, known: dict[tuple, tuple[int, ...]]) -> None:
        """Set `row_tiles`, checked once per kind of module (`known`: kind -> tiles)."""
        kind = self.tile_kind()
        if kind not in known:
            known[kind] = tiles_for(self.tile_products())
        self.row_tiles = known[kind]


class Linear(RowTiled, nn.Linear):
    """`nn.Linear` that runs through a oneDNN copy of its weight once `prepack` made one (a
    CPU whose torch has the oneDNN ops): 7% off a 128-request workload in bfloat16
    (bench/engine_ceiling.py's), the same outputs. The plain weight is dropped then, so the
    model's memory does not double."""

    packed: PrepackedLinear | None = None

    def prepack(self) -> None:
        self.packed = PrepackedLinear.for_cpu(self.weight)
        if self.packed is not None:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_tiles:
            return in_row_tiles(self._product, x, self.row_tiles)
        return self._product(x)

    def tile_products(self) -> list[tuple[Product, torch.Tensor]]:
        return [(self._product, self.weight.new_empty(1, self.in_features))]

    def tile_kind(self) -> tuple:
        w = self.weight
        packed, bias = self.packed is not None, self.bias is not None
        return ("linear", self.in_features, self.out_features, w.dtype, w.device, packed, bias)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x, self.bias)
        return super().forward(x)


class PackedLinear(Linear):
    """Several projections of the same input stacked into one matmul (e.g. q, k and v).

    `shards` names the checkpoint's separate projections in order with their output sizes; the
    loader copies each into its rows.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool):
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = shards

    def shard_rows(self, name: str) -> slice:
        start = 0
        for shard, size in self.shards.items():
            if shard == name:
                return slice(start, start + size)
            start += size
        raise KeyError(name)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(list(self.shards.values()), dim=-1)

    def forward_shards(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each shard's output. On the CPU without a oneDNN copy, a wide packed product runs
        as one product per shard: MKL does [4096, 512] x [512, 2816] at ~165 GFLOP/s and each
        1408-wide half at ~200."""
        plain = self.packed is None and x.device.type == "cpu" and not self.row_tiles
        if not plain or self.out_features <= CPU_PACKED_MAX_OUT:
            return self.split(self(x))
        outs, start = [], 0
        for size in self.shards.values():
            rows = slice(start, start + size)
            bias = None if self.bias is None else self.bias[rows]
            outs.append(F.linear(x, self.weight[rows], bias))
            start += size
        return tuple(outs)


CPU_PACKED_MAX_OUT = 2048


# oneDNN keeps one product kernel per shape it has run, row count included, in a cache of 1,024
# by default. A decode step's batch sizes (up to max_num_seqs) times a model's five projection
# shapes overflow it, and then kernels are built again and again (~0.3 ms each): at 256 batch
# sizes, a sweep over them all ran 2.4x slower the second time than with room for every one.
ONEDNN_CACHE_CAPACITY = 8192
# Each of those kernels holds 0.6-0.9 MB, and a step's row count is any number up to
# max_num_batched_tokens: a worker meeting the counts one by one grew by that much for each new
# one, towards 8,192 kernels. Above the sizes the warm-up builds, rows are padded to one of 16
# counts per doubling (`onednn_rows`), at most 1/16 more of them: 160 counts up to 4,096.
EXACT_ROWS = 64
COUNTS_PER_DOUBLING = 16


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN product of `rows` rows runs at: `rows` up to `EXACT_ROWS`, above
    it the next multiple of a sixteenth of the power of two below it."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << ((rows - 1).bit_length() - COUNTS_PER_DOUBLING.bit_length())
    return -(-rows // step) * step


@functools.cache
def onednn_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked products run `dtype` on this CPU (its bfloat16 path needs
    avx512bw/vl/dq or avx_ne_convert: on AVX2 alone its reorder refuses)."""
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    if dtype == torch.float32:
        return True
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return dtype == torch.bfloat16 and check is not None and bool(check())


class PrepackedLinear:
    """`x @ weight.T` through oneDNN with the weight reordered once into its blocked layout:
    for a wide output layer (the 32,000-way logits) and the few hundred rows of a decode
    step, 1.1-2x faster on the CPU than MKL's product on the plain weight in float32, 1.1-1.2x
    in bfloat16 (the same results). A copy of the weight, so only on a CPU whose torch has the
    oneDNN ops (see `for_cpu`)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())

    @classmethod
    def for_cpu(cls, weight: torch.Tensor) -> PrepackedLinear | None:
        if weight.device.type != "cpu" or not onednn_runs(weight.dtype):
            return None
        # read by oneDNN when it makes its cache, at the first oneDNN op of the process
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))
        return cls(weight)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        rows = flat.shape[0]
        if (padded := onednn_rows(rows)) != rows:
            flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[1])])
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, bias, "none", [], "")
        return out[:rows].view(*x.shape[:-1], self.out_features)


class RotaryEmbedding(nn.Module):
    """RoPE with a precomputed cos/sin table, in the half-rotation layout of HF checkpoints,
    over the first `rotary_dim` channels of each head. With LongRoPE the table holds the short
    factors' rows, then as many rows of the long factors', and `long_rope` says which a token
    reads."""

    def __init__(self, config, head_dim: int, max_positions: int, layer_type: str | None = None):
        super().__init__()
        inv_freq, scaling = rope_frequencies(config, head_dim, layer_type)
        tables = [inv_freq]
        self.long_rope: LongRope | None = None
        if rope_parameters(config, layer_type).get("rope_type") == "longrope":
            tables.append(long_rope_frequencies(config))
            self.long_rope = LongRope(original_max_positions(config), max_positions)
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = torch.cat([positions[:, None] * table[None, :] for table in tables])
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos/sin rows for `positions` (rows of the table: see `LongRope`), shaped to
        broadcast over heads: [T, 1, rotary_dim]."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(
            dtype
        )


@dataclass(frozen=True)
class LongRope:
    """Which of LongRoPE's two sets of factors a sequence's rope uses, as transformers chooses:
    the short ones while the sequence is at most `original_max_position_embeddings` long, then
    the long ones for every position, its KV computed again (`generate` drops its cache when the
    sequence first grows past that length). A sequence on the long factors has `rope_long` set:
    its positions read the long rows of the table, and its cache keys differ from a short
    sequence's with the same tokens."""

    original_max: int
    offset: int  # rows of the short factors' table; the long factors' rows follow

    def is_long(self, num_tokens: int) -> bool:
        return num_tokens > self.original_max

    def rows(self, start: int, count: int, rope_long: bool) -> range:
        """The table rows of positions `start` .. `start + count - 1`."""
        first = start + self.offset if rope_long else start
        return range(first, first + count)


Rope = tuple[torch.Tensor, torch.Tensor]


def apply_rope(rope: Rope, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rope
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@functools.cache
def compiled_apply_rope() -> Callable[[Rope, torch.Tensor, torch.Tensor], tuple]:
    """`apply_rope` as one fused loop per tensor (inductor): eager makes six passes and two
    concatenations. One graph for every token count."""
    compiled = compile_kernel(apply_rope, dynamic=True)

    def run(rope: Rope, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        any_token_count(*rope, q, k)
        return compiled(rope, q, k)

    return run


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The config's rope parameters; of `layer_type` where they differ by layer type (Gemma 3:
    `sliding_attention` and `full_attention`), else of the first type."""
    params = getattr(config, "rope_parameters", None)  # transformers >= 5
    if per_layer_type_rope(config):
        return dict(params[layer_type or next(iter(params))])
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


# rope types this engine computes: fixed frequencies, or LongRoPE's two sets (`LongRope`);
# "dynamic" changes them with the sequence's length and is refused at load
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def per_layer_type_rope(config) -> bool:
    """Whether the config gives each layer type rope parameters of its own (Gemma 3)."""
    params = getattr(config, "rope_parameters", None) or {}
    return bool(params) and "rope_type" not in params and "rope_theta" not in params


def rope_types(config) -> list[str]:
    """Every rope type the config uses (one per layer type, where they differ)."""
    kinds = list(config.rope_parameters) if per_layer_type_rope(config) else [None]
    return [rope_parameters(config, kind).get("rope_type", "default") for kind in kinds]


def rope_frequencies(
    config, head_dim: int, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scaling, using transformers' own rope_scaling code."""
    params = rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
    if rope_type == "default":
        base, dim = params["rope_theta"], rotary_dim(config, head_dim)
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (base**exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
    # on the device the model is built on (the default one), where the positions are
    device = torch.get_default_device()
    if layer_type is not None:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device, layer_type=layer_type)
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device)
    return inv_freq.float(), float(scaling)


def long_rope_frequencies(config) -> torch.Tensor:
    """LongRoPE's inverse frequencies past `original_max_position_embeddings` (its long
    factors); `rope_frequencies` gives the short ones and the scaling both share."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    device = torch.get_default_device()
    seq_len = original_max_positions(config) + 1
    inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, device, seq_len=seq_len)
    return inv_freq.float()


def original_max_positions(config) -> int:
    """LongRoPE's `original_max_position_embeddings`: in the rope parameters (transformers 5),
    else on the config itself (Phi-3's configs, read by older transformers)."""
    value = rope_parameters(config).get("original_max_position_embeddings")
    return int(value or config.original_max_position_embeddings)


def partial_rotary_factor(config) -> float:
    """The share of each head's channels that rope turns (Phi-4-mini: 0.75), where the rest
    pass through unchanged."""
    factor = rope_parameters(config).get("partial_rotary_factor")
    return float(factor or getattr(config, "partial_rotary_factor", None) or 1.0)


def rotary_dim(config, head_dim: int) -> int:
    return int(head_dim * partial_rotary_factor(config))
