"""Mixtral: Mistral's decoder with a mixture of experts in every layer."""

from conveyor.engine.models.decoder import DecoderForCausalLM
from conveyor.engine.models.moe import MIXTRAL_EXPERT_NAMES, SparseMoe


class MixtralForCausalLM(DecoderForCausalLM):
    """Mistral's decoder whose every MLP is the top `num_experts_per_tok` of
    `num_local_experts` SwiGLU experts, by a softmax router with the chosen weights
    renormalised (and kept in float32); checkpoint names `block_sparse_moe` and `w1`/`w3`/`w2`."""

    checkpoint_renames = {".mlp.": ".block_sparse_moe."}

    @classmethod
    def make_mlp(cls, config, layer_idx: int) -> SparseMoe:
        return SparseMoe(
            config,
            config.num_local_experts,
            config.intermediate_size,
            norm_topk_prob=True,
            float_weights=True,
            names=MIXTRAL_EXPERT_NAMES,
        )
