"""Sliding-window attention: a layer with a window attends to the last `window` positions only,
as transformers masks it, in every backend, with prefix caching, chunked prefill and
preemption on; prompts and outputs run well past the window."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.demo_model import write_tiny_model
from conveyor.engine import LLM, SamplingParams
from conveyor.engine.loader import load_config
from conveyor.engine.models.decoder import layer_windows
from tests.hf_reference import hf_greedy, random_prompts

WINDOW = 16
PROMPTS = random_prompts(10, 1, 120, seed=4)
MAX_TOKENS = [30, 5, 40, 1, 12, 33, 7, 25, 18, 9]
CONFIGS = {
    "default": {},
    "block-8-chunked-prefill": {"block_size": 8, "max_num_batched_tokens": 32},
    "tiny-pool-preempts": {"block_size": 8, "num_kv_blocks": 24, "max_model_len": 192},
    "eager-attention": {"attention_backend": "torch"},
}


@pytest.fixture(scope="module")
def windowed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Mistral (every layer windowed), Qwen2 with its second layer windowed, Mixtral."""
    root = tmp_path_factory.mktemp("windowed")
    return {
        "mistral": write_tiny_model(root / "mistral", "mistral", sliding_window=WINDOW),
        "qwen2": write_tiny_model(
            root / "qwen2",
            "qwen2",
            sliding_window=WINDOW,
            use_sliding_window=True,
            max_window_layers=1,
        ),  # fmt: skip
        "mixtral": write_tiny_model(root / "mixtral", "mixtral", sliding_window=WINDOW),
    }


def test_each_layer_reads_its_window_where_the_family_uses_it(tmp_path, windowed) -> None:
    assert layer_windows(load_config(windowed["mistral"])) == [WINDOW, WINDOW]
    assert layer_windows(load_config(windowed["qwen2"])) == [None, WINDOW]
    full = write_tiny_model(tmp_path / "full", "mistral", with_tokenizer=False)
    assert layer_windows(load_config(full)) == [None, None]
    # Qwen2 configs carry a sliding_window that only use_sliding_window turns on
    qwen2 = write_tiny_model(tmp_path / "q", "qwen2", with_tokenizer=False, sliding_window=8)
    assert layer_windows(load_config(qwen2)) == [None, None]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("arch", ["mistral", "qwen2", "mixtral"])
def test_greedy_past_the_window_matches_transformers(windowed, arch, config) -> None:
    path = windowed[arch]
    options = dict(CONFIGS[config])
    if arch == "qwen2" and "num_kv_blocks" in options:
        # every layer's KV kept whole, so that this small pool preempts (the hybrid layout,
        # on in the other configurations, gives the windowed layer's blocks back)
        options["hybrid_kv_cache"] = False
    llm = LLM(str(path), device="cpu", dtype="float32", **options)
    assert llm.max_model_len > WINDOW  # no cap at the window
    params = [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, m, out in zip(PROMPTS, MAX_TOKENS, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, m), f"{len(prompt)} tokens"
    # a prompt that starts with another's cached blocks, past the window
    shared = [PROMPTS[1][:64] + tail for tail in random_prompts(3, 4, 30, seed=9)]
    again = llm.generate(shared, SamplingParams(temperature=0, max_tokens=20),
                         use_tqdm=False)  # fmt: skip
    for prompt, out in zip(shared, again, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 20)
    if config == "tiny-pool-preempts" and arch == "qwen2":  # a full layer keeps every block
        assert llm.stats().num_preemptions > 0


def test_the_window_changes_the_answer(windowed, tmp_path) -> None:
    """The same weights without the window give other tokens past it: the tests above would
    catch attention that ignored it."""
    import json
    import shutil

    full = Path(shutil.copytree(windowed["mistral"], tmp_path / "full"))
    config = json.loads((full / "config.json").read_text())
    config["sliding_window"] = None
    (full / "config.json").write_text(json.dumps(config))
    long = [p for p in PROMPTS if len(p) > 3 * WINDOW]
    differ = sum(hf_greedy(full, p, 20) != hf_greedy(windowed["mistral"], p, 20) for p in long)
    assert differ >= len(long) // 2


def test_blocks_outside_every_window_go_back_to_the_pool(windowed) -> None:
    """Where every layer is windowed, a sequence keeps about a window of blocks however long it
    grows: a pool that holds two of these sequences whole runs eight at once, unpreempted, and
    their answers stay transformers'."""
    from conveyor.engine.block_manager import NULL_BLOCK

    path = windowed["mistral"]
    prompts = random_prompts(8, 100, 100, seed=12)
    params = SamplingParams(temperature=0, max_tokens=60)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=8, num_kv_blocks=40,
              max_num_batched_tokens=32, max_model_len=320)  # fmt: skip
    whole = -(-(100 + 60) // 8)  # blocks of one sequence kept whole
    assert llm.block_manager.num_blocks // whole == 2
    for i, prompt in enumerate(prompts):
        llm.add_request(str(i), prompt, params)
    outputs, most_running, released = {}, 0, 0
    while llm.has_unfinished():
        for out in llm.step():
            outputs[out.request_id] = out
        running = llm.scheduler.running
        most_running = max(most_running, len(running))
        released = max([released] + [s.block_table.count(NULL_BLOCK) for s in running])
    assert most_running == 8 and released >= 10
    assert llm.stats().num_preemptions == 0
    for i, prompt in enumerate(prompts):
        assert outputs[str(i)].outputs[0].token_ids == hf_greedy(path, prompt, 60)
    # what a sequence gives back stays cached: the same prompt again starts from its blocks
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=8)
    for expected in (0, 96):  # (100 - 1) // 8 whole blocks: one token is always computed
        out = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=5),
                           use_tqdm=False)[0]  # fmt: skip
        assert out.num_cached_tokens == expected
        assert out.outputs[0].token_ids == hf_greedy(path, prompts[0], 5)
