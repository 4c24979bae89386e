"""Every Triton launch happens with its tensors' device current: Triton launches on the current
CUDA device, so a worker on cuda:1 (or an engine thread that never set its device) would launch
against device 0. Run on fake CUDA tensors on cuda:1 with the kernels replaced by recorders."""

from __future__ import annotations

import contextlib

import pytest
import torch

from conveyor.kernels import triton_layers as tl_
from conveyor.kernels import triton_paged as tk
from tests.fake_cuda import fake_cuda

KERNELS = {
    tk: ("_store_kv_kernel", "_decode_split_kernel", "_decode_merge_kernel", "_prefill_kernel"),
    tl_: ("_rms_norm_kernel", "_norm_rope_kernel", "_silu_mul_kernel"),
}


class Recorder:
    def __init__(self, name: str, current: list) -> None:
        self.name, self.current, self.launches = name, current, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(self.current[-1] if self.current else None)

        return launch


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> dict[str, Recorder]:
    current: list[torch.device] = []

    @contextlib.contextmanager
    def device(d):
        current.append(torch.device(d))
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(tk, "_num_sms", lambda _: 132)
    recorders = {}
    for module, names in KERNELS.items():
        for name in names:
            recorders[name] = Recorder(name, current)
            monkeypatch.setattr(module, name, recorders[name])
    return recorders


def test_every_launch_has_its_tensors_device_current(launches):
    gpu = torch.device("cuda", 1)
    with fake_cuda():
        k_cache = torch.empty(16, 2, 8, 64, device=gpu, dtype=torch.bfloat16)
        v_cache = torch.empty_like(k_cache)
        key = torch.empty(5, 2, 64, device=gpu, dtype=torch.bfloat16)
        tk.store_kv(key, key, k_cache, v_cache, torch.empty(5, dtype=torch.long, device=gpu))
        query = torch.empty(3, 4, 64, device=gpu, dtype=torch.bfloat16)
        tables = torch.empty(3, 4, dtype=torch.long, device=gpu)
        lens = torch.empty(3, dtype=torch.long, device=gpu)
        # long enough to split (a split kernel and a merge kernel), and too short to (the
        # split kernel writes the output: no merge)
        tk.paged_decode_attention(
            query, k_cache, v_cache, tables, lens, 0.125, max_context_len=3000
        )
        tk.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125, max_context_len=30)
        starts = torch.empty(4, dtype=torch.long, device=gpu)
        tk.paged_prefill_attention(
            query, k_cache, v_cache, tables, starts, lens, 0.125, max_query_len=2
        )
        hidden = torch.empty(5, 64, device=gpu, dtype=torch.bfloat16)
        tl_.rms_norm(hidden, torch.empty(64, device=gpu, dtype=torch.bfloat16), 1e-6)
        rows = torch.empty(5, 64, device=gpu, dtype=torch.bfloat16)
        tl_.norm_rope_(key, rows, rows)
        tl_.silu_mul(torch.empty(5, 128, device=gpu, dtype=torch.bfloat16))
    for name, recorder in launches.items():
        times = 2 if name == "_decode_split_kernel" else 1
        assert recorder.launches == [gpu] * times, (name, recorder.launches)


def test_the_engine_makes_its_device_current_on_the_thread_that_steps_it(monkeypatch):
    from conveyor.engine.llm_engine import use_device

    current = {"device": 0}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["device"])
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.update(device=d.index))
    use_device(torch.device("cuda", 1))
    assert current["device"] == 1
    use_device(torch.device("cpu"))  # nothing to do on the CPU
    assert current["device"] == 1
