from conveyor.engine.models.decoder import (
    DecoderForCausalLM,
    LlamaForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

# a checkpoint's `architectures[0]` -> the class that runs it; any other is refused at load
MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}

__all__ = ["MODEL_REGISTRY", "DecoderForCausalLM"]
