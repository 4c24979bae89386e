"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B)."""

from torch import nn

from conveyor.engine.models.decoder import DecoderForCausalLM
from conveyor.engine.models.moe import qwen_moe_mlp


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    """Qwen2's decoder (q/k/v biases as `qkv_bias` says) whose MLPs are the top
    `num_experts_per_tok` of `num_experts` experts by a softmax router (renormalised when
    `norm_topk_prob`) plus a shared expert that a sigmoid gate scales; a layer in
    `mlp_only_layers`, or off every `decoder_sparse_step`-th, keeps a dense MLP."""

    qkv_bias = True

    @classmethod
    def make_mlp(cls, config, layer_idx: int) -> nn.Module:
        return qwen_moe_mlp(config, layer_idx, shared_expert=True)
