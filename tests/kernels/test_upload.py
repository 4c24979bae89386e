"""A step's integer inputs staged in one buffer and read back as views of one tensor."""

from __future__ import annotations

import gc

import torch
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import native_specialize_impl

from conveyor.kernels.upload import StepUpload

CPU = torch.device("cpu")


def test_each_staged_input_reads_back_as_it_was_given():
    upload = StepUpload(CPU)
    ids = upload.add([5, 6, 7])
    tables = upload.add_rows([[1, 2, 3], [4], []])
    empty = upload.add([])
    lens = upload.add(range(2**40, 2**40 + 3))  # past 32 bits: the buffer holds 64-bit values
    fetch = upload.send()
    gc.collect()  # the host buffer lives as long as the tensor that views it
    assert fetch(ids).tolist() == [5, 6, 7]
    assert fetch(tables).tolist() == [[1, 2, 3], [4, 0, 0], [0, 0, 0]]
    assert fetch(empty).shape == (0,)
    assert fetch(lens).tolist() == [2**40, 2**40 + 1, 2**40 + 2]
    assert fetch(ids).dtype == torch.long


def test_a_step_with_nothing_staged_sends_nothing():
    upload = StepUpload(CPU)
    rows = upload.add_rows([])
    fetch = upload.send()
    assert fetch(rows).shape == (0, 0)


def test_every_input_starts_16_byte_aligned():
    """An input at an odd offset would make Triton compile another variant of a kernel (and
    inductor copy the input) in the middle of traffic: warm-up's tensors are all aligned."""
    upload = StepUpload(CPU)
    staged = [upload.add([1, 2, 3]), upload.add_rows([[4], [5]]), upload.add([6]), upload.add([7])]
    fetch = upload.send()
    assert [fetch(s).data_ptr() % 16 for s in staged] == [0, 0, 0, 0]
    # as Triton keys its compiled variants: "D" is a 16-byte aligned pointer
    keys = [native_specialize_impl(BaseBackend, fetch(s), False, True, True) for s in staged]
    assert keys == [("*i64", "D")] * 4
    assert native_specialize_impl(BaseBackend, fetch(staged[0])[1:], False, True, True)[1] == ""
    assert [fetch(s).tolist() for s in staged] == [[1, 2, 3], [[4], [5]], [6], [7]]
