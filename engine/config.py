"""`EngineConfig`: every option of the engine, with its default, its meaning and its checks.

The command line's engine flags (and so `conveyor worker`'s `CONVEYOR_<OPTION>` variables) are
derived from these fields: each field's metadata holds its `--help` text and how its flag reads
a value (argparse's `type`, `metavar`, `choices`). Torch-free: `dtype`, `device` and
`attention_backend` stay names here; the engine resolves them when it loads the model.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ADMISSION_POLICIES = ("cache_aware", "fcfs")
GENERATION_CONFIGS = ("auto", "vllm")
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # conveyor.wire_format.reasoning.PARSERS
MARKERS_PREFIX = "markers:"  # --reasoning-parser markers:START,END: the model's own markers


def reasoning_parser_name(value: str) -> str:
    """A --reasoning-parser value: a parser's name, or `markers:START,END` naming the markers
    a model's thinking sits between (both non-empty, neither holding a comma)."""
    if value in REASONING_PARSERS:
        return value
    if value.startswith(MARKERS_PREFIX):
        parts = value[len(MARKERS_PREFIX) :].split(",")
        if len(parts) == 2 and all(p.strip() for p in parts):
            return value
        raise argparse.ArgumentTypeError(
            f"--reasoning-parser {value!r}: give markers:START,END, e.g. "
            "markers:<reasoning>,</reasoning>"
        )
    raise argparse.ArgumentTypeError(
        f"--reasoning-parser {value!r}: choose {', '.join(REASONING_PARSERS)} or markers:START,END"
    )


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")  # conveyor.wire_format.tool_calls


