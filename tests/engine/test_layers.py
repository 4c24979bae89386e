"""Model building blocks against the plain computation they stand for."""

from __future__ import annotations

import pytest
import torch

from conveyor.engine.models import layers
from conveyor.engine.models.layers import Linear, PackedLinear


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("widths", [{"gate": 1408, "up": 1408}, {"q": 64, "k": 32, "v": 32}])
def test_packed_linear_shards_match_the_packed_product(bias, widths):
    """Wide packed layers run one product per shard on the CPU; narrow ones run packed. Both
    give each shard's output of the single packed product."""
    torch.manual_seed(0)
    layer = PackedLinear(96, widths, bias=bias)
    x = torch.randn(37, 96)
    expected = []
    for name in widths:
        rows = layer.shard_rows(name)
        expected.append(x @ layer.weight[rows].T + (layer.bias[rows] if bias else 0))
    wide = layer.out_features > layers.CPU_PACKED_MAX_OUT
    assert wide == (len(widths) == 2)
    outs = layer.forward_shards(x)
    assert [o.shape for o in outs] == [(37, size) for size in widths.values()]
    for out, exp in zip(outs, expected, strict=True):
        torch.testing.assert_close(out, exp, rtol=1e-5, atol=1e-5)


def test_prepacked_output_layer_matches_the_plain_product():
    """The output layer's oneDNN copy gives the plain product, for any leading shape."""
    from conveyor.engine.models.layers import PrepackedLinear

    torch.manual_seed(0)
    weight = torch.randn(1000, 64)
    packed = PrepackedLinear.for_cpu(weight)
    assert packed is not None  # float32 on the CPU: this torch has the oneDNN ops
    for shape in [(1, 64), (37, 64), (3, 5, 64)]:
        x = torch.randn(shape)
        torch.testing.assert_close(packed(x), x @ weight.T, rtol=1e-4, atol=1e-4)
    bf16 = PrepackedLinear.for_cpu(weight.bfloat16())
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():  # AVX2 alone: oneDNN refuses bf16
        assert bf16 is None
        return
    assert bf16 is not None
    x = torch.randn(37, 64).bfloat16()
    torch.testing.assert_close(bf16(x), x @ weight.bfloat16().T)
    assert PrepackedLinear.for_cpu(weight.half()) is None  # keeps the plain product


def test_onednn_row_counts_are_few_and_padded_by_at_most_a_sixteenth():
    """oneDNN keeps a kernel of ~0.6-0.9 MB for every row count it meets: above the warm-up's
    sizes a product runs at one of 16 counts per doubling, never more than 1/16 more rows, so
    the counts up to 4,096 are 160 (they were 4,096)."""
    from conveyor.engine.models.layers import EXACT_ROWS, onednn_rows

    counts = [onednn_rows(rows) for rows in range(1, 8193)]
    assert counts[:EXACT_ROWS] == list(range(1, EXACT_ROWS + 1))
    for rows, count in enumerate(counts, start=1):
        assert rows <= count < rows * 17 / 16
        assert onednn_rows(count) == count
    assert counts == sorted(counts)
    assert len(set(counts[:4096])) == 160
    assert {onednn_rows(rows) for rows in (257, 271, 272)} == {272}


