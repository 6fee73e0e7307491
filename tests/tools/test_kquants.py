"""tools.kquants: our Q4_K / Q5_K / Q6_K quantizer, read back by gguf's own dequantizers."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from draftflow.tools.kquants import BLOCK_BYTES, quantize_k

KINDS = {"Q4_K": Q.Q4_K, "Q5_K": Q.Q5_K, "Q6_K": Q.Q6_K}


def _roundtrip(x: np.ndarray, kind: str) -> np.ndarray:
    return gguf.quants.dequantize(quantize_k(x, kind), KINDS[kind])


def _rel_rmse(y: np.ndarray, x: np.ndarray) -> float:
    return float(np.sqrt(((y - x) ** 2).mean() / (x ** 2).mean()))


@pytest.fixture(scope="module")
def weights():
    """Gaussian rows with a few large columns, like trained projections' outlier features."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((48, 1024)).astype(np.float32) * 0.02
    x[:, rng.choice(1024, 12, replace=False)] *= 10
    return x


@pytest.mark.parametrize("kind", KINDS)
def test_shape_and_bytes_match_ggufs_block_layout(weights, kind):
    q = quantize_k(weights, kind)
    assert q.dtype == np.uint8 and q.shape == (48, 4 * BLOCK_BYTES[kind])
    assert gguf.GGML_QUANT_SIZES[KINDS[kind]] == (256, BLOCK_BYTES[kind])
    assert _roundtrip(weights, kind).shape == weights.shape
    stacked = quantize_k(weights.reshape(4, 12, 1024), kind)  # merged experts [E, out, in]: same bytes per row
    assert np.array_equal(stacked.reshape(48, -1), q)


def test_error_ranks_with_bits_and_beats_the_legacy_types_of_the_same_width(weights):
    """Measured error: each K-quant below gguf's legacy quantizer of the same width (Q4_1, Q5_1), Q6_K below Q5_K,
    each extra bit at least ~1.5x less error, and the levels we measured when writing it (0.096 / 0.047 / 0.028)."""
    err = {k: _rel_rmse(_roundtrip(weights, k), weights) for k in KINDS}
    legacy = {k: _rel_rmse(gguf.quants.dequantize(gguf.quants.quantize(weights, t), t), weights)
              for k, t in (("Q4_1", Q.Q4_1), ("Q5_1", Q.Q5_1), ("Q8_0", Q.Q8_0))}
    assert err["Q4_K"] < legacy["Q4_1"] and err["Q5_K"] < legacy["Q5_1"], (err, legacy)
    assert legacy["Q8_0"] < err["Q6_K"] < err["Q5_K"] / 1.5 and err["Q5_K"] < err["Q4_K"] / 1.8, (err, legacy)
    assert err["Q4_K"] < 0.11 and err["Q5_K"] < 0.055 and err["Q6_K"] < 0.032, err


@pytest.mark.parametrize("kind", KINDS)
def test_special_rows_zero_one_signed_and_a_single_spike(kind):
    """Zeros stay zeros; one-signed rows (the unsigned min is 0 or the whole range) and a lone spike keep their sign
    and size; nothing becomes NaN or inf."""
    rng = np.random.default_rng(1)
    rows = np.zeros((5, 256), dtype=np.float32)
    rows[1] = rng.uniform(0.5, 1.5, 256)  # all positive
    rows[2] = -rng.uniform(0.5, 1.5, 256)  # all negative
    rows[3, 17] = 3.0  # one spike in zeros
    rows[4] = 1e-8 * rng.standard_normal(256)  # tiny values: the f16 scales underflow to 0
    y = _roundtrip(rows, kind)
    assert np.isfinite(y).all()
    assert np.array_equal(y[0], rows[0])
    for r in (1, 2):
        assert _rel_rmse(y[r], rows[r]) < 0.05 and np.all(np.sign(y[r]) == np.sign(rows[r]))
    assert abs(y[3, 17] - 3.0) < 0.05 and np.abs(np.delete(y[3], 17)).max() < 1e-3
    assert np.abs(y[4]).max() < 1e-6


@pytest.mark.parametrize("kind", KINDS)
def test_values_on_the_grid_come_back_to_their_codes(kind):
    """A row built from the format's own grid (one scale, codes spanning the range) comes back within a few tenths
    of a percent: every weight gets its code back, only the two-level scale (6- or 8-bit codes of an f16) rounds."""
    rng = np.random.default_rng(3)
    if kind == "Q6_K":
        x = rng.integers(-32, 32, 256).astype(np.float32) * 2.0 ** -6
        x[::16] = -32 * 2.0 ** -6  # every sub-block of 16 reaches the bottom code
    else:
        top = 31 if kind == "Q5_K" else 15
        x = rng.integers(0, top + 1, 256).astype(np.float32) * 2.0 ** -5
        x[::32], x[1::32] = 0.0, top * 2.0 ** -5  # every sub-block of 32 spans the whole code range
    step = 2.0 ** (-6 if kind == "Q6_K" else -5)
    assert np.abs(_roundtrip(x[None], kind)[0] - x).max() < 0.1 * step  # a wrong code would be off by a whole step


def test_bad_rows_and_kinds_are_named():
    with pytest.raises(ValueError, match="whole blocks of 256"):
        quantize_k(np.zeros((2, 384), np.float32), "Q4_K")
    with pytest.raises(ValueError, match="Q3_K: expected one of Q4_K, Q5_K, Q6_K"):
        quantize_k(np.zeros((2, 256), np.float32), "Q3_K")