# The readers below raise argparse's error type: a command line shows its message as it is.
def parse_size(text: str) -> int:
    """Bytes from `4GiB`, `512MiB`, `2G`, `1e9` or a plain integer. pydantic's `ByteSize` reads
    the units (`GB` is 10^9 bytes, `GiB` 2^30); a plain number is read here, as `ByteSize`
    takes no exponent (`1e9`)."""
    from pydantic import ByteSize, TypeAdapter, ValidationError  # not imported for `--help`

    try:
        value = int(float(text))
    except (ValueError, OverflowError):
        try:
            value = TypeAdapter(ByteSize).validate_python(text)
        except ValidationError:
            raise argparse.ArgumentTypeError(
                f"invalid size {text!r}; use bytes or a unit such as 512MiB, 4GiB, 2GB"
            ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def json_object(text: str) -> dict[str, Any]:
    """A JSON object from the command line, e.g. '{"enable_thinking": false}'."""
    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"want a JSON object, got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _option(default: Any, help: str, *, cli: bool = True, **flag: Any) -> Any:
    """A field whose metadata says what it means (`help`), whether it has a command-line flag
    (`cli`) and how that flag reads its value: argparse's `type`, `metavar` or `choices`, or
    `off_switch`, the name of a flag that turns a true-by-default option off (a false-by-default
    one is `action="store_true"`)."""
    return field(default=default, metadata={"help": help, "cli": cli, **flag})


@dataclass(frozen=True)
class EngineConfig:
    # fields in the order of their flags in `--help`
    max_model_len: int | None = _option(
        None,
        "longest sequence (prompt + output) in tokens (default: the model's "
        "max_position_embeddings, capped by the KV cache size)",
        type=positive_int,
    )
    block_size: int = _option(16, "tokens per KV cache block (default 16)", type=positive_int)
    num_kv_blocks: int | None = _option(
        None,
        "number of KV cache blocks (default: as many as --kv-cache-memory holds)",
        type=positive_int,
    )
    kv_cache_memory: int | None = _option(
        None,
        "memory for the KV cache, e.g. 4GiB or 512MiB (default: derived from "
        "--gpu-memory-utilization on GPU, a fixed budget on CPU)",
        type=parse_size,
        metavar="SIZE",
    )
    gpu_memory_utilization: float = _option(
        0.9,
        "fraction of GPU memory the engine may use when --kv-cache-memory is not given: the "
        "KV cache gets it less the weights and the largest step, measured at start (default 0.9)",
        type=float,
        metavar="FRACTION",
    )
    max_num_seqs: int = _option(256, "most sequences in one batch (default 256)", type=positive_int)
    max_num_batched_tokens: int = _option(
        4096, "most tokens processed in one engine step (default 4096)", type=positive_int
    )
    dtype: str | torch.dtype = _option(
        "auto", "weight and activation dtype: auto, float32, float16, bfloat16 (default auto)"
    )
    device: str = _option("auto", "cpu, cuda, cuda:N or auto (default auto)")
    enable_prefix_caching: bool = _option(
        True,
        "do not share KV cache blocks between requests with a common prefix",
        off_switch="--no-prefix-caching",
    )
    hybrid_kv_cache: bool = _option(
        True,
        "keep every layer's KV for the whole context, even where sliding-window layers mix "
        "with global ones (Gemma 2 and 3): by default their windowed layers give back what "
        "they no longer read",
        off_switch="--no-hybrid-kv-cache",
    )
    cuda_graphs: bool = _option(
        True,
        "run every step eagerly, without the CUDA graphs a GPU worker records for decode steps",
        off_switch="--enforce-eager",
    )
    batch_invariant: bool = _option(
        False,
        "batch-invariant mode: a request's tokens and logprobs do not depend on what else runs "
        "beside it, bit for bit (products in tiles of fixed rows, no cascade attention; "
        "slower, see the docs)",
        action="store_true",
    )
    seed: int = _option(0, "engine random seed (default 0)", type=int)
    admission_policy: str = _option(
        "cache_aware",
        "which waiting requests to admit first: cache_aware (longest cached prefix first, "
        "one computation per shared prefix; the default) or fcfs (arrival order)",
        choices=ADMISSION_POLICIES,
    )
    max_waiting_time: float = _option(
        30.0,
        "a request waiting this long is admitted before all others (default 30)",
        type=float,
        metavar="SECONDS",
    )
    urgent_share: float = _option(
        0.05,
        "the share of the tokens the engine computes that requests of a more urgent "
        "priority (online ones) may take while less urgent work (a batch) is present; 1 lets "
        "them take all (default 0.05)",
        type=float,
        metavar="SHARE",
    )
    attention_backend: str = _option(
        "auto", "attention implementation: auto or a backend name the engine knows (default auto)"
    )
    elementwise: str = _option(
        "auto",
        "how norms, rope and the activation run: auto (the fastest this device runs), triton "
        "(CUDA), native (bfloat16 on AVX512-BF16 CPUs), compiled (inductor, on a CPU) or eager "
        "(default auto)",
        choices=("auto", "triton", "native", "compiled", "eager"),
    )
    experts: str = _option(
        "auto",
        "how a mixture-of-experts model's experts run: auto (the fastest this device runs), "
        "triton (CUDA), native (x86 CPUs: float32 with AVX2 or AVX-512, bfloat16 with "
        "AVX512-BF16 or AMX) or grouped (torch's grouped products; default auto)",
        choices=("auto", "triton", "native", "grouped"),
    )
    sampling: str = _option(
        "auto",
        "how a sampled row's token is drawn: auto (the fastest this device runs), native (x86 "
        "CPUs with AVX2: one kernel call for the step's rows) or torch (softmax, a float64 "
        "cumulative sum and a search; default auto)",
        choices=("auto", "native", "torch"),
    )
    generation_config: str = _option(
        "auto",
        "the sampling a request that omits a field gets: auto (the checkpoint's "
        "generation_config.json temperature, top_p, top_k, min_p and repetition_penalty, as "
        "vLLM's default) or vllm (the OpenAI API's defaults, whatever the checkpoint ships; "
        "default auto)",
        choices=GENERATION_CONFIGS,
    )
    chat_template: str | None = _option(
        None,
        "the chat template, as a Jinja file or the template's text, instead of the "
        "checkpoint's (default: the checkpoint's)",
        metavar="TEMPLATE",
    )
    default_chat_template_kwargs: dict[str, Any] | None = _option(
        None,
        "variables every chat template render gets unless a request's chat_template_kwargs "
        "sets them, as a JSON object, e.g. '{\"enable_thinking\": false}' (default: none)",
        type=json_object,
        metavar="JSON",
    )
    reasoning_parser: str | None = _option(
        None,
        "split a reasoning model's thinking from its answer in chat responses: qwen3 (an "
        "output that opens a <think> block), deepseek_r1 (the output starts inside it), or "
        "markers:START,END for a model's own markers (an output that opens a block with START); "
        "the thinking goes to reasoning_content and reasoning (default: not split)",
        type=reasoning_parser_name,
        metavar="NAME",
    )
    tool_call_parser: str | None = _option(
        None,
        "read the tool calls a model writes, for chats with tools and tool_choice auto: hermes "
        "(Qwen's <tool_call> blocks), llama3_json (Llama 3's JSON calls) or mistral "
        "([TOOL_CALLS]); without it such a chat is refused (tool_choice required or a named "
        "function needs none: the grammar forces the call; default: none)",
        choices=TOOL_CALL_PARSERS,
    )
    grammar_timeout: float = _option(
        10.0,
        "a request whose structured output (JSON schema, regex, grammar) has not compiled "
        "within this long fails alone; others never wait for a compile (default 10)",
        type=float,
        metavar="SECONDS",
    )
    prompt_logprobs_memory: int = _option(
        256 * 2**20,
        "memory for the logits of one chunk of prompt logprobs: a long prompt's are computed "
        "this many bytes at a time, e.g. 256MiB (default 256MiB)",
        type=parse_size,
        metavar="SIZE",
    )
    lpm_max_waiting: int = _option(
        128,
        "with more waiting sequences than this, admit in arrival order instead of sorting them "
        "by cached prefix length (default 128)",
        cli=False,
    )

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None:
            try:
                reasoning_parser_name(self.reasoning_parser)
            except argparse.ArgumentTypeError as err:
                raise ValueError(str(err)) from None
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.admission_policy not in ADMISSION_POLICIES:
            raise ValueError(
                f"admission_policy must be 'cache_aware' or 'fcfs', got {self.admission_policy!r}"
            )
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(
                f"generation_config must be 'auto' or 'vllm', got {self.generation_config!r}"
            )
        if self.max_waiting_time < 0:
            raise ValueError(f"max_waiting_time must be >= 0 seconds, got {self.max_waiting_time}")
        if not 0 < self.urgent_share <= 1:
            raise ValueError(f"urgent_share must be in (0, 1], got {self.urgent_share}")
        if self.prompt_logprobs_memory < 1:
            raise ValueError(
                f"prompt_logprobs_memory must be positive, got {self.prompt_logprobs_memory}"
            )
        if not self.grammar_timeout > 0:
            raise ValueError(f"grammar_timeout must be > 0 seconds, got {self.grammar_timeout}")
