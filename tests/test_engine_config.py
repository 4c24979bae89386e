"""`EngineConfig`: its checks, the engine built from it or from keyword options, and the
engine modules that load without torch."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from engine.config import EngineConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"block_size": 0}, "block_size must be positive, got 0"),
        ({"max_num_seqs": 0}, "max_num_seqs and max_num_batched_tokens must be positive"),
        ({"max_num_batched_tokens": 0}, "max_num_seqs and max_num_batched_tokens must be positive"),
        ({"admission_policy": "lifo"}, "admission_policy must be 'cache_aware' or 'fcfs'"),
        ({"max_waiting_time": -1}, "max_waiting_time must be >= 0 seconds, got -1"),
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
            shown = f"{default:g}" if isinstance(default, float) else str(default)
            assert stated.group(1) == shown, f.name


def test_engine_takes_a_config_or_options(checkpoints) -> None:
    from engine import LLM

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
        "import sys, engine.config, engine.sampling_params, engine.outputs;"
        "from engine import EngineConfig, SamplingParams, RequestOutput;"
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
