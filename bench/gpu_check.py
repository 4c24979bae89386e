"""One command that proves a GPU worker: the Triton kernels (compiled) against the float32
reference, decode attention's bandwidth against the device's copy bandwidth, and the engine on
random-weight checkpoints in Qwen3-0.6B's and Llama-3.2-1B's real shapes (bf16): its greedy
agreement with transformers, its throughput against transformers' `generate` at its best batch
size, decode tokens/s at batch 1, 32 and 256 with the share of the bandwidth ceiling (weights and
KV read per step), kernels and host synchronisations per decode step (torch.profiler), memory
after start and the peak of a 4,096-token prompt-logprobs request.

    python bench/gpu_check.py                 # on a machine with a CUDA GPU
    python bench/gpu_check.py --cpu-dry-run   # every check's code on the CPU, tiny shapes

Without a GPU (and without --cpu-dry-run) it says so and exits 2. Each result is one JSON line
with the device, versions and date, printed and appended to bench/results/gpu_check.jsonl
(not for a dry run). A check that fails records its error and the others still run; the exit
status is 1 when any failed or missed its goal (in a dry run: when any raised).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "gpu_check.jsonl"

# (architecture, config) in the real models' shapes
REAL_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-0.6b": ("qwen3", dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1_000_000.0, tie_word_embeddings=True)),
    "llama-3.2-1b": ("llama", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500_000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
}  # fmt: skip
TINY_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    name: (arch, {**config, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                  **({"head_dim": 16} if "head_dim" in config else {})})
    for name, (arch, config) in REAL_SHAPES.items()
}  # fmt: skip


class Plan:
    """What one run measures: the real sizes on a GPU, tiny ones in a CPU dry run."""

    def __init__(self, dry_run: bool) -> None:
        import torch

        self.dry_run = dry_run
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.dtype = torch.float32 if dry_run else torch.bfloat16
        self.shapes = TINY_SHAPES if dry_run else REAL_SHAPES
        self.context = 48 if dry_run else 512  # prompt tokens of each decode sequence
        self.decode_batches = [1, 4] if dry_run else [1, 32, 256]
        self.decode_tokens = 8 if dry_run else 64
        self.hf_batches = [2, 4] if dry_run else [64, 128, 256]
        self.throughput_requests = 8 if dry_run else 256
        self.throughput_tokens = 8 if dry_run else 128
        self.logprob_prompt = 64 if dry_run else 4096


def environment(plan: Plan) -> dict[str, Any]:
    import torch
    import transformers

    env: dict[str, Any] = {
        "date": date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dry_run": plan.dry_run,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if plan.device.type == "cuda":
        props = torch.cuda.get_device_properties(plan.device)
        env.update(device=props.name, capability=f"{props.major}.{props.minor}",
                   gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                   sms=props.multi_processor_count)  # fmt: skip
    else:
        from machine import cpu_isa

        env.update(device="cpu", cpu_isa=cpu_isa())
    try:
        from machine import git_state

        env["code"] = git_state()
    except Exception:  # not a checkout
        env["code"] = None
    return env


def sync(plan: Plan) -> None:
    import torch

    if plan.device.type == "cuda":
        torch.cuda.synchronize(plan.device)


# ---- the kernels ------------------------------------------------------------------------------


def check_kernels(plan: Plan) -> dict[str, Any]:
    """Random ragged cases through decode and prefill (over scattered block tables), against
    the float32 torch reference (kernels.torch_paged)."""
    import torch

    from conveyor.kernels import torch_paged as ref
    from conveyor.kernels import triton_paged as tk

    rng = random.Random(0)
    torch.manual_seed(0)
    worst: dict[str, float] = {}
    dev = plan.device
    for dtype in (torch.float32, torch.bfloat16):
        for kv_heads, group, head_dim, block in ((2, 4, 128, 16), (1, 8, 64, 32), (4, 2, 256, 16)):
            contexts = [rng.randint(1, 100 if plan.dry_run else 3000) for _ in range(4)]
            blocks = [-(-n // block) for n in contexts]
            ids = torch.randperm(sum(blocks) + 3, device=dev)
            width = max(blocks)
            tables = torch.zeros(len(contexts), width, dtype=torch.long, device=dev)
            at = 0
            for i, n in enumerate(blocks):
                tables[i, :n] = ids[at : at + n]
                at += n
            shape = (len(ids), kv_heads, block, head_dim)
            k_cache = torch.randn(shape, device=dev).to(dtype)
            v_cache = torch.randn(shape, device=dev).to(dtype)
            heads = kv_heads * group
            lens = torch.tensor(contexts, device=dev)
            q = torch.randn(len(contexts), heads, head_dim, device=dev).to(dtype)
            scale = head_dim**-0.5
            got = tk.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
            want = ref.decode_attention(
                q.float(), k_cache.float(), v_cache.float(), tables, lens, scale
            )
            _worst(worst, "decode", dtype, got, want)
            # prefill: the last few tokens of each context are this step's queries
            new = [min(n, rng.randint(1, 40)) for n in contexts]
            starts = [0]
            for n in new:
                starts.append(starts[-1] + n)
            pq = torch.randn(starts[-1], heads, head_dim, device=dev).to(dtype)
            got = tk.paged_prefill_attention(
                pq, k_cache, v_cache, tables, torch.tensor(starts, device=dev), lens, scale
            )
            want = ref.prefill_attention(
                pq.float(), k_cache.float(), v_cache.float(), tables, starts, contexts, scale
            )
            _worst(worst, "prefill", dtype, got, want)
    bound = {"float32": 1e-3, "bfloat16": 2e-2}
    ok = all(err < bound[key.split("_")[1]] for key, err in worst.items())
    return {"check": "kernels", "ok": ok, "max_rel_err": worst,
            "compiled": os.environ.get("TRITON_INTERPRET") != "1"}  # fmt: skip


def _worst(worst: dict[str, float], kernel: str, dtype, got, want) -> None:
    err = (got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12)
    key = f"{kernel}_{str(dtype).removeprefix('torch.')}"
    worst[key] = max(worst.get(key, 0.0), float(err))


def check_decode_bandwidth(plan: Plan) -> dict[str, Any]:
    if plan.device.type != "cuda":
        return {"check": "decode_bandwidth", "ok": None, "skipped": "needs CUDA"}
    import torch
    from triton_decode import CASES, GOAL, copy_bandwidth, run_case

    copy_bw = copy_bandwidth(plan.device)
    rows = [run_case(b, c, plan.device, torch.bfloat16) for b, c in CASES]
    share = rows[0]["paged_bw"] / copy_bw
    return {"check": "decode_bandwidth", "ok": share >= GOAL, "copy_gb_s": round(copy_bw / 1e9),
            "share_of_copy": round(share, 3), "goal": GOAL,
            "cases": [{k: (round(v / 1e9, 1) if k.endswith("_bw") else v) for k, v in r.items()}
                      for r in rows]}  # fmt: skip


# ---- the engine -------------------------------------------------------------------------------


def write_checkpoint(plan: Plan, name: str, root: Path) -> Path:
    from conveyor.demo_model import write_tiny_model

    arch, config = plan.shapes[name]
    return write_tiny_model(root / name, arch, init_std=0.02, **config)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def check_engine(plan: Plan, name: str, root: Path, done: Callable[[dict], None]) -> None:
    import torch

    from conveyor.engine import LLM

    started = time.perf_counter()
    try:
        path = write_checkpoint(plan, name, root)
        vocab = plan.shapes[name][1]["vocab_size"]
        written = time.perf_counter()
        if plan.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(plan.device)
        llm = LLM(str(path), device=str(plan.device), dtype=str(plan.dtype).removeprefix("torch."))
        llm.warm_up()
    except Exception as err:
        done(failed("engine_start", err, model=name))
        return
    done({"check": "engine_start", "model": name, "ok": True,
          "checkpoint_seconds": round(written - started, 1),
          "seconds": round(time.perf_counter() - written, 1), "plan": llm.plan.describe(),
          **memory(plan)})  # fmt: skip
    for check in (greedy_agreement, throughput_vs_hf, decode_rates, step_profile, logprob_peak):
        started = time.perf_counter()
        try:
            row = {"model": name, **check(plan, llm, path, vocab)}
        except Exception as err:
            row = failed(check.__name__, err, model=name)
        done({**row, "seconds": round(time.perf_counter() - started, 1)})
    del llm
    if plan.device.type == "cuda":
        torch.cuda.empty_cache()


def memory(plan: Plan) -> dict[str, Any]:
    import torch

    if plan.device.type != "cuda":
        return {}
    return {"allocated_gib": round(torch.cuda.memory_allocated(plan.device) / 2**30, 2),
            "reserved_gib": round(torch.cuda.memory_reserved(plan.device) / 2**30, 2)}  # fmt: skip


def hf_model(plan: Plan, path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=plan.dtype).to(plan.device).eval()


def hf_generate(model, prompts: list[list[int]], max_tokens: int, plan: Plan) -> list[list[int]]:
    """transformers' greedy decoding of equal-length prompts, in one batch."""
    import torch

    ids = torch.tensor(prompts, device=plan.device)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
            min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return [row[len(prompts[0]) :].tolist() for row in out]


