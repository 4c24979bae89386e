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
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
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


class _Routing(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__:
            return index(*args)
        if func is torch.Tensor.__setitem__:
            target, key, value = args
            if not isinstance(value, torch.Tensor):
                value = torch.tensor(value, dtype=target.dtype, device=target.device)
            key_t = key if isinstance(key, tuple) else (key,)
            if any(isinstance(k, torch.Tensor | list) for k in key_t):
                indices = [k if isinstance(k, torch.Tensor) else None for k in key_t]
                torch.ops.aten.index_put_(target, indices, value)
            else:
                index(target, key).copy_(value)
            return None
        if func is torch.tensor and torch.device(kwargs.get("device") or "cpu").type == "cuda":
            # its shape and dtype (fake mode would copy a one-element tensor's data for real)
            data = func(*args, **{**kwargs, "device": "cpu"})
            return torch.empty(data.shape, dtype=data.dtype, device=kwargs["device"])
        if func is torch.Tensor.__invert__:
            return torch.ops.aten.bitwise_not(args[0])
        if func in RANDOM_FILLS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    """Fake tensors, with `cuda` as the default device, while inside."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, _Routing(), torch.device("cuda"):
        yield mode
