"""Decode attention bandwidth of the Triton paged kernel on a CUDA GPU.

Llama-8B attention shapes (32 query heads, 8 KV heads, head size 128, bf16 cache, block size 16)
at batch 64 x context 2048 and batch 8 x context 32768. For each it reports the achieved memory
bandwidth (the K/V bytes the kernel must read, over its time) against the device's measured
device-to-device copy bandwidth, and the time of `F.scaled_dot_product_attention` on contiguous
K/V of the same size. Goal: >= 70% of copy bandwidth at batch 64 x 2048.

    python bench/triton_decode.py
    python bench/triton_decode.py --sweep   # the kernel's tile and launch settings, each timed

On a machine without a CUDA GPU it says so and exits 0. The last line is one JSON object.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch
import torch.nn.functional as F
from report import print_result

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
CASES = [(64, 2048), (8, 32768)]
GOAL = 0.70


def cuda_time(fn, warmup: int = 5, iters: int = 50, per_timing: int = 10) -> float:
    """Median seconds per call, by CUDA events around `per_timing` calls queued back to back:
    the device's time, not the host's launch latency (an event pair around one short call
    would count the device idling while Python launches it)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(1, iters // per_timing)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(per_timing):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / per_timing)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = cuda_time(lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() / seconds


def run_case(batch: int, context: int, device: torch.device, dtype: torch.dtype) -> dict:
    from conveyor.kernels.triton_paged import choose_num_splits, paged_decode_attention

    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, device=device, dtype=torch.long)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=dtype)
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(q)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = choose_num_splits(batch, KV_HEADS, context, sms)

    paged = cuda_time(
        lambda: paged_decode_attention(
            q, k_cache, v_cache, tables, lens, scale, max_context_len=context, out=out
        )
    )

    k = torch.randn(batch, KV_HEADS, context, HEAD_DIM, device=device, dtype=dtype)
    v = torch.randn_like(k)
    q4 = q.view(batch, HEADS, 1, HEAD_DIM)
    sdpa = cuda_time(lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))

    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * k_cache.element_size()
    return {
        "batch": batch,
        "context": context,
        "splits": splits,
        "paged_s": paged,
        "sdpa_s": sdpa,
        "kv_bytes": kv_bytes,
        "paged_bw": kv_bytes / paged,
        "sdpa_bw": kv_bytes / sdpa,
    }


def main() -> dict:
    if not torch.cuda.is_available():
        print(
            "no CUDA GPU on this machine: the Triton decode kernel benchmark needs one; "
            "the kernels' correctness is tested on the CPU interpreter "
            "(tests/kernels/test_triton_kernels.py)"
        )
        result = {"skipped": "no CUDA GPU"}
        print_result(result)
        return result
    device = torch.device("cuda")
    dtype = torch.bfloat16
    copy_bw = copy_bandwidth(device)
    name = torch.cuda.get_device_name(device)
    print(f"device: {name}; device-to-device copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    rows = [run_case(b, c, device, dtype) for b, c in CASES]
    header = (
        "batch x context",
        "splits",
        "paged us",
        "paged GB/s",
        "% of copy",
        "sdpa us",
        "sdpa GB/s",
    )
    print("  ".join(header))
    for r in rows:
        print(
            "  ".join(
                [
                    f"{r['batch']} x {r['context']}",
                    str(r["splits"]),
                    f"{r['paged_s'] * 1e6:.1f}",
                    f"{r['paged_bw'] / 1e9:.0f}",
                    f"{100 * r['paged_bw'] / copy_bw:.0f}%",
                    f"{r['sdpa_s'] * 1e6:.1f}",
                    f"{r['sdpa_bw'] / 1e9:.0f}",
                ]
            )
        )
    headline = rows[0]["paged_bw"] / copy_bw
    print(
        f"goal: >= {GOAL:.0%} of copy bandwidth at 64 x 2048: {headline:.0%} "
        f"({'met' if headline >= GOAL else 'NOT met'})"
    )
    result = {
        "device": name,
        "copy_GBps": copy_bw / 1e9,
        "fraction_of_copy": headline,
        "cases": rows,
    }
    print_result(result)
    return result


# the sweep: the headline case and a decode step of the engine's own check (batch 256 at ~512)
SWEEP_CASES = [(64, 2048), (256, 512)]
SWEEP = {"DECODE_BLOCK_N": (32, 64, 128), "DECODE_NUM_WARPS": (4, 8),
         "DECODE_NUM_STAGES": (2, 3, 4)}  # fmt: skip


def sweep() -> dict:
    """Each setting of the decode kernel's tile and launch (`SWEEP`) timed on `SWEEP_CASES`:
    one JSON line each, then the best by the headline case."""
    from conveyor.kernels import triton_paged

    if not torch.cuda.is_available():
        print("no CUDA GPU on this machine: nothing to sweep")
        return {"skipped": "no CUDA GPU"}
    device = torch.device("cuda")
    copy_bw = copy_bandwidth(device)
    defaults = {name: getattr(triton_paged, name) for name in SWEEP}
    rows = []
    try:
        for values in itertools.product(*SWEEP.values()):
            setting = dict(zip(SWEEP, values, strict=True))
            for name, value in setting.items():
                setattr(triton_paged, name, value)
            shares = {f"{b}x{c}": round(run_case(b, c, device, torch.bfloat16)["paged_bw"]
                                        / copy_bw, 3) for b, c in SWEEP_CASES}  # fmt: skip
            rows.append({**setting, "share_of_copy": shares})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        for name, value in defaults.items():
            setattr(triton_paged, name, value)
    headline = f"{SWEEP_CASES[0][0]}x{SWEEP_CASES[0][1]}"
    best = max(rows, key=lambda r: r["share_of_copy"][headline])
    result = {"device": torch.cuda.get_device_name(device), "copy_GBps": copy_bw / 1e9,
              "defaults": defaults, "best": best}  # fmt: skip
    print_result(result)
    return result


if __name__ == "__main__":
    sweep() if "--sweep" in sys.argv[1:] else main()