def test_prepacked_product_runs_padded_rows_and_returns_only_the_asked_ones(monkeypatch):
    """A product of 300 rows runs at 304 in oneDNN (with zeros below) and gives the plain
    product of the 300."""
    from conveyor.engine.models.layers import PrepackedLinear

    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    packed = PrepackedLinear.for_cpu(weight)
    assert packed is not None
    run, seen = torch.ops.mkldnn._linear_pointwise, []

    def spy(x, *args):
        seen.append(x.shape[0])
        return run(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    for shape in [(300, 64), (2, 150, 64), (64, 64), (65, 64)]:
        x = torch.randn(shape)
        out = packed(x, bias)
        assert out.shape == (*shape[:-1], 96)
        torch.testing.assert_close(out, x @ weight.T + bias, rtol=1e-4, atol=1e-4)
    assert seen == [304, 304, 64, 68]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_projection_matches_the_plain_one_and_drops_its_weight(dtype):
    from conveyor.engine.models.layers import Linear

    torch.manual_seed(0)
    layer = Linear(48, 80, bias=True).to(dtype)
    x = torch.randn(7, 48).to(dtype)
    want = layer(x)
    layer.prepack()
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert layer.packed is None  # AVX2 alone: the plain product, as before
    else:
        assert layer.packed is not None and layer.weight.numel() == 0
    torch.testing.assert_close(layer(x), want)


def test_loaded_model_prepacks_its_output_layer(checkpoints):
    from conveyor.engine import LLM

    llm = LLM(str(checkpoints["llama"]), device="cpu", dtype="float32")
    model = llm.runner.model
    assert model.packed_lm_head is not None
    layer = model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert linear.packed is not None
    hidden = torch.randn(9, model.lm_head.in_features)
    torch.testing.assert_close(
        model.compute_logits(hidden), model.lm_head(hidden), rtol=1e-4, atol=1e-4
    )


def record_products(monkeypatch) -> set[tuple[int, int, int]]:
    """The (rows, in, out) of every oneDNN product run from now on."""
    from conveyor.engine.models.layers import PrepackedLinear

    seen = set()
    run = PrepackedLinear.__call__

    def record(self, x, bias=None):
        seen.add((x.shape[0], x.shape[1], self.out_features))
        return run(self, x, bias)

    monkeypatch.setattr(PrepackedLinear, "__call__", record)
    return seen


def product_shapes(model) -> set[tuple[int, int]]:
    """The (in, out) of each distinct projection of `model` and of its output layer."""
    shapes = {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, Linear)}
    return shapes | {(model.lm_head.in_features, model.lm_head.out_features)}


def test_warm_up_runs_every_projection_at_every_decode_batch_size(checkpoints, monkeypatch):
    """oneDNN builds a product kernel per shape the first time it meets it: a worker's warm-up
    meets every projection shape at every batch size a decode step can have (here 12, within
    the warm-up's bounds), and the cache those kernels live in is sized to keep them all."""
    import os

    from conveyor.engine import LLM
    from conveyor.engine.models.layers import ONEDNN_CACHE_CAPACITY

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    llm = LLM(str(checkpoints["llama"]), device="cpu", dtype="float32", max_num_seqs=12)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_CACHE_CAPACITY)
    seen = record_products(monkeypatch)
    llm.warm_up()
    model = llm.runner.model
    shapes = product_shapes(model)
    assert len(shapes) == 5  # q/k/v, o, gate/up, down, the output layer
    for rows in range(1, 13):
        assert {(rows, *shape) for shape in shapes} <= seen


def test_warm_up_stops_at_the_batch_sizes_whose_products_hide_a_kernel_build(
    checkpoints, monkeypatch
):
    """Warming every batch size up to 256 costs all their products, minutes for a real model's
    output layer on a CPU: the warm-up runs the sizes whose products cost at most
    WARM_UP_ROW_FLOPS, up to WARM_UP_MAX_ROWS of them, each projection at each of them, and
    none past them."""
    from conveyor.engine import LLM
    from conveyor.engine.models import decoder

    llm = LLM(str(checkpoints["llama"]), device="cpu", dtype="float32", max_num_seqs=12)
    model = llm.runner.model
    shapes = product_shapes(model)
    row_flops = sum(2 * k * n for k, n in shapes)
    seen = record_products(monkeypatch)
    monkeypatch.setattr(decoder, "WARM_UP_ROW_FLOPS", 5 * row_flops + 1)
    assert model.warm_up_products(12) == 5
    assert seen == {(rows, *shape) for rows in range(1, 6) for shape in shapes}
    seen.clear()
    monkeypatch.setattr(decoder, "WARM_UP_ROW_FLOPS", row_flops - 1)
    assert model.warm_up_products(12) == 0 and not seen
    monkeypatch.setattr(decoder, "WARM_UP_ROW_FLOPS", 1e15)
    assert model.warm_up_products(12) == 12  # never past a decode step's largest batch
    seen.clear()
    monkeypatch.setattr(decoder, "WARM_UP_MAX_ROWS", 7)
    assert model.warm_up_products(12) == 7
    assert seen == {(rows, *shape) for rows in range(1, 8) for shape in shapes}
