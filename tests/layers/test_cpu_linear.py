"""layers/cpu_linear.py: which float32 CPU products go to oneDNN, their packed weights, and that they compute F.linear's product."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from draftflow.layers import cpu_linear

needs_onednn = pytest.mark.skipif(not cpu_linear.HAS_ONEDNN, reason="this torch build has no oneDNN linear")
needs_packing = pytest.mark.skipif(not cpu_linear.HAS_PACKING, reason="this torch build cannot pack oneDNN weights")


@needs_onednn
def test_unpacked_windows_and_large_weights_go_to_onednn_small_rows_stay_on_f_linear():
    small, large = torch.randn(384, 384), torch.randn(cpu_linear.ONEDNN_WEIGHTS // 384 + 1, 384)
    one, window = torch.randn(1, 1, 384), torch.randn(1, 16, 384)
    assert not cpu_linear.uses_onednn(one, small)  # one row, small weight: MKL is faster
    assert cpu_linear.uses_onednn(one, large)  # one row through an LM-head-sized weight
    assert cpu_linear.uses_onednn(window, small)  # a verify window
    assert not cpu_linear.uses_onednn(window.bfloat16(), small.bfloat16())  # float32 only
    assert not cpu_linear.uses_onednn(window[:, :0], large)  # no rows
    assert not cpu_linear.uses_onednn(window, large.t().contiguous().t())  # a strided weight


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 1, 384), (1, 16, 384), (2, 3, 384), (5, 384)])
def test_the_product_is_f_linears_to_rounding_with_and_without_bias(shape):
    gen = torch.Generator().manual_seed(len(shape))
    x, w, b = torch.randn(shape, generator=gen), torch.randn(2048, 384, generator=gen), torch.randn(2048, generator=gen)
    for bias in (None, b):
        got = cpu_linear.linear(x, w, bias)
        assert got.shape == (*shape[:-1], 2048)
        torch.testing.assert_close(got, F.linear(x, w, bias), atol=1e-4, rtol=1e-5)


def test_autograd_and_other_dtypes_take_f_linear_exactly():
    """Training (tensors that need gradients) and non-float32 products are F.linear's, bit for bit."""
    x = torch.randn(1, 16, 384)
    w = torch.randn(640, 384, requires_grad=True)
    out = cpu_linear.linear(x, w)
    assert out.requires_grad and torch.equal(out, F.linear(x, w))
    xb, wb = x.bfloat16(), w.detach().bfloat16()
    assert torch.equal(cpu_linear.linear(xb, wb), F.linear(xb, wb))


@pytest.fixture
def fresh_packs(monkeypatch):
    monkeypatch.setattr(cpu_linear, "PACKS", cpu_linear._Packs())
    return cpu_linear.PACKS


@needs_packing
def test_a_weight_is_packed_once_and_every_row_count_uses_the_copy(fresh_packs):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(384, 384, generator=gen)  # small: unpacked, one row would stay on F.linear
    for rows in (1, 16, 1, 5):
        x = torch.randn(1, rows, 384, generator=gen)
        torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)
    assert cpu_linear.packed_bytes() == w.numel() * 4 and len(fresh_packs.by_base) == 1
    first = fresh_packs.get(w)
    assert first is fresh_packs.get(w) and first.is_mkldnn  # no second reorder


@needs_packing
def test_an_in_place_write_repacks_and_a_freed_weight_drops_its_copy(fresh_packs):
    w, x = torch.randn(640, 384), torch.randn(1, 16, 384)
    cpu_linear.linear(x, w)
    w.mul_(-2.0)  # e.g. load_state_dict after a first forward
    torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)
    assert cpu_linear.packed_bytes() == w.numel() * 4  # replaced, not added
    del w
    gc.collect()
    assert cpu_linear.packed_bytes() == 0 and not fresh_packs.by_base


@needs_packing
def test_row_slice_views_of_one_storage_pack_separately(fresh_packs):
    """fuse_projections' weights: q/k/v as row views of one tensor, and their joined view, each its own copy."""
    group, x = torch.randn(640, 384), torch.randn(1, 3, 384)
    q, kv = group[:384], group[384:]
    for w in (q, kv, group):
        torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)
    assert len(fresh_packs.by_base) == 1 and len(next(iter(fresh_packs.by_base.values()))[1]) == 3
    assert cpu_linear.packed_bytes() == 2 * group.numel() * 4