def greedy_agreement(plan: Plan, llm, path: Path, vocab: int) -> dict[str, Any]:
    """Our greedy tokens against transformers'. In float32 they must be the same. In bfloat16
    two correct implementations part ways at the first near tie (random weights make many), so
    each of our tokens is checked against transformers' logits given our own prefix instead
    (vLLM's test of bf16 models): the token must be transformers' first choice at nearly every
    position and among its top 5 at every one. A wrong rope, norm or cache read fails that."""
    import torch

    from conveyor.engine import SamplingParams

    prompts = random_prompts(8, 32, vocab, seed=1)
    tokens = 32
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    model = hf_model(plan, path)
    theirs = hf_generate(model, prompts, tokens, plan)
    with torch.inference_mode():
        ids = torch.tensor([p + list(o) for p, o in zip(prompts, ours, strict=True)],
                           device=plan.device)  # fmt: skip
        logits = model(ids).logits[:, len(prompts[0]) - 1 : -1].float()
    del model
    generated = ids[:, len(prompts[0]) :]
    chosen = logits.gather(-1, generated[..., None])
    rank = (logits > chosen).sum(-1)  # 0: transformers' first choice too
    same = sum(_common_prefix(a, b) for a, b in zip(ours, theirs, strict=True))
    identical = sum(a == b for a, b in zip(ours, theirs, strict=True))
    first_choice = float((rank == 0).float().mean())
    row = {"check": "greedy_agreement", "dtype": str(plan.dtype).removeprefix("torch."),
           "identical_sequences": identical, "of": len(prompts),
           "tokens_before_first_difference": round(same / (len(prompts) * tokens), 3),
           "teacher_forced_first_choice": round(first_choice, 4),
           "teacher_forced_worst_rank": int(rank.max())}  # fmt: skip
    if plan.dtype.itemsize == 4:
        return {**row, "ok": identical == len(prompts)}
    # the float32 model's choices at the same prefixes are the truth both bf16 runs approximate:
    # ours must agree with it as often as transformers' own bf16 does (two points of slack)
    # or with transformers' bf16 at 95% of positions, and never fall out of its top 5
    truth = float32_choices(plan, path, ids, len(prompts[0]))
    ours_true = float((generated == truth).float().mean())
    theirs_true = float((logits.argmax(-1) == truth).float().mean())
    close = first_choice >= 0.95 or ours_true >= theirs_true - 0.02
    return {**row, "ok": close and int(rank.max()) < 5,
            "float32_first_choice": {"ours": round(ours_true, 4),
                                     "transformers": round(theirs_true, 4)}}  # fmt: skip


