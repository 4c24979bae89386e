"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B)."""

from torch import nn

from conveyor.engine.models.decoder import QK_NORM_PER_HEAD, DecoderForCausalLM
from conveyor.engine.models.moe import qwen_moe_mlp


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Qwen3's decoder (q/k RMSNorm) whose MLPs are the top `num_experts_per_tok` of
    `num_experts` experts by a softmax router, renormalised when `norm_topk_prob`; a layer in
    `mlp_only_layers`, or off every `decoder_sparse_step`-th, keeps a dense MLP."""

    qk_norm = QK_NORM_PER_HEAD

    @classmethod
    def make_mlp(cls, config, layer_idx: int) -> nn.Module:
        return qwen_moe_mlp(config, layer_idx, shared_expert=False)
