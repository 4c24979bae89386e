"""One GPU per worker when several workers share a machine's GPUs.

docker-compose gives every replica of `--scale worker=N` the same device request, so each
replica sees all the GPUs. Each worker then claims one for itself: an exclusive `flock` on
`<lock dir>/gpu-<index>.lock` in a volume the replicas share. The kernel drops the lock
when the process dies, however it dies, so a restarted worker can take the GPU again.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO


class NoFreeGPU(RuntimeError):
    pass


def claim_gpu(lock_dir: Path, count: int) -> tuple[int, IO[bytes]]:
    """The lowest GPU index in `range(count)` no other live worker holds, and the open lock
    file that holds it (keep it open for the life of the process)."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        handle = open(lock_dir / f"gpu-{index}.lock", "ab")  # noqa: SIM115 (held until exit)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        handle.truncate(0)
        handle.write(f"{os.getpid()}\n".encode())
        handle.flush()
        return index, handle
    raise NoFreeGPU(
        f"all {count} GPUs are claimed by other workers (locks in {lock_dir}); "
        "run at most one worker per GPU"
    )
