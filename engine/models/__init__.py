from conveyor.engine.models.decoder import DecoderForCausalLM
from conveyor.engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from conveyor.engine.models.llama import LlamaForCausalLM
from conveyor.engine.models.mixtral import MixtralForCausalLM
from conveyor.engine.models.olmo2 import Olmo2ForCausalLM
from conveyor.engine.models.phi3 import Phi3ForCausalLM
from conveyor.engine.models.qwen2 import Qwen2ForCausalLM
from conveyor.engine.models.qwen2_moe import Qwen2MoeForCausalLM
from conveyor.engine.models.qwen3 import Qwen3ForCausalLM
from conveyor.engine.models.qwen3_moe import Qwen3MoeForCausalLM

# a checkpoint's `architectures[0]` -> the class that runs it; any other is refused at load
MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}

# a multimodal checkpoint -> its language model's class: served text only (images are refused)
TEXT_OF_MULTIMODAL: dict[str, str] = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}

__all__ = ["MODEL_REGISTRY", "TEXT_OF_MULTIMODAL", "DecoderForCausalLM"]
