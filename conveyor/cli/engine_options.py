"""The options of the commands that load a model (`run-batch`, `worker`): which model, and the
engine's options."""

from __future__ import annotations

import argparse

from engine.config import parse_size
from engine.config import positive_int as _positive_int


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by every command that loads a model."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        required=True,
        help="model directory or Hugging Face model id (config, safetensors weights, tokenizer)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="name(s) the model answers to; the first is reported in each response's `model`. "
        "When given, requests whose body.model is not one of them are rejected "
        "(model_not_found). Default: the model directory's name (or the Hugging Face id); "
        "run-batch then does not check body.model",
    )
    g.add_argument(
        "--max-model-len",
        type=_positive_int,
        help="longest sequence (prompt + output) in tokens (default: the model's "
        "max_position_embeddings, capped by the KV cache size)",
    )
    g.add_argument(
        "--block-size", type=_positive_int, help="tokens per KV cache block (default 16)"
    )
    g.add_argument(
        "--num-kv-blocks",
        type=_positive_int,
        help="number of KV cache blocks (default: as many as --kv-cache-memory holds)",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        metavar="SIZE",
        help="memory for the KV cache, e.g. 4GiB or 512MiB (default: derived from "
        "--gpu-memory-utilization on GPU, a fixed budget on CPU)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        metavar="FRACTION",
        help="fraction of GPU memory the engine may use when --kv-cache-memory is not given "
        "(default 0.9)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=_positive_int,
        help="most sequences in one batch (default 256)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        help="most tokens processed in one engine step (default 4096)",
    )
    g.add_argument(
        "--dtype",
        help="weight and activation dtype: auto, float32, float16, bfloat16 (default auto)",
    )
    g.add_argument("--device", help="cpu, cuda, cuda:N or auto (default auto)")
    g.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not share KV cache blocks between requests with a common prefix",
    )
    g.add_argument("--seed", type=int, help="engine random seed (default 0)")
    g.add_argument(
        "--admission-policy",
        choices=("cache_aware", "fcfs"),
        help="which waiting requests to admit first: cache_aware (longest cached prefix first, "
        "one computation per shared prefix; the default) or fcfs (arrival order)",
    )
    g.add_argument(
        "--max-waiting-time",
        type=float,
        metavar="SECONDS",
        help="a request waiting this long is admitted before all others (default 30)",
    )
    g.add_argument(
        "--attention-backend",
        help="attention implementation: auto or a backend name the engine knows (default auto)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """`LLM(...)` keyword arguments for the options the user gave; the rest keep engine defaults."""
    names = {
        "max_model_len": "max_model_len",
        "block_size": "block_size",
        "num_kv_blocks": "num_kv_blocks",
        "kv_cache_memory": "kv_cache_memory",
        "gpu_memory_utilization": "gpu_memory_utilization",
        "max_num_seqs": "max_num_seqs",
        "max_num_batched_tokens": "max_num_batched_tokens",
        "dtype": "dtype",
        "device": "device",
        "seed": "seed",
        "attention_backend": "attention_backend",
        "admission_policy": "admission_policy",
        "max_waiting_time": "max_waiting_time",
    }
    kwargs: dict[str, object] = {}
    for attr, name in names.items():
        value = getattr(args, attr, None)
        if value is not None:
            kwargs[name] = value
    if getattr(args, "no_prefix_caching", False):
        kwargs["enable_prefix_caching"] = False
    return kwargs
