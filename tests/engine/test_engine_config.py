"""`EngineConfig`: its checks, the engine built from it or from keyword options, and the
engine modules that load without torch."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from conveyor.engine.config import EngineConfig, parse_size

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"block_size": 0}, "block_size must be positive, got 0"),
        ({"max_num_seqs": 0}, "max_num_seqs and max_num_batched_tokens must be positive"),
        ({"max_num_batched_tokens": 0}, "max_num_seqs and max_num_batched_tokens must be positive"),
        ({"admission_policy": "lifo"}, "admission_policy must be 'cache_aware' or 'fcfs'"),
        ({"max_waiting_time": -1}, "max_waiting_time must be >= 0 seconds, got -1"),
        ({"prompt_logprobs_memory": 0}, "prompt_logprobs_memory must be positive, got 0"),
    ],
)
def test_invalid_options_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(**options)


def test_help_states_the_defaults() -> None:
    """A `(default X)` in an option's help is the field's default."""
    for f in fields(EngineConfig):
        stated = re.search(r"\(default ([^):]+)\)", f.metadata["help"])
        if stated:
            default = f.default
            if f.metadata.get("type") is parse_size:  # a size reads as it is written: 256MiB
                assert parse_size(stated.group(1)) == default, f.name
                continue
            shown = f"{default:g}" if isinstance(default, float) else str(default)
            assert stated.group(1) == shown, f.name


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("1KiB", 1024), ("1.5GiB", 3 * 2**29),
        ("2G", 2 * 10**9), ("2GB", 2 * 10**9), ("512mb", 512 * 10**6),  # G and GB are 10^9
        (" 4 gib ", 4 * 2**30), ("1e9", 10**9), ("123", 123), ("2.5", 2),
    ],
)  # fmt: skip
def test_a_size_reads_as_the_flags_say(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["abc", "4 parsecs", "GiB", "0", "0GiB", "-1", "inf", "nan"])
def test_a_size_that_is_none_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(text))):
        parse_size(text)


def test_engine_takes_a_config_or_options(checkpoints) -> None:
    from conveyor.engine import LLM

    path = str(checkpoints["llama"])
    config = EngineConfig(device="cpu", max_num_seqs=8, num_kv_blocks=32, block_size=8)
    llm = LLM(path, config)
    assert llm.engine_config is config
    assert (llm.block_size, llm.scheduler.max_num_seqs, llm.stats().kv_blocks_total) == (8, 8, 32)
    same = LLM(path, device="cpu", max_num_seqs=8, num_kv_blocks=32, block_size=8)
    assert same.engine_config == config
    with pytest.raises(TypeError, match="not both"):
        LLM(path, config, max_num_seqs=4)
    with pytest.raises(ValueError, match="block_size must be positive"):
        LLM(path, device="cpu", block_size=0)


def test_config_sampling_params_and_outputs_import_without_torch() -> None:
    code = (
        "import sys, conveyor.engine.config, conveyor.engine.sampling_params;"
        "import conveyor.engine.outputs;"
        "from conveyor.engine import EngineConfig, SamplingParams, RequestOutput;"
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_command_line_flags_make_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from conveyor.cli import build_parser
    from conveyor.cli.engine_options import engine_config

    flags = [
        "--max-model-len", "64", "--block-size", "8", "--num-kv-blocks", "32",
        "--kv-cache-memory", "1KiB", "--gpu-memory-utilization", "0.5", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "128", "--dtype", "float32", "--device", "cpu",
        "--no-prefix-caching", "--seed", "7", "--admission-policy", "fcfs",
        "--max-waiting-time", "2.5", "--attention-backend", "sdpa",
    ]  # fmt: skip
    expected = EngineConfig(
        max_model_len=64, block_size=8, num_kv_blocks=32, kv_cache_memory=1024,
        gpu_memory_utilization=0.5, max_num_seqs=4, max_num_batched_tokens=128,
        dtype="float32", device="cpu", enable_prefix_caching=False, seed=7,
        admission_policy="fcfs", max_waiting_time=2.5, attention_backend="sdpa",
    )  # fmt: skip
    run_batch = ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--model", "m"]
    assert engine_config(build_parser().parse_args([*run_batch, *flags])) == expected
    assert engine_config(build_parser().parse_args(run_batch)) == EngineConfig()

    # the test session sets these
    for name in ("CONVEYOR_DTYPE", "CONVEYOR_ATTENTION_BACKEND", "CONVEYOR_ELEMENTWISE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CONVEYOR_MAX_NUM_SEQS", "4")
    monkeypatch.setenv("CONVEYOR_NO_PREFIX_CACHING", "true")
    worker = engine_config(build_parser().parse_args(["worker", "--model", "m"]))
    assert worker == EngineConfig(max_num_seqs=4, enable_prefix_caching=False)


def test_the_engine_reports_what_a_token_of_context_takes(checkpoints):
    """K and V, every layer, every KV head: what capacity planning divides the cache by."""
    from conveyor.engine import LLM

    llm = LLM(str(checkpoints["qwen3"]), device="cpu", dtype="bfloat16")
    model = llm.runner.model
    want = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 2
    assert llm.stats().kv_bytes_per_token == want == 2 * 2 * 2 * 32 * 2