@needs_packing
def test_past_the_limit_products_run_unpacked_by_the_old_rule(fresh_packs, monkeypatch):
    monkeypatch.setattr(cpu_linear, "PACK_LIMIT_BYTES", 384 * 384 * 4)
    kept, over, x = torch.randn(384, 384), torch.randn(2048, 384), torch.randn(1, 1, 384)
    cpu_linear.linear(x, kept)
    got = cpu_linear.linear(x, over)  # over the limit: plain oneDNN (a large weight), not packed
    torch.testing.assert_close(got, F.linear(x, over), atol=1e-4, rtol=1e-5)
    assert cpu_linear.packed_bytes() == kept.numel() * 4 and fresh_packs.get(over) is None


@needs_packing
def test_a_weight_made_in_inference_mode_packs_too(fresh_packs):
    """Inference tensors have no version counter; such a weight is packed once and used."""
    with torch.inference_mode():
        w, x = torch.randn(640, 384), torch.randn(1, 16, 384)
        got = cpu_linear.linear(x, w)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-4, rtol=1e-5)
    assert cpu_linear.packed_bytes() == w.numel() * 4


@pytest.fixture
def onednn_calls(monkeypatch):
    """Every oneDNN product from here on, as (weight's [N, K], row count), in order."""
    calls = []
    real = cpu_linear._onednn

    def spy(rows, weight, bias):
        calls.append(((weight.size(0), weight.size(1)), rows.shape[0]))
        return real(rows, weight, bias)

    monkeypatch.setattr(cpu_linear, "_onednn", spy)
    return calls


@needs_packing
def test_noted_products_build_the_row_counts_asked_for_once_each(fresh_packs, onednn_calls):
    gen = torch.Generator().manual_seed(5)
    w, v, head = (torch.randn(n, 384, generator=gen) for n in (640, 640, 2048))  # w, v: one kernel kind
    with cpu_linear.noting() as noted:
        cpu_linear.linear(torch.randn(1, 3, 384, generator=gen), w)
        cpu_linear.linear(torch.randn(1, 3, 384, generator=gen), v)
        cpu_linear.linear(torch.randn(1, 1, 384, generator=gen), head)
        with cpu_linear.noting() as inner:  # a nested note keeps its products to itself
            cpu_linear.linear(torch.randn(2, 384, generator=gen), head)
    assert sorted((key[0], rows) for key, (_, _, rows) in noted.items()) == [((640, 384), {3}), ((2048, 384), {1})]
    assert [(key[0], rows) for key, (_, _, rows) in inner.items()] == [((2048, 384), {2})]
    onednn_calls.clear()
    # each kind at the counts asked for its noted count m; counts below 1 and those already run are skipped
    assert cpu_linear.build_kernels(noted, lambda m: range(m - 3, m + 2)) == 3 + 1
    assert sorted(onednn_calls) == [((640, 384), 1), ((640, 384), 2), ((640, 384), 4), ((2048, 384), 2)]
    assert cpu_linear.build_kernels(noted, lambda m: range(1, 3)) == 0  # built now
    assert cpu_linear.build_kernels({}, lambda m: range(1, 5)) == 0  # nothing noted (CUDA, autograd): nothing runs


@needs_packing
def test_weights_past_the_build_limit_are_left_to_their_first_product(fresh_packs, onednn_calls, monkeypatch):
    monkeypatch.setattr(cpu_linear, "BUILD_MAX_BYTES", 640 * 384 * 4)
    small, large = torch.randn(640, 384), torch.randn(641, 384)
    with cpu_linear.noting() as noted:
        for w in (small, large):
            cpu_linear.linear(torch.randn(2, 384), w)
    onednn_calls.clear()
    assert cpu_linear.build_kernels(noted, lambda m: range(1, 4)) == 2
    assert sorted(onednn_calls) == [((640, 384), 1), ((640, 384), 3)]
