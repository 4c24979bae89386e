"""Paged attention backends. `torch` is the reference (CPU path, test oracle); `compiled` is
the same on the CPU with a compiled decode (our AVX512-BF16 kernel in bfloat16 where the CPU
has it, else torch.compile's); `triton` is CUDA."""

if __name__ == "kernels":
    # This folder is `conveyor.kernels`. A checkout's root on sys.path (pytest, `python -m` run
    # there) also makes it the top-level `kernels`: the name of Hugging Face's kernel hub, which
    # transformers (a dependency of it since 5.25) imports when it is installed. That name goes
    # to the installed package.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None or _spec.loader is None:
        raise ImportError(
            f"no package 'kernels' is installed; {os.path.dirname(__file__)} is "
            "conveyor.kernels, imported as that"
        )
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module
    _spec.loader.exec_module(_module)
else:
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
