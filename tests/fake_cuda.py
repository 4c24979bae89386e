"""Build and run engine code on a `cuda` device with no GPU: PyTorch's fake tensors carry a
device and raise `FakeTensorDeviceMismatchError` on any CPU tensor mixed with a CUDA one, so a
tensor made on the wrong device fails the test that builds it.

A CPU-only torch cannot do a few things with a fake CUDA tensor: index it with `[]`, invert it
with `~`, make it from data (`torch.tensor(..., device="cuda")`), fill it at random (`uniform_`,
`normal_`, which module initialisation calls). Each is routed through the ops it stands for
(which work), and random fills leave the tensor as it is: its values do not exist anyway.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode

RANDOM_FILLS = {
    torch.Tensor.uniform_,
    torch.Tensor.normal_,
    torch.Tensor.random_,
    torch.Tensor.exponential_,
    torch.Tensor.bernoulli_,
    torch.nn.init.uniform_,
    torch.nn.init.normal_,
    torch.nn.init.trunc_normal_,
    torch.nn.init.kaiming_uniform_,
    torch.nn.init.kaiming_normal_,
    torch.nn.init.xavier_uniform_,
    torch.nn.init.xavier_normal_,
}


def index(t: torch.Tensor, key) -> torch.Tensor:
    """`t[key]` through aten ops: ints, slices, None, Ellipsis, and one or more index tensors
    (advanced indexing, as aten.index)."""
    key = key if isinstance(key, tuple) else (key,)
    used = sum(
        (k.dim() if isinstance(k, torch.Tensor) and k.dtype == torch.bool else 1)
        for k in key
        if k is not None and k is not Ellipsis
    )
    out, dim, advanced = t, 0, []
    for k in key:
        if k is None:
            out, dim = out.unsqueeze(dim), dim + 1
        elif k is Ellipsis:
            dim += t.dim() - used
        elif isinstance(k, bool):
            raise NotImplementedError("indexing with a Python bool")
        elif isinstance(k, int):
            out = out.select(dim, k)
        elif isinstance(k, slice):
            step = 1 if k.step is None else k.step
            out = torch.ops.aten.slice(out, dim, k.start, k.stop, step)
            dim += 1
        else:
            k = k if isinstance(k, torch.Tensor) else torch.tensor(k, device=out.device)
            advanced.append((dim, k))
            dim += 1
    if advanced:
        indices: list[torch.Tensor | None] = [None] * out.dim()
        for d, k in advanced:
            indices[d] = k
        while indices and indices[-1] is None:
            indices.pop()
        out = torch.ops.aten.index(out, indices)
    return out


class Transfers(Counter):
    """Copies between the host and the device, as a GPU would see them: `uploads` (pinned and
    non-blocking), `blocking_uploads` (from pageable memory: the host waits) and `downloads`
    (the host waits for the device: `.tolist()`, `.item()`, `.cpu()`...)."""


def _is_cuda(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "cuda"


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    """A real CPU tensor of `t`'s shape and dtype (zeros): fake tensors have no values."""
    with unset_fake_temporarily():
        return torch.zeros(t.shape, dtype=t.dtype, device="cpu")


DOWNLOADS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy}


class _Routing(TorchFunctionMode):
    def __init__(self, transfers: Transfers) -> None:
        super().__init__()
        self.transfers = transfers
        self.pinned: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in DOWNLOADS and _is_cuda(args[0]):
            self.transfers["downloads"] += 1
            with unset_fake_temporarily():
                return func(_placeholder(args[0]), *args[1:], **kwargs)
        if func is torch.Tensor.pin_memory:
            self.pinned.add(id(args[0]))
            return args[0]
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            return self._to(func, args, kwargs)
        if func is torch.Tensor.__getitem__:
            return index(*args)
        if func is torch.Tensor.__setitem__:
            target, key, value = args
            if not isinstance(value, torch.Tensor):
                value = torch.full((), value, dtype=target.dtype, device=target.device)
            key_t = key if isinstance(key, tuple) else (key,)
            if any(isinstance(k, torch.Tensor | list) for k in key_t):
                indices = [k if isinstance(k, torch.Tensor) else None for k in key_t]
                torch.ops.aten.index_put_(target, indices, value)
            else:
                index(target, key).copy_(value)
            return None
        if func is torch.tensor and torch.device(kwargs.get("device") or "cpu").type == "cuda":
            # its shape and dtype (fake mode would copy a one-element tensor's data for real)
            self.transfers["blocking_uploads"] += 1
            data = func(*args, **{**kwargs, "device": "cpu"})
            return torch.empty(data.shape, dtype=data.dtype, device=kwargs["device"])
        if func is torch.Tensor.__invert__:
            return torch.ops.aten.bitwise_not(args[0])
        if func in RANDOM_FILLS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)

    def _to(self, func, args, kwargs):
        source = args[0]
        target = kwargs.get("device")
        if target is None:
            target = "cuda" if func is torch.Tensor.cuda else next(
                (a for a in args[1:] if isinstance(a, str | torch.device)), None
            )  # fmt: skip
        if target is None:
            return func(*args, **kwargs)
        target = torch.device(target)
        if source.device.type == "cpu" and target.type == "cuda":
            quiet = kwargs.get("non_blocking") and id(source) in self.pinned
            self.transfers["uploads" if quiet else "blocking_uploads"] += 1
            return torch.empty(source.shape, dtype=source.dtype, device=target)
        if source.device.type == "cuda" and target.type == "cpu":
            self.transfers["downloads"] += 1
            return _placeholder(source)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_cuda() -> Iterator[Transfers]:
    """Fake tensors, with `cuda` as the default device, while inside; yields the count of
    host-device copies made meanwhile."""
    transfers = Transfers()

    def tolist(self: FakeTensor) -> list:  # FakeTensor's own reads each element: one read here
        if self.device.type == "cuda":
            transfers["downloads"] += 1
        with unset_fake_temporarily():
            return _placeholder(self).tolist()

    original, FakeTensor.tolist = FakeTensor.tolist, tolist
    # with a real GPU, a fake tensor's first use of a device makes a real tensor there, which
    # fails for `cuda:1` on a one-GPU machine; fake tensors need no device context
    init_context, fake_tensor.init_gpu_context = fake_tensor.init_gpu_context, lambda device: None
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), _Routing(transfers), torch.device("cuda"):
            yield transfers
    finally:
        FakeTensor.tolist = original
        fake_tensor.init_gpu_context = init_context
