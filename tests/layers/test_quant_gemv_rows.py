"""The one-row GEMV with the activations held in registers (layers/quant_gemv_rows.py) equals gguf's dequantized
weights times x, over several K chunks (the last-arriver sum), several row ranges, ragged row and unit counts, bias,
and a column slice of a wider output; `quant_gemv_repacked.gemv` sends one-row products to it.

On the CPU it runs under Triton's interpreter; the CUDA test of test_quant_repacked.py covers it at Qwen3-8B shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

from test_quant_repacked import DEV, assert_product, reference, weight_bytes  # noqa: E402

from draftflow.layers import quant_gemv_repacked as rg  # noqa: E402
from draftflow.layers import quant_gemv_rows as rows_kernel  # noqa: E402
from draftflow.layers import quant_repack as qr  # noqa: E402
from draftflow.layers.quant_linear import LAYOUT  # noqa: E402


def _packed(qtype: str, n: int, units: int, seed: int = 0):
    k = units * 128 // qr.SPEC[qtype][0]  # units of 16 bytes
    assert k % LAYOUT[qtype][0] == 0
    data = weight_bytes(qtype, n, k, seed)
    return qr.repack(torch.from_numpy(data).to(DEV), qtype, k), reference(data, qtype).to(DEV), k


@pytest.mark.parametrize(("qtype", "units"), [("Q4_K", 72), ("Q6_K", 48), ("Q8_0", 40), ("Q4_0", 24), ("Q5_K", 32)])
def test_rows_kernel_equals_the_dequantized_product(qtype, units):
    """72 Q4_K units: 3 chunks, the last ragged; 24 Q4_0 units: one ragged chunk (stored directly); 37 rows over
    ranges of 16 rows."""
    packed, w, k = _packed(qtype, 37, units)
    x = torch.randn(1, k, device=DEV, generator=torch.Generator(DEV).manual_seed(1))
    assert_product(rows_kernel.gemv(x, packed, qtype, rows=16), x, w)
    bias = torch.randn(37, device=DEV)
    wide = torch.full((1, 50), float("nan"), device=DEV)
    got = rows_kernel.gemv(x, packed, qtype, bias, out=wide[:, 5:42], rows=32)
    assert got.data_ptr() == wide[:, 5:].data_ptr()
    assert_product(wide[:, 5:42], x, w, bias)
    assert wide[:, :5].isnan().all() and wide[:, 42:].isnan().all()  # nothing written outside the slice


def test_one_row_products_take_the_rows_kernel_and_agree_with_the_split_k_kernel(monkeypatch):
    """bf16 activations: the dispatcher's one-row Q6_K result is the rows kernel's, and the split-K kernel's (forced
    by an explicit tile) agrees with it to float32 summation order; Q4_K is taken too, Q4_0 (not in QTYPES) and ON off
    keep the split-K kernel."""
    packed, w, k = _packed("Q6_K", 40, 64, seed=3)
    x = torch.randn(1, k, device=DEV, generator=torch.Generator(DEV).manual_seed(2)).to(torch.bfloat16)
    assert rows_kernel.fits(x, packed, "Q6_K", None) and rows_kernel.fits(x, packed, "Q4_K", None)
    assert not rows_kernel.fits(x, packed, "Q4_0", None)
    got = rg.gemv(x, packed, "Q6_K")
    assert torch.equal(got, rows_kernel.gemv(x, packed, "Q6_K"))
    split_k = rg.gemv(x, packed, "Q6_K", block_n=16, units=4, num_warps=4, split_k=2)
    assert (got.float() - split_k.float()).abs().max() <= 2 ** -7 * split_k.float().abs().max()
    assert_product(got.float(), x.float(), w, rtol=2 ** -7)
    monkeypatch.setattr(rows_kernel, "ON", False)
    assert not rows_kernel.fits(x, packed, "Q6_K", None)
    assert torch.equal(rg.gemv(x, packed, "Q6_K"), rg.gemv(x, packed, "Q6_K", block_n=256, units=8, num_warps=4,
                                                            split_k=2))


def test_rows_a_step_is_a_parameter_and_must_divide_the_rows_a_program():
    """The benchmark's sweep knob: 4 rows a step gives the same product; rows a program must be a multiple of it."""
    packed, w, k = _packed("Q4_K", 21, 40, seed=4)
    x = torch.randn(1, k, device=DEV, generator=torch.Generator(DEV).manual_seed(5))
    assert_product(rows_kernel.gemv(x, packed, "Q4_K", rows=16, block_n=4), x, w)
    with pytest.raises(ValueError, match="multiple of the rows a step"):
        rows_kernel.gemv(x, packed, "Q4_K", rows=16, block_n=32)


