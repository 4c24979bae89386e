"""Sparse mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE), routed as transformers routes.

A softmax router picks each token's top-k experts. The experts run as grouped matrix products:
the (token, expert) pairs are sorted by expert, each expert's rows are one contiguous group, and
one grouped product per projection covers every expert (`torch.nn.functional.grouped_mm`; where
this torch or device has none, one product per expert that got tokens). The outputs are weighted,
put back in token order and summed over each token's k experts, in transformers' order. How the
experts run is the device plan's choice (`RunsExperts.kernel`): on CUDA two Triton launches
(`kernels.triton_moe`), on an x86 CPU our own kernels, which take the whole routed layer in one
call (`kernels.native_experts`), elsewhere the grouped products above.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.engine.batch_invariant import Product, in_row_tiles
from conveyor.engine.models.decoder import MLP, activation_of, dense_mlp
from conveyor.engine.models.layers import (
    NATIVE,
    TRITON,
    Linear,
    RowTiled,
    RunsActivation,
    RunsExperts,
)
from conveyor.kernels import native_experts

log = logging.getLogger(__name__)

# (gate, up, down) as each family's checkpoint names one expert's projections
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> str | None:
    """None where `grouped_mm` runs experts for this device and dtype, else why not."""
    if not hasattr(F, "grouped_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
    if device.type == "cpu":
        return None
    if device.type == "cuda" and dtype == torch.bfloat16:
        major, _ = torch.cuda.get_device_capability(device)
        return None if major >= 8 else f"grouped_mm needs compute capability 8.0 (has {major}.x)"
    return f"grouped_mm does not run {dtype} on {device.type}"


@functools.cache
def triton_moe():
    """`kernels.triton_moe`, imported on first use: Triton is installed only for GPUs."""
    from conveyor.kernels import triton_moe

    return triton_moe


_told: set[str] = set()


def _tell_once(reason: str) -> None:
    if reason not in _told:
        _told.add(reason)
        log.info("experts run one product per expert: %s", reason)


class Experts(RowTiled, RunsActivation, RunsExperts, nn.Module):
    """`num_experts` gated MLPs (SwiGLU unless `activation` says otherwise) as two stacked
    weights: `gate_up` [E, 2·inter, hidden] (each expert's gate rows, then its up rows) and
    `down` [E, hidden, inter]."""

    def __init__(self, num_experts: int, hidden: int, inter: int, names=EXPERT_NAMES):
        super().__init__()
        self.num_experts, self.inter = num_experts, inter
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.names = names
        self.grouped: bool | None = None  # decided by `prepack`, from the weights' device and dtype
        self.native_layout = False  # the weights laid out for `native_experts` (`use_kernel`)
        # the model's dtype while the weights are held in their checkpoint's bfloat16 (`hold_in`)
        self.computes_in: torch.dtype | None = None

    def checkpoint_names(self, prefix: str) -> dict[str, tuple[str, Any]]:
        """checkpoint tensor name -> (our parameter, its index) for every expert."""
        gate, up, down = self.names
        rows = {gate: slice(0, self.inter), up: slice(self.inter, 2 * self.inter)}
        names: dict[str, tuple[str, Any]] = {}
        for e in range(self.num_experts):
            for name, part in rows.items():
                names[f"{prefix}.{e}.{name}.weight"] = (f"{prefix}.gate_up", (e, part))
            names[f"{prefix}.{e}.{down}.weight"] = (f"{prefix}.down", e)
        return names

    def tile_products(self) -> list[tuple[Product, torch.Tensor]]:
        return [
            (functools.partial(F.linear, weight=w[0]), w.new_empty(1, w.shape[2]))
            for w in (self.gate_up, self.down)
        ]

    def use_row_tiles(self, known: dict[tuple, tuple[int, ...]]) -> None:
        if not self.native_layout:  # the native kernel's rows never depend on the step's others
            super().use_row_tiles(known)

    def tile_kind(self) -> tuple:
        w = self.gate_up
        return ("experts", tuple(w.shape[1:]), tuple(self.down.shape[1:]), w.dtype, w.device)

    def hold_in(self, stored: torch.dtype) -> None:
        """Hold the weights in `stored`, the checkpoint's dtype (bfloat16), not the model's,
        until `use_kernel` knows whether the kernel reads them so (float32's native experts
        do) or they must widen: a bfloat16 checkpoint computing in float32 never holds its
        experts in float32, twice the bytes, where the native kernel runs them."""
        self.computes_in = self.computes_in or self.gate_up.dtype
        for weight in (self.gate_up, self.down):
            weight.data = torch.empty(weight.shape, dtype=stored, device=weight.device)

    def use_kernel(self, kernel: str) -> None:
        """Run as `kernel` (engine.device_plan chooses) from now on. Where `native_experts`
        runs this layer (`kernel` NATIVE, with SiLU, of sizes it takes), its weights are laid
        out now, in place, as it reads them; float32 weights that are bfloat16 values (a
        bfloat16 checkpoint, held in bfloat16 or not) stay in bfloat16, the same results.
        Elsewhere the weights are in the model's dtype."""
        self.kernel = kernel
        if self.native_layout:
            return
        dtype = self.computes_in or self.gate_up.dtype
        weights = (self.gate_up, self.down)
        native = kernel == NATIVE and self.activation == "silu"
        if native and native_experts.covers(dtype, self.gate_up.shape[2], self.inter):
            compact = dtype == torch.float32 and all(
                w.dtype == torch.bfloat16 or native_experts.exactly_bfloat16(w) for w in weights
            )
            for weight in weights:
                weight.data = native_experts.layout(weight.data, compact)
            self.native_layout = True
        else:
            for weight in weights:
                weight.data = weight.data.to(dtype)
        self.computes_in = None

    def prepack(self) -> None:
        """Once the weights are loaded: grouped products where this device runs them."""
        dtype = self.computes_in or self.gate_up.dtype
        reason = grouped_mm_supported(self.gate_up.device, dtype)
        self.grouped = reason is None
        if reason is not None:
            _tell_once(reason)

    def forward(
        self, x: torch.Tensor, top_index: torch.Tensor, top_weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden]; each token's experts and their weights [T, k] -> [T, hidden]."""
        k = top_index.shape[-1]
        if self.kernel == TRITON and not self.row_tiles:  # both products fused, one launch each
            out = triton_moe().expert_products(x, self.gate_up, self.down, top_index)
            out = out * top_weights.reshape(-1, 1)
            return out.view(x.shape[0], k, -1).sum(dim=1).to(x.dtype)
        if self.native_layout:
            return native_experts.routed_experts(
                x, top_index, top_weights, self.gate_up, self.down, self.inter
            )
        expert_ids, perm = torch.sort(top_index.reshape(-1), stable=True)
        rows = x.index_select(0, perm // k)
        if self.grouped is None:
            self.prepack()
        # not bincount: its length depends on the values, which a CUDA graph cannot capture
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, expert_ids, torch.ones_like(expert_ids))
        out = self._linear(self.silu_and_mul(self._linear(rows, self.gate_up, counts)),
                           self.down, counts)  # fmt: skip
        out = out * top_weights.reshape(-1)[perm].unsqueeze(-1)
        in_order = torch.empty_like(out)
        in_order[perm] = out
        return in_order.view(x.shape[0], k, -1).sum(dim=1).to(x.dtype)

    def _linear(self, rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor):
        """rows grouped by expert (`counts` each) times their expert's `weight`ᵀ."""
        if self.grouped and not self.row_tiles:
            offsets = counts.cumsum(0, dtype=torch.int32)
            return F.grouped_mm(rows, weight.transpose(1, 2), offs=offsets)
        out = rows.new_empty(rows.shape[0], weight.shape[1])
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                expert = functools.partial(F.linear, weight=weight[e])
                part = rows[start : start + n]
                out[start : start + n] = (
                    in_row_tiles(expert, part, self.row_tiles) if self.row_tiles else expert(part)
                )
                start += n
        return out


class SparseMoe(nn.Module):
    """The MLP of a mixture-of-experts layer: `gate` routes each token to `top_k` of the
    experts; with `shared_inter`, a shared SwiGLU expert whose output a sigmoid gate scales is
    added (Qwen2-MoE)."""

    def __init__(
        self,
        config,
        num_experts: int,
        inter: int,
        *,
        norm_topk_prob: bool,
        float_weights: bool = False,
        names=EXPERT_NAMES,
        shared_inter: int = 0,
    ):
        super().__init__()
        hidden = config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = norm_topk_prob
        # Mixtral weighs the experts' outputs in float32, the Qwen families in the model's dtype
        self.float_weights = float_weights
        self.gate = Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, inter, names)
        self.experts.activation = activation_of(config)
        self.shared_expert = (
            MLP(hidden, shared_inter, bias=False, activation=activation_of(config))
            if shared_inter
            else None
        )
        self.shared_expert_gate = Linear(hidden, 1, bias=False) if shared_inter else None

    def warm_up_kernels(self, done: set) -> None:
        """Compile the Triton experts kernels' variants now, where they run (once per kind of
        layer in `done`)."""
        experts = self.experts
        if experts.kernel != TRITON or experts.row_tiles:
            return
        kind = (experts.gate_up.shape, experts.down.shape, experts.gate_up.dtype, self.top_k)
        if kind not in done:
            done.add(kind)
            triton_moe().warm_up(experts.gate_up, experts.down, self.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_weights, top_index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        if not self.float_weights:
            top_weights = top_weights.to(logits.dtype)
        out = self.experts(x, top_index, top_weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def qwen_moe_mlp(config, layer_idx: int, shared_expert: bool) -> nn.Module:
    """A Qwen MoE layer's MLP, by transformers' rule: a dense one in a layer of
    `mlp_only_layers` or off every `decoder_sparse_step`-th, else the experts (with Qwen2-MoE's
    gated shared expert where `shared_expert`)."""
    sparse = (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )
    if not sparse:
        return dense_mlp(config)
    return SparseMoe(
        config,
        config.num_experts,
        config.moe_intermediate_size,
        norm_topk_prob=config.norm_topk_prob,
        shared_inter=config.shared_expert_intermediate_size if shared_expert else 0,
    )
