"""The checkpoint's own sampling (`generation_config.json`) for what a request leaves out, as
vLLM's `--generation-config auto` applies it; `vllm` turns it off."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conveyor.engine import LLM, SamplingParams
from conveyor.request_outcome import prepare_request
from conveyor.wire_format.request_line import parse_request_line
from tests.hf_reference import hf_greedy, random_prompts


def with_generation_config(src: Path, dst: Path, **fields) -> Path:
    shutil.copytree(src, dst)
    shipped = json.loads((dst / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps({**shipped, **fields}))
    return dst


@pytest.fixture(scope="module")
def shipped(checkpoints, tmp_path_factory) -> Path:
    """Sampling whose top_k of 1 makes it greedy, so its effect shows in the tokens."""
    root = tmp_path_factory.mktemp("generation-defaults")
    return with_generation_config(checkpoints["llama"], root / "m", do_sample=True,
                                  temperature=0.7, top_k=1, top_p=0.9, min_p=0.05,
                                  repetition_penalty=1.0, max_new_tokens=3)  # fmt: skip


def test_the_checkpoints_sampling_is_the_default(shipped):
    llm = LLM(str(shipped), device="cpu", dtype="float32")
    want = {"temperature": 0.7, "top_k": 1, "top_p": 0.9, "min_p": 0.05,
            "repetition_penalty": 1.0}  # fmt: skip
    assert llm.default_sampling == want  # max_new_tokens is not a sampling default
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0.7, 1, 0.9, 0.05)
    prompts = random_prompts(4, 5, 30, seed=2)
    outputs = llm.generate(prompts, use_tqdm=False)  # no params: the checkpoint's, greedy here
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(shipped, prompt, 16)


def test_vllm_turns_the_checkpoints_sampling_off(shipped):
    llm = LLM(str(shipped), device="cpu", dtype="float32", generation_config="vllm")
    assert llm.default_sampling == {}
    assert llm.get_default_sampling_params() == SamplingParams()
    prompts = random_prompts(4, 5, 30, seed=2)
    outputs = llm.generate(prompts, use_tqdm=False)  # temperature 1, no top-k: sampled
    greedy = [hf_greedy(shipped, p, 16) for p in prompts]
    assert [o.outputs[0].token_ids for o in outputs] != greedy


def test_a_request_keeps_what_it_gives_and_gets_the_rest_from_the_checkpoint(shipped):
    llm = LLM(str(shipped), device="cpu", dtype="float32")

    def params_of(body: dict) -> SamplingParams:
        line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
                "body": {"model": "m", "prompt": "Hello", **body}}  # fmt: skip
        return prepare_request(llm, parse_request_line(json.dumps(line), line=1))[1]

    left_out = params_of({})
    assert (left_out.temperature, left_out.top_k, left_out.top_p) == (0.7, 1, 0.9)
    assert left_out.max_tokens == 16  # a completion's default length stays OpenAI's
    given = params_of({"temperature": 0, "top_p": 1, "top_k": 5})
    assert (given.temperature, given.top_k, given.top_p, given.min_p) == (0.0, 5, 1.0, 0.05)


@pytest.mark.parametrize(
    "fields, kept",
    [({"top_k": 0, "temperature": 0.5}, {"temperature": 0.5}),  # transformers' "no top-k"
     ({"do_sample": False}, {})],
)  # fmt: skip
def test_only_the_sampling_fields_it_names_are_taken(checkpoints, tmp_path, fields, kept):
    path = with_generation_config(checkpoints["llama"], tmp_path / "m", **fields)
    assert LLM(str(path), device="cpu", dtype="float32").default_sampling == kept


def test_a_value_a_request_could_not_give_is_refused_at_load(checkpoints, tmp_path):
    path = with_generation_config(checkpoints["llama"], tmp_path / "m", top_p=0.0)
    with pytest.raises(ValueError, match=r"generation_config.json: top_p must be in \(0, 1\]"):
        LLM(str(path), device="cpu", dtype="float32")


def test_the_worker_reports_the_defaults_it_runs(shipped):
    """Through the heartbeat's snapshot to what `GET /v1/workers` shows."""
    from conveyor.api.workers_view import _worker
    from conveyor.ledger.models import WorkerRow
    from conveyor.worker.engine_service import EngineService

    llm = LLM(str(shipped), device="cpu", dtype="float32")
    stats = EngineService(llm).snapshot()
    row = WorkerRow(id="w", models=["m"], queues=[], started_at=0.0, last_seen=0.0, stats=stats)
    assert _worker(row, running_shards=0).default_sampling == llm.default_sampling != {}