def test_rows_per_program_fill_the_device():
    """The most rows a program (power-of-two steps, <= 256) that keep PROGRAMS_PER_SM programs per multiprocessor."""
    want = rows_kernel.PROGRAMS_PER_SM * 132
    for n, chunks in ((24576, 4), (6144, 4), (4096, 12), (4096, 4)):
        rows = rows_kernel.rows_per_program(n, chunks, 132)
        assert rows % 16 == 0 and -(-n // rows) * chunks >= want
        assert rows == 256 or -(-n // (2 * rows)) * chunks < want
    assert rows_kernel.rows_per_program(24576, 4, 132) == 64
    assert rows_kernel.rows_per_program(2048, 4, 132) == 16  # the grid cannot fill the device: one step each


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_loop_steps_in_flight_give_the_same_product(qtype):
    """`stages` (tl.range's software pipelining of the code loads) changes when bytes arrive, not the arithmetic: the
    rows kernel and the 16-row split-K kernel give bit-identical products at 1 and 3 stages."""
    packed, w, k = _packed(qtype, 40, 64, seed=6)
    gen = torch.Generator(DEV).manual_seed(7)
    x = torch.randn(1, k, device=DEV, generator=gen)
    one = rows_kernel.gemv(x, packed, qtype, rows=16, stages=1)
    assert torch.equal(rows_kernel.gemv(x, packed, qtype, rows=16, stages=3), one)
    assert_product(one, x, w)
    xs = torch.randn(16, k, device=DEV, generator=gen).to(torch.bfloat16)
    window = rg.gemv(xs, packed, qtype, stages=1)
    assert torch.equal(rg.gemv(xs, packed, qtype, stages=3), window)
    assert_product(window.float(), xs.float(), w, rtol=2 ** -7)


@pytest.mark.parametrize(("qtype", "int8"), [("Q4_K", 0), ("Q4_K", 2), ("Q8_0", 2), ("Q6_K", 0)])
def test_prefetching_the_next_step_gives_the_same_product(qtype, int8):
    """`prefetch` (a step loads the next step's codes before computing its own) moves loads, not arithmetic:
    bit-identical products over ragged row ranges (37 rows, 16 a program: the last range has 5) and several chunks."""
    packed, w, k = _packed(qtype, 37, 72 if qtype == "Q4_K" else 48, seed=8)
    x = torch.randn(1, k, device=DEV, generator=torch.Generator(DEV).manual_seed(9))
    x = x.to(torch.bfloat16) if int8 else x
    plain = rows_kernel.gemv(x, packed, qtype, rows=16, block_n=8, int8=int8, prefetch=False)
    assert torch.equal(rows_kernel.gemv(x, packed, qtype, rows=16, block_n=8, int8=int8, prefetch=True), plain)
    if not int8:
        assert_product(plain, x, w)


@pytest.mark.parametrize(("qtype", "units"), [("Q4_K", 72), ("Q6_K", 48), ("Q8_0", 40), ("Q5_0", 32)])
def test_int8_activations_take_the_codes_products_as_integer_dot_products(qtype, units):
    """16-bit activations of INT8_QTYPES: the kernel quantizes each unit's activations (two int8 terms by default)
    and sums codes times them with dp4a (byte by byte under the interpreter). Two terms stay within 2^-12 of the
    float product's magnitude (measured ~2^-14), one term within 2^-5 (llama.cpp's MMVQ; measured ~2^-6); float32
    activations keep the float multiply-adds, bit for bit."""
    packed, w, k = _packed(qtype, 37, units, seed=8)
    x = torch.randn(1, k, device=DEV, generator=torch.Generator(DEV).manual_seed(9)).to(torch.bfloat16)
    x[0, 5] = 40.0  # an outlier: its unit's other activations get coarser steps
    taken = qtype in rows_kernel.INT8_QTYPES  # every type of the rows kernel since 2026-12-07 (Q6_K too)
    assert rows_kernel.int8_terms(x, qtype) == (2 if taken else 0) and rows_kernel.INT8_TERMS == 2
    assert taken
    assert rows_kernel.int8_terms(x.float(), qtype) == 0
    want = x.double() @ w.double().T
    errors = {}
    for terms in (1, 2):
        got = rows_kernel.gemv(x.float(), packed, qtype, rows=16, int8=terms)
        errors[terms] = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert errors[2] <= 2 ** -12 and errors[1] <= 2 ** -5 and errors[2] < errors[1] / 50, errors
    assert torch.equal(rows_kernel.gemv(x, packed, qtype, rows=16),
                       rows_kernel.gemv(x, packed, qtype, rows=16, int8=2 if taken else 0))
    assert torch.equal(rows_kernel.gemv(x.float(), packed, qtype, rows=16),
                       rows_kernel.gemv(x.float(), packed, qtype, rows=16, int8=0))
    with pytest.raises(ValueError, match="int8 terms must be 0, 1 or 2"):
        rows_kernel.gemv(x, packed, qtype, int8=3)


def test_int8_activations_of_zero_units_give_the_offsets_alone():
    """A unit whose activations are all zero has no step (amax 0): its products are 0, not NaN."""
    packed, w, k = _packed("Q4_K", 16, 16, seed=10)
    x = torch.randn(1, k, device=DEV, generator=torch.Generator(DEV).manual_seed(11)).to(torch.bfloat16)
    x[0, :64] = 0.0  # two units
    got = rows_kernel.gemv(x.float(), packed, "Q4_K", rows=16, int8=2)
    assert not got.isnan().any()
    assert_product(got, x.float(), w, rtol=2 ** -12)
