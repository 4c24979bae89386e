"""How much device memory the largest step takes, measured before the KV cache is sized.

On a GPU the KV cache gets what the memory budget leaves after the weights *and* the largest
step's activations: a forward pass over `max_num_batched_tokens` prompt tokens and the sampling
of `max_num_seqs` rows (float32 logits, a sort for top-p, the noise). Sizing it from the memory
free after loading alone leaves the first large step to run out of memory. The pass runs on a
throwaway cache just large enough for it, as vLLM's profiling run does; on a CPU the KV budget
is a fixed size and nothing is measured.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from conveyor.engine.logits_processors import SampleRequest
from conveyor.engine.model_runner import ModelRunner
from conveyor.engine.models import DecoderForCausalLM
from conveyor.engine.sampler import Sampler
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.scheduler import ScheduledSeq
from conveyor.engine.sequence import Request, Sequence
from conveyor.kernels.backend import AttentionBackend

PROFILE_REQUEST = "__memory_profile__"


def largest_step(
    model: DecoderForCausalLM,
    backend: AttentionBackend,
    sampler: Sampler,
    *,
    num_tokens: int,
    num_rows: int,
    block_size: int,
    vocab_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """One step of `num_tokens` prompt tokens on a throwaway KV cache, then the sampling of
    `num_rows` rows at temperature 1 with top-p (the widest sampling path)."""
    num_blocks = -(-num_tokens // block_size) + 1
    runner = ModelRunner(model, backend, num_blocks, block_size, device, dtype)
    prompt = [3 + t % max(1, vocab_size - 3) for t in range(num_tokens)]
    params = SamplingParams(temperature=1.0, top_p=0.9)
    seq = Sequence(Request(PROFILE_REQUEST, None, prompt, params), 0, list(prompt), num_tokens)
    seq.tables = [list(range(num_blocks))]
    result = runner.run([ScheduledSeq(seq, num_tokens)], prompt_logprob_seqs=set())
    one_row = torch.zeros(num_rows, dtype=torch.long, device=device)
    logits = result.sample_logits.index_select(0, one_row)
    sampler(logits, [SampleRequest(params, None, [])] * num_rows)


def peak_step_bytes(run: Callable[[], object], device: torch.device) -> int:
    """Bytes `run()` allocated on `device` at its peak beyond what was allocated before it; 0
    on a CPU (its KV budget is not taken from what is left)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return peak


def kv_cache_bytes(total: int, free: int, utilization: float, step_peak: int) -> int:
    """The KV cache's share of a device of `total` bytes with `free` free after loading: the
    `utilization` fraction, less what is in use (weights, the runtime) and the largest step."""
    return int(total * utilization) - (total - free) - step_peak