def float32_choices(plan: Plan, path: Path, ids, prompt_len: int):
    """transformers' float32 model's greedy choice after each generated prefix."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model = model.to(plan.device).eval()
    with torch.inference_mode():
        choices = model(ids).logits[:, prompt_len - 1 : -1].argmax(-1)
    del model
    return choices


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def throughput_vs_hf(plan: Plan, llm, path: Path, vocab: int) -> dict[str, Any]:
    from conveyor.engine import SamplingParams

    n, tokens = plan.throughput_requests, plan.throughput_tokens
    prompts = random_prompts(n, plan.context // 4, vocab, seed=2)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    # twice: the first run pays once-per-process costs (allocations, libraries' first calls)
    # that a long-lived worker pays once; transformers' rate is its best batch size's, after
    # its smaller batches have run
    runs, clocks = [], []
    for _ in range(2):
        sync(plan)
        start = time.perf_counter()
        with StepClock(llm) as clock:
            llm.generate(prompts, params, use_tqdm=False)
        sync(plan)
        runs.append(n * tokens / (time.perf_counter() - start))
        clocks.append(clock.summary(time.perf_counter() - start))
    ours = max(runs)
    model = hf_model(plan, path)
    hf_rates = {}
    for batch in plan.hf_batches:
        try:
            sync(plan)
            start = time.perf_counter()
            for i in range(0, n, batch):
                hf_generate(model, prompts[i : i + batch], tokens, plan)
            sync(plan)
            hf_rates[batch] = n * tokens / (time.perf_counter() - start)
        except Exception as err:  # out of memory at a large batch: the others stand
            hf_rates[batch] = f"{type(err).__name__}"
    del model
    best = max((v for v in hf_rates.values() if isinstance(v, float)), default=float("nan"))
    ratio = ours / best
    hf = {str(k): (round(v) if isinstance(v, float) else v) for k, v in hf_rates.items()}
    return {"check": "throughput_vs_hf", "ok": ratio >= 5, "goal": 5, "ratio": round(ratio, 2),
            "ours_tok_s": round(ours), "ours_first_run_tok_s": round(runs[0]), "hf_tok_s": hf,
            "ours_steps": clocks[runs.index(ours)],
            "requests": n, "prompt_tokens": plan.context // 4, "output_tokens": tokens}  # fmt: skip


class StepClock:
    """Where a `generate` run's time goes: the engine's steps with and without prompt tokens
    (their count and milliseconds), the share of decode steps replayed from graphs, and the
    time in the model runner against the whole step (scheduling, sampling's read, outputs)."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.kinds: dict[str, list[float]] = {"prefill": [0, 0.0], "decode": [0, 0.0]}
        self.replays = 0
        self.runner_s = 0.0

    def __enter__(self) -> StepClock:
        llm, runner, graphs = self.llm, self.llm.runner, self.llm.runner.graphs
        run_model, step, replay = runner.run, llm.step, graphs.run if graphs else None

        def timed_run(scheduled, *args):
            start = time.perf_counter()
            try:
                return run_model(scheduled, *args)
            finally:
                self.runner_s += time.perf_counter() - start

        def timed_step():
            scheduled_prompt = any(
                s.num_computed_tokens < s.num_prompt_tokens for s in llm.scheduler.running
            ) or bool(llm.scheduler.waiting)
            start = time.perf_counter()
            try:
                return step()
            finally:
                kind = self.kinds["prefill" if scheduled_prompt else "decode"]
                kind[0] += 1
                kind[1] += time.perf_counter() - start

        def counted_replay(*args):
            self.replays += 1
            return replay(*args)

        runner.run, llm.step = timed_run, timed_step
        if graphs is not None:
            graphs.run = counted_replay
        return self

    def __exit__(self, *exc) -> None:
        del self.llm.runner.run, self.llm.step
        if self.llm.runner.graphs is not None:
            del self.llm.runner.graphs.run

    def summary(self, wall_s: float) -> dict[str, Any]:
        decode_steps = self.kinds["decode"][0]
        replayed = round(self.replays / decode_steps, 3) if decode_steps else None
        return {
            **{f"{k}_steps": int(n) for k, (n, _) in self.kinds.items()},
            **{f"{k}_ms": round(s * 1e3, 1) for k, (_, s) in self.kinds.items()},
            "graph_replays": self.replays,
            "decode_steps_replayed": replayed,
            "runner_ms": round(self.runner_s * 1e3, 1),
            "outside_steps_ms": round((wall_s - sum(s for _, s in self.kinds.values())) * 1e3, 1),
        }


def _prefilled(llm, prompts: list[list[int]], tokens: int) -> None:
    """`prompts` added and stepped until every one's prompt is computed (decode from here)."""
    from conveyor.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        llm.add_request(f"d{time.monotonic_ns()}-{i}", prompt, params)
    sched = llm.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        llm.step()


def decode_rates(plan: Plan, llm, path: Path, vocab: int) -> dict[str, Any]:
    """Decode tokens/s at each batch size over prompts of `plan.context` tokens, and the share
    of the bandwidth ceiling: the weights and every sequence's KV read once per step."""
    rates = {}
    net = llm.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    kv_per_token = llm.kv_bytes_per_token
    copy_bw = None
    if plan.device.type == "cuda":
        from triton_decode import copy_bandwidth

        copy_bw = copy_bandwidth(plan.device)
    recorded = llm.runner.graphs  # the decode graphs warm-up recorded, if it did
    modes = [("eager", None)] + ([("graphs", recorded)] if recorded is not None else [])
    try:
        for mode, graphs in modes:
            llm.runner.graphs = graphs
            for batch in plan.decode_batches:
                row = _decode_rate(plan, llm, batch, vocab)
                if copy_bw:
                    read = (
                        weight_bytes
                        + batch * (plan.context + plan.decode_tokens // 2) * kv_per_token
                    )
                    row["share_of_bandwidth"] = round(read / (row["step_ms"] / 1e3) / copy_bw, 3)
                rates.setdefault(str(batch), {})[mode] = row
    finally:
        llm.runner.graphs = recorded
    best = rates[str(plan.decode_batches[-1])]
    share = (best.get("graphs") or best["eager"]).get("share_of_bandwidth")
    return {"check": "decode_rates", "ok": None if share is None else share >= 0.5,
            "goal_share_at_largest_batch": 0.5, "context": plan.context, "batches": rates,
            "cuda_graphs": llm.plan.graphs}  # fmt: skip


def _decode_rate(plan: Plan, llm, batch: int, vocab: int) -> dict[str, Any]:
    """Decode tokens/s and ms per step of `batch` sequences after their prefill."""
    prompts = random_prompts(batch, plan.context, vocab, seed=3 + batch)
    _prefilled(llm, prompts, plan.decode_tokens + 2)
    sync(plan)
    start, steps = time.perf_counter(), 0
    while llm.has_unfinished():
        llm.step()
        steps += 1
    sync(plan)
    seconds = time.perf_counter() - start
    return {"tok_s": round(batch * steps / seconds),
            "step_ms": round(seconds / max(1, steps) * 1e3, 2)}  # fmt: skip


def step_profile(plan: Plan, llm, path: Path, vocab: int) -> dict[str, Any]:
    """Kernels launched and host synchronisations per decode step, by torch.profiler, eager and
    with the decode graphs."""
    recorded = llm.runner.graphs
    modes = [("eager", None)] + ([("graphs", recorded)] if recorded is not None else [])
    row: dict[str, Any] = {"check": "step_profile", "ok": None,
                           "batch": plan.decode_batches[-1], "goal_syncs_per_step": 1}  # fmt: skip
    try:
        for mode, graphs in modes:
            llm.runner.graphs = graphs
            row[mode] = _profile_steps(plan, llm, vocab)
    finally:
        llm.runner.graphs = recorded
    return row


def _profile_steps(plan: Plan, llm, vocab: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    batch = plan.decode_batches[-1]
    _prefilled(llm, random_prompts(batch, plan.context, vocab, seed=9), 8)
    activities = [ProfilerActivity.CPU]
    if plan.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    steps = 3
    sync(plan)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            llm.step()
        sync(plan)
    wall = time.perf_counter() - start
    while llm.has_unfinished():
        llm.step()
    events = prof.events()
    kernels = sum(str(e.device_type).endswith("CUDA") for e in events)
    return {
        "kernels_per_step": round(kernels / steps, 1),
        # the host waiting on the device (a blocking read): our own synchronize after the
        # steps is cudaDeviceSynchronize, which the step itself never calls
        "host_syncs_per_step": round(sum(e.name in SYNC_CALLS for e in events) / steps, 1),
        # how long the host waited there: near 0, the device waits on the host instead
        "host_wait_ms_per_step": round(
            sum(e.cpu_time_total for e in events if e.name in SYNC_CALLS) / steps / 1e3, 2
        ),
        "async_copies_per_step": round(sum(e.name == "cudaMemcpyAsync" for e in events) / steps, 1),
        "profiled_ms_per_step": round(wall / steps * 1e3, 2),
    }


SYNC_CALLS = {"cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy"}


def logprob_peak(plan: Plan, llm, path: Path, vocab: int) -> dict[str, Any]:
    import torch

    from conveyor.engine import SamplingParams

    if plan.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(plan.device)
    prompt = random_prompts(1, plan.logprob_prompt, vocab, seed=11)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    assert out[0].prompt_logprobs is not None and len(out[0].prompt_logprobs) == len(prompt)
    row: dict[str, Any] = {"check": "prompt_logprobs_peak", "ok": True,
                           "prompt_tokens": len(prompt)}  # fmt: skip
    if plan.device.type == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated(plan.device) / 2**30, 2)
    return row


# ---- running it -------------------------------------------------------------------------------


def failed(check: str, err: BaseException, **extra: Any) -> dict[str, Any]:
    tail = traceback.format_exception(err)[-3:]
    error = f"{type(err).__name__}: {err}"[:500]
    return {"check": check, "ok": False, **extra, "error": error,
            "where": "".join(tail)[-800:]}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run every check's code on the CPU with tiny shapes (nothing recorded)",
    )
    ap.add_argument("--models", nargs="*", default=list(REAL_SHAPES), choices=list(REAL_SHAPES))
    ap.add_argument("--no-kernels", action="store_true", help="skip the kernel checks")
    ap.add_argument("--results", type=Path, default=RESULTS, help="JSON lines file to append to")
    ap.add_argument("--no-record", action="store_true", help="do not append to --results")
    return ap.parse_args(argv)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    import torch

    if not args.cpu_dry_run and not torch.cuda.is_available():
        from conveyor.engine.llm_engine import no_cuda_reason

        print(
            f"no CUDA GPU on this machine ({no_cuda_reason()}): nothing "
            "proved; run this where a GPU is, or --cpu-dry-run to exercise the checks' code"
        )
        return 2
    plan = Plan(args.cpu_dry_run)
    env = environment(plan)
    print(json.dumps({"environment": env}))
    record = not args.cpu_dry_run and not args.no_record
    results: list[dict[str, Any]] = []

    def done(row: dict[str, Any]) -> None:
        # written as it comes, so that a run cut short keeps what it measured
        results.append(row)
        print(json.dumps(row), flush=True)
        if record:
            args.results.parent.mkdir(parents=True, exist_ok=True)
            with args.results.open("a") as f:
                f.write(json.dumps({**row, **env}) + "\n")

    for check in () if args.no_kernels else (check_kernels, check_decode_bandwidth):
        started = time.perf_counter()
        try:
            row = check(plan)
        except Exception as err:
            row = failed(check.__name__, err)
        done({**row, "seconds": round(time.perf_counter() - started, 1)})
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for name in args.models:
            check_engine(plan, name, Path(tmp), done)
    # a dry run's tiny shapes prove the code, not the goals: only its errors count
    bad = [r["check"] + (f" ({r['model']})" if "model" in r else "") for r in results
           if "error" in r or (r.get("ok") is False and not args.cpu_dry_run)]  # fmt: skip
    print(f"{len(results)} results; " + (f"failed: {', '.join(bad)}" if bad else "none failed"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
