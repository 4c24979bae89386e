"""bench/gpu_check.py, the command that proves a GPU worker: without a GPU it says so and exits
non-zero; its checks' code runs on the CPU with tiny shapes (--cpu-dry-run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_without_a_gpu_it_says_so_and_exits_non_zero():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU visible, on any machine
    done = subprocess.run(
        [sys.executable, str(BENCH / "gpu_check.py")], capture_output=True, text=True, env=env
    )
    assert done.returncode == 2, done.stderr
    assert "no CUDA GPU on this machine" in done.stdout


def test_every_check_runs_on_the_cpu_with_tiny_shapes():
    done = subprocess.run(
        [sys.executable, str(BENCH / "gpu_check.py"), "--cpu-dry-run", "--models", "qwen3-0.6b"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    errors = [r for r in rows if "error" in r]
    assert done.returncode == 0 and not errors, (errors, done.stderr[-3000:])
    checks = {r.get("check") for r in rows}
    assert {"kernels", "decode_bandwidth", "engine_start", "greedy_agreement",
            "throughput_vs_hf", "decode_rates", "step_profile",
            "prompt_logprobs_peak"} <= checks  # fmt: skip
    kernels = next(r for r in rows if r.get("check") == "kernels")
    assert kernels["ok"] and set(kernels["max_rel_err"]) == {
        "decode_float32",
        "decode_bfloat16",
        "prefill_float32",
        "prefill_bfloat16",
    }
    throughput = next(r for r in rows if r.get("check") == "throughput_vs_hf")
    assert throughput["ours_tok_s"] >= throughput["ours_first_run_tok_s"] > 0
    agreement = next(r for r in rows if r.get("check") == "greedy_agreement")
    assert agreement["identical_sequences"] == agreement["of"]  # float32 on the CPU: exact
