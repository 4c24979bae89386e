"""The model and its step on a `cuda` device, with no GPU (tests.fake_cuda): a tensor made on
the CPU and mixed with the model's fails here as it would on the first GPU run."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from conveyor.engine.loader import default_dtype
from conveyor.engine.model_runner import ModelRunner
from conveyor.engine.models import MODEL_REGISTRY
from conveyor.engine.prompt_logprobs import PromptLogprobs
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.scheduler import ScheduledSeq
from conveyor.engine.sequence import Request, Sequence
from conveyor.kernels import torch_paged
from tests.fake_cuda import fake_cuda

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
CONFIGS = {
    "llama": LlamaConfig(**SMALL, architectures=["LlamaForCausalLM"]),
    "llama-3.x rope": LlamaConfig(
        **SMALL, rope_scaling=LLAMA3_ROPE, architectures=["LlamaForCausalLM"]
    ),
    "llama yarn rope": LlamaConfig(
        **SMALL,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },  # fmt: skip
        architectures=["LlamaForCausalLM"],
    ),
    "qwen2": Qwen2Config(**SMALL, architectures=["Qwen2ForCausalLM"]),
    "qwen3": Qwen3Config(**SMALL, head_dim=32, architectures=["Qwen3ForCausalLM"]),
    "gemma2": Gemma2Config(
        **SMALL, head_dim=32, sliding_window=8, architectures=["Gemma2ForCausalLM"]
    ),
    "gemma3": Gemma3TextConfig(
        **SMALL,
        head_dim=32,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        architectures=["Gemma3ForCausalLM"],
    ),  # fmt: skip
    "olmo2": Olmo2Config(**SMALL, architectures=["Olmo2ForCausalLM"]),
    "phi3": Phi3Config(**SMALL, pad_token_id=0, architectures=["Phi3ForCausalLM"]),
    # Phi-4-mini's shape: LongRoPE's two tables, over three quarters of each head
    "phi3 longrope partial": Phi3Config(
        **SMALL,
        pad_token_id=0,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=16,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 6, "long_factor": [4.0] * 6},
        architectures=["Phi3ForCausalLM"],
    ),  # fmt: skip
    "mixtral": MixtralConfig(**SMALL, num_local_experts=4, architectures=["MixtralForCausalLM"]),
    "qwen2_moe": Qwen2MoeConfig(
        **SMALL,
        num_experts=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        architectures=["Qwen2MoeForCausalLM"],
    ),  # fmt: skip
    "qwen3_moe": Qwen3MoeConfig(
        **SMALL,
        head_dim=32,
        num_experts=8,
        moe_intermediate_size=32,
        architectures=["Qwen3MoeForCausalLM"],
    ),  # fmt: skip
}
BLOCK = 8


class ShapeOnlyAttention:
    """Writes K/V as every backend does and answers with the attention's shape: a kernel reads
    the lengths it works on, and fake tensors have no values (the kernels' own placement is
    the kernels' tests')."""

    name = "shape-only"

    def forward(self, query, key, value, k_cache, v_cache, meta, scale, window=None, softcap=None):
        torch_paged.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        for t in (meta.decode_block_tables, meta.decode_context_lens, meta.prefill_block_tables,
                  meta.prefill_query_start_tensor, meta.prefill_context_lens_tensor):  # fmt: skip
            assert t is not None and t.device == query.device, t
        return torch.zeros_like(query)


def sequence(ids: list[int], computed: int, first_block: int) -> Sequence:
    seq = Sequence(Request(f"r{first_block}", None, ids, SamplingParams()), 0, list(ids), len(ids))
    seq.block_table = list(range(first_block, first_block + (len(ids) + BLOCK) // BLOCK + 1))
    seq.num_computed_tokens = computed
    return seq


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_step_runs_on_cuda_with_every_tensor_there(name: str, monkeypatch):
    config = CONFIGS[name]
    # the experts' grouped products run in bfloat16 on a GPU of compute capability 8.0 or more
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    with fake_cuda(), default_dtype(torch.bfloat16):
        device = torch.device("cuda", 0)
        model = MODEL_REGISTRY[config.architectures[0]](config, 256)
        assert model.model.rotary.cos.device == device
        runner = ModelRunner(model, ShapeOnlyAttention(), 32, BLOCK, device, torch.bfloat16)
        decode = sequence([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 9, 0)
        prefill = sequence(list(range(20, 40)), 0, 8)
        chunk = sequence(list(range(50, 70)), 8, 16)  # a prompt's second chunk
        scheduled = [ScheduledSeq(decode, 1), ScheduledSeq(prefill, 20), ScheduledSeq(chunk, 12)]
        result = runner.run(scheduled, prompt_logprob_seqs={prefill.seq_id})
        assert result.sample_logits.shape == (3, config.vocab_size)
        assert result.sample_logits.device == device
        first, hidden = result.prompt_hidden[prefill.seq_id]
        assert first == 0 and hidden.device == device
        scorer = PromptLogprobs(None, model, chunk_rows=7)  # 19 rows: chunks of 7, 7 and 5
        entries = scorer.entries(hidden, list(range(21, 40)), k=2)
        assert len(entries) == 19 and len(entries[-1].top) == 2


def test_the_fake_device_refuses_a_cpu_tensor_mixed_with_a_cuda_one():
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    with fake_cuda():
        on_gpu = torch.ones(4, 4)  # the default device inside: cuda
        assert on_gpu.device.type == "cuda"
        assert on_gpu[1:, None, 2].shape == (3, 1)  # indexing works on fake CUDA tensors
        with pytest.raises(FakeTensorDeviceMismatchError):
            on_gpu + torch.ones(4, 4, device="cpu")


def decode_step_transfers(params: list[SamplingParams], seeded: set[int] = frozenset()):
    """The host-device copies of one decode step of a fake-CUDA qwen3, one sequence per
    `params` (those at `seeded` with a generator of their own), its sampling included."""
    from conveyor.engine.logits_processors import SampleRequest
    from conveyor.engine.sampler import Sampler

    config = CONFIGS["qwen3"]
    with fake_cuda() as transfers:
        device = torch.device("cuda", 0)
        model = MODEL_REGISTRY[config.architectures[0]](config, 256)
        runner = ModelRunner(model, ShapeOnlyAttention(), 32, BLOCK, device, torch.bfloat16)
        # a CPU-only torch has no CUDA generator; fake random fills leave tensors as they are
        sampler = Sampler(torch.Generator())
        seqs = [sequence(list(range(1, 12 + i)), 10 + i, 4 * i) for i in range(len(params))]
        built = transfers.copy()
        result = runner.run([ScheduledSeq(s, 1) for s in seqs], prompt_logprob_seqs=set())
        rows = [
            SampleRequest(p, torch.Generator().manual_seed(i) if i in seeded else None, [])
            for i, p in enumerate(params)
        ]
        picked = sampler(result.sample_logits, rows)
        assert len(picked.token_ids) == len(params)
        return transfers - built


def test_a_greedy_decode_step_copies_to_the_device_once_and_reads_back_once():
    """Every integer input of the step goes up in one pinned, non-blocking copy; the sampled
    ids come back in the step's one read."""
    step = decode_step_transfers([SamplingParams(temperature=0)] * 3)
    assert dict(step) == {"uploads": 1, "downloads": 1}


