"""Quantizers for llama.cpp's K-quant blocks Q4_K, Q5_K and Q6_K (the `gguf` package only dequantizes them).

Each function takes float32 rows whose length is a multiple of 256 and returns the GGUF bytes,
``uint8[rows, row_bytes]``, that `gguf.quants.dequantize` (and llama.cpp) read back. The block
layouts are the published ones:

- Q4_K, 144 bytes per 256 weights: f16 ``d``, f16 ``dmin``, 12 bytes of packed 6-bit scales and
  mins for eight sub-blocks of 32, then 128 bytes of 4-bit values; ``w = d * sc * q - dmin * m``.
- Q5_K, 176 bytes: as Q4_K with a fifth bit per weight in 32 ``qh`` bytes before the low nibbles.
- Q6_K, 210 bytes: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (sub-blocks of 16),
  f16 ``d``; ``w = d * sc * (q - 32)``.

How the numbers are chosen (our method): for every sub-block a small search over candidate
scales, each followed by a weighted least-squares refit of scale (and offset) to the rounded
values, keeps the candidate with the least weighted squared error, weights ``mean|x| + |x|``
emphasising large weights. The sub-block scales are then rounded to the block's 6- or 8-bit
grid and every weight is rounded again against the scale it will actually be read with.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
_CHUNK_BLOCKS = 2048  # blocks per vectorized pass and thread (temporaries of a few MB each)


def quantize_k(rows: np.ndarray, kind: str) -> np.ndarray:
    """``rows`` (float, [..., n] with n % 256 == 0) as ``kind`` ("Q4_K", "Q5_K" or "Q6_K") blocks: uint8[..., bytes]."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"{kind}: expected one of {', '.join(BLOCK_BYTES)}")
    x = np.ascontiguousarray(rows, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % QK_K:
        raise ValueError(f"{kind} rows must be whole blocks of {QK_K} weights; got shape {x.shape}")
    blocks = x.reshape(-1, QK_K)
    out = np.empty((blocks.shape[0], BLOCK_BYTES[kind]), dtype=np.uint8)
    encode = _q6_k if kind == "Q6_K" else (lambda b: _q45_k(b, 31 if kind == "Q5_K" else 15))

    def chunk(start: int) -> None:
        out[start:start + _CHUNK_BLOCKS] = encode(blocks[start:start + _CHUNK_BLOCKS])

    starts = range(0, blocks.shape[0], _CHUNK_BLOCKS)
    if len(starts) == 1:
        chunk(0)
    else:  # numpy releases the GIL in its array loops: chunks run in parallel on every core
        with ThreadPoolExecutor(min(len(starts), os.cpu_count() or 1)) as pool:
            list(pool.map(chunk, starts))
    return out.reshape(*x.shape[:-1], x.shape[-1] // QK_K * BLOCK_BYTES[kind])


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).astype(np.float32)


def _weights(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] -> per-weight importance: the block's mean magnitude plus the weight's own."""
    mag = np.abs(blocks)
    return mag.mean(axis=1, keepdims=True) + mag + 1e-12


def _fit_affine(x: np.ndarray, w: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of x ([m, n]): (scale >= 0, offset <= 0) with x ~ scale * q + offset, q in [0, nmax]."""
    lo = np.minimum(x.min(axis=1), 0.0)
    span = x.max(axis=1) - lo
    best_err = np.full(x.shape[0], np.inf, dtype=np.float32)
    best_s, best_m = np.zeros_like(lo), lo.copy()
    flat = span <= 0
    sw = w.sum(axis=1)
    for delta in np.linspace(-1.0, 1.0, 21, dtype=np.float32):  # float32 scalars keep the arithmetic float32
        step = np.where(flat, 1.0, span / (nmax + delta))
        q = np.clip(np.rint((x - lo[:, None]) / step[:, None]), 0, nmax)
        swq, swqq = (w * q).sum(axis=1), (w * q * q).sum(axis=1)
        swx, swqx = (w * x).sum(axis=1), (w * q * x).sum(axis=1)
        det = sw * swqq - swq * swq
        ok = det > 0
        s = np.where(ok, (sw * swqx - swq * swx) / np.where(ok, det, 1.0), 0.0)
        m = np.where(ok, (swqq * swx - swq * swqx) / np.where(ok, det, 1.0), lo)
        pos = m > 0  # the format stores a non-negative min: refit the scale with offset 0
        s = np.where(pos, swqx / np.maximum(swqq, 1e-30), s)
        m = np.where(pos, 0.0, m)
        s = np.maximum(s, 0.0)
        err = (w * (s[:, None] * q + m[:, None] - x) ** 2).sum(axis=1)
        better = err < best_err
        best_err, best_s, best_m = np.where(better, err, best_err), np.where(better, s, best_s), np.where(better, m, best_m)
    return best_s, np.where(flat, lo, best_m)


def _grid(values: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """[n, k] non-negative values -> (f16 super-scale [n], integer codes [n, k] in [0, levels])."""
    d = _f16(values.max(axis=1) / levels)
    codes = np.clip(np.rint(values / np.where(d > 0, d, 1.0)[:, None]), 0, levels)
    return d, np.where(d[:, None] > 0, codes, 0).astype(np.uint8)


def _q45_k(blocks: np.ndarray, nmax: int) -> np.ndarray:
    n = blocks.shape[0]
    w = _weights(blocks)
    sub, wsub = blocks.reshape(n * 8, 32), w.reshape(n * 8, 32)
    scale, offset = _fit_affine(sub, wsub, nmax)
    d, sc = _grid(scale.reshape(n, 8), 63)
    dmin, mn = _grid(-offset.reshape(n, 8), 63)
    eff = (d[:, None] * sc).reshape(n * 8, 1)
    low = (dmin[:, None] * mn).reshape(n * 8, 1)
    q = np.clip(np.rint((sub + low) / np.where(eff > 0, eff, 1.0)), 0, nmax)
    q = np.where(eff > 0, q, 0).astype(np.uint8).reshape(n, 8, 32)
    packed = np.empty((n, 12), dtype=np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    nib = q & 15
    qs = (nib[:, 0::2] | (nib[:, 1::2] << 4)).reshape(n, 128)  # chunk c: sub-block 2c low, 2c+1 high nibbles
    head = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(n, 2),
                           dmin.astype(np.float16).view(np.uint8).reshape(n, 2), packed], axis=1)
    if nmax == 15:
        return np.concatenate([head, qs], axis=1)
    qh = np.zeros((n, 32), dtype=np.uint8)
    for k in range(8):  # bit k of qh[l]: the fifth bit of sub-block k's weight l
        qh |= ((q[:, k] >> 4) & 1) << k
    return np.concatenate([head, qh, qs], axis=1)


def _fit_symmetric(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per row of x ([m, 16]): scale s with x ~ s * q, q in [-32, 31] (the largest magnitude may take -32)."""
    idx = np.abs(x).argmax(axis=1)
    peak = np.take_along_axis(x, idx[:, None], axis=1)[:, 0]
    best_err = np.full(x.shape[0], np.inf, dtype=np.float32)
    best = np.zeros(x.shape[0], dtype=np.float32)
    for level in np.array((-32.0, -31.5, -31.0, -30.5, -30.0, -29.0, 31.0, 30.5, 30.0), dtype=np.float32):
        s = peak / level
        q = np.clip(np.rint(x / np.where(s != 0, s, 1.0)[:, None]), -32, 31)
        swqq = (w * q * q).sum(axis=1)
        s = np.where(swqq > 0, (w * q * x).sum(axis=1) / np.maximum(swqq, 1e-30), 0.0)
        err = (w * (s[:, None] * q - x) ** 2).sum(axis=1)
        better = err < best_err
        best_err, best = np.where(better, err, best_err), np.where(better, s, best)
    return best


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    w = _weights(blocks)
    sub = blocks.reshape(n * 16, 16)
    scale = _fit_symmetric(sub, w.reshape(n * 16, 16)).reshape(n, 16)
    d = _f16(np.abs(scale).max(axis=1) / 127)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1.0)[:, None]), -128, 127)
    sc = np.where(d[:, None] > 0, sc, 0).astype(np.int8)
    eff = (d[:, None] * sc.astype(np.float32)).reshape(n * 16, 1)
    q = np.clip(np.rint(sub / np.where(eff != 0, eff, 1.0)), -32, 31)
    q = (np.where(eff != 0, q, 0) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [half, group, l]: 32-weight groups
    low, high = q & 15, q >> 4
    # low nibbles: byte (half, b, l) holds group b (low) and group b + 2 (high); 2-bit highs: byte (half, l) holds
    # groups 0..3 at bits 0, 2, 4, 6
    ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(n, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.astype(np.float16).view(np.uint8).reshape(n, 2)], axis=1)
