"""Paged attention backends. `torch` is the reference (CPU path, test oracle); `compiled` is
the same on the CPU with a compiled decode (our AVX512-BF16 kernel in bfloat16 where the CPU
has it, else torch.compile's); `triton` is CUDA."""

from conveyor.kernels.backend import AttentionBackend
from conveyor.kernels.metadata import AttentionMetadata
from conveyor.kernels.selector import BACKENDS, get_attention_backend, triton_available
from conveyor.kernels.torch_backend import CompiledPagedAttention, TorchPagedAttention
from conveyor.kernels.triton_backend import TritonPagedAttention

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "CompiledPagedAttention",
    "TorchPagedAttention",
    "TritonPagedAttention",
    "get_attention_backend",
    "triton_available",
]