def test_a_sampled_step_uploads_without_blocking_and_reads_back_once():
    """Greedy rows beside rows with temperature, top-k, top-p, min-p, a seed, a logit bias or
    allowed tokens: the step's
    inputs, the sampled rows' places and their settings go up in non-blocking copies, nothing
    waits on the device before the one read of the sampled ids, and every tensor stays on it."""
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=0.5),
    ]
    step = decode_step_transfers(params, seeded={3})
    assert step["downloads"] == 1 and step["blocking_uploads"] == 0, dict(step)
    # the step's inputs; the sampled rows' places, their settings, the unseeded ones' places
    assert step["uploads"] == 4
    adjusted = [
        SamplingParams(temperature=0, logit_bias={5: 3.0}),
        SamplingParams(temperature=0.8, allowed_token_ids=[1, 2, 9]),
    ]
    step = decode_step_transfers(adjusted)
    assert step["downloads"] == 1 and step["blocking_uploads"] == 0, dict(step)


def test_the_memory_profile_runs_the_largest_step_on_the_device():
    """Before the KV cache is sized on a GPU: a step of max_num_batched_tokens prompt tokens
    and the sampling of max_num_seqs rows, every tensor on the device; what it takes at its
    peak comes off the KV budget."""
    from conveyor.engine.memory_profile import kv_cache_bytes, largest_step, peak_step_bytes
    from conveyor.engine.sampler import Sampler

    config = CONFIGS["llama-3.x rope"]
    rows_sampled = []
    with fake_cuda():
        device = torch.device("cuda", 0)
        model = MODEL_REGISTRY[config.architectures[0]](config, 256)
        logits = model.compute_logits
        model.compute_logits = lambda h: rows_sampled.append(h.shape[0]) or logits(h)
        # a CPU-only torch has no CUDA generator; fake random fills leave tensors as they are
        largest_step(
            model, ShapeOnlyAttention(), Sampler(torch.Generator()), num_tokens=100, num_rows=48,
            block_size=BLOCK,
            vocab_size=config.vocab_size, device=device, dtype=torch.bfloat16,
        )  # fmt: skip
    assert rows_sampled == [1]  # the step's one sampled row, widened to 48 for the sampler
    assert peak_step_bytes(lambda: None, torch.device("cpu")) == 0
    gib = 2**30
    assert kv_cache_bytes(80 * gib, 78 * gib, 0.9, 3 * gib) == 67 * gib  # 72 - 2 in use - 3
