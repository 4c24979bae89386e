"""A step's integer inputs staged in one buffer and read back as views of one tensor."""

from __future__ import annotations

import gc

import torch

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
