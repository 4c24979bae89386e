"""Workers that share a machine's GPUs each claim a different one (worker/gpu.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.worker.gpu import NoFreeGPU, claim_gpu

HOLD = """
import sys, time
from pathlib import Path
from conveyor.worker.gpu import claim_gpu
index, lock = claim_gpu(Path(sys.argv[1]), int(sys.argv[2]))
print(index, flush=True)
time.sleep(600)
"""


def test_each_claim_gets_its_own_gpu_until_released(tmp_path: Path) -> None:
    first, lock0 = claim_gpu(tmp_path, 3)
    second, lock1 = claim_gpu(tmp_path, 3)
    third, lock2 = claim_gpu(tmp_path, 3)
    assert [first, second, third] == [0, 1, 2]
    with pytest.raises(NoFreeGPU, match="all 3 GPUs are claimed"):
        claim_gpu(tmp_path, 3)
    lock1.close()  # that worker ended
    again, lock1 = claim_gpu(tmp_path, 3)
    assert again == 1
    for lock in (lock0, lock1, lock2):
        lock.close()


def test_a_killed_worker_frees_its_gpu(tmp_path: Path) -> None:
    holders = [
        subprocess.Popen(
            [sys.executable, "-c", HOLD, str(tmp_path), "2"], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        claimed = [int(p.stdout.readline()) for p in holders]  # type: ignore[union-attr]
        assert sorted(claimed) == [0, 1]
        with pytest.raises(NoFreeGPU):
            claim_gpu(tmp_path, 2)
        holders[0].kill()  # SIGKILL: no cleanup code runs, the kernel drops the lock
        holders[0].wait(10)
        index, lock = claim_gpu(tmp_path, 2)
        lock.close()
        assert index == claimed[0]
    finally:
        for p in holders:
            p.kill()
            p.wait(10)
