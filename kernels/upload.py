"""One step's integer inputs (token ids, positions, KV slots, block tables, lengths, the rows
to read) gathered in one host buffer and copied to the device once: on CUDA from pinned memory
and without blocking the host, where a `torch.tensor(list, device="cuda")` per input is a
blocking copy each. Every input is a view of the one device tensor.
"""

from __future__ import annotations

import array
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Staged:
    """Where one input lies in the step's buffer."""

    offset: int
    shape: tuple[int, ...]


Fetch = Callable[[Staged], torch.Tensor]


# Each input starts on a multiple of 16 bytes (two values). Triton compiles a kernel again
# for a pointer that is not 16-byte aligned, and inductor copies such an input at every call:
# views at whatever offset the step's earlier inputs left would compile new variants of the
# attention kernels in the middle of traffic, which warm-up (fresh, aligned tensors) never met.
ALIGN = 2


class StepUpload:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.values: list[int] = []

    def _next_offset(self) -> int:
        if len(self.values) % ALIGN:
            self.values.extend([0] * (ALIGN - len(self.values) % ALIGN))
        return len(self.values)

    def add(self, values: Sequence[int]) -> Staged:
        staged = Staged(self._next_offset(), (len(values),))
        self.values.extend(values)
        return staged

    def add_rows(self, rows: Sequence[Sequence[int]]) -> Staged:
        """Rows of different lengths as one [len(rows), longest] block, padded with 0."""
        lengths = [len(r) for r in rows]
        width = max(lengths, default=0)
        staged = Staged(self._next_offset(), (len(rows), width))
        values, padding = self.values, [0] * width
        for row, length in zip(rows, lengths, strict=True):
            values.extend(row)
            values.extend(padding[length:])
        return staged

    def send(self) -> Fetch:
        """Copy everything staged to the device (one copy); returns the view of each input."""
        # through an array: torch.tensor reads a long list item by item, 4x slower (0.9 ms
        # for a decode step of 256 sequences' tables)
        host = (
            torch.frombuffer(array.array("q", self.values), dtype=torch.long)
            if self.values
            else torch.zeros(0, dtype=torch.long, device="cpu")
        )
        on_device = upload(host, self.device)

        def fetch(staged: Staged) -> torch.Tensor:
            size = math.prod(staged.shape)
            return on_device[staged.offset : staged.offset + size].view(staged.shape)

        return fetch


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor: make it with `device="cpu"`, as the default device may be
    another) on `device`. To CUDA from pinned memory: the copy runs on the
    stream while the host goes on, and the caching host allocator keeps the buffer until the
    copy has finished."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def to_device(
    values: Sequence[int] | Sequence[float], device: torch.device, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    """A list as a tensor on `device`, copied as `upload` copies."""
    return upload(torch.tensor(values, dtype=dtype, device="cpu"), device)
