"""GGUF weights repacked at load for wide loads and trivial dequantization (issue 20, item 2).

The file's blocks (34-byte Q8_0, 144-byte Q4_K with 6-bit packed scales, 210-byte Q6_K) are
only 2-byte aligned and mix codes with scales, so a kernel reading them as they are loads
byte by byte and decodes scales per weight. `repack` rewrites each weight row once, at load,
into one row of `row_bytes(qtype, K)` bytes (a multiple of 64, so every row starts on a
16-byte boundary and rows concatenate like the file's, for `fuse_projections`):

    [ codes: K * BITS / 8 bytes | group scales | super-block scales | zero padding ]

**Codes.** Every weight becomes an unsigned integer code c of BITS = 4 (Q4_0, Q4_1, Q4_K) or
8 bits (Q8_0, Q6_K and the 5-bit types: a byte each), stored in 16-byte *units* of GW = 128 /
BITS weights: unit u holds weights GW*u .. GW*u + GW - 1, weight GW*u + 4*j + i in bit field
j (bits BITS*j ..) of the unit's little-endian 32-bit word i. One 16-byte load gives a thread
one whole scale group (32 weights at 4 bits; 16 at 8 bits, a Q6_K group), and field j of the
four words is 4 consecutive weights, so the activations pair with it as one short vector.

**Scales.** w = s * c + o per group, with s and o formed in float32 from the stored fields:

| type | codes | group fields | super fields (per 256) | s, o | bytes/weight (file) |
|---|---|---|---|---|---|
| Q8_0 | q + 128 | d f16 per 32 | - | d, -128 d | 1.0625 (1.0625) |
| Q4_0 | q | d f16 per 32 | - | d, -8 d | 0.5625 (0.5625) |
| Q4_1 | q | d, m f16 per 32 | - | d, m | 0.625 (0.625) |
| Q5_0 | q (byte) | d f16 per 32 | - | d, -16 d | 1.0625 (0.6875) |
| Q5_1 | q (byte) | d, m f16 per 32 | - | d, m | 1.125 (0.75) |
| Q4_K | q | sc, m u8 per 32 | d, dmin f16 | d sc, -dmin m | 0.578 (0.5625) |
| Q5_K | q (byte) | sc, m u8 per 32 | d, dmin f16 | d sc, -dmin m | 1.078 (0.6875) |
| Q6_K | q + 32 (byte) | sc i8 per 16 | d f16 | d sc, -32 d sc | 1.070 (0.8203) |

**Exact.** The stored fields are the file's own (the 6-bit Q4_K/Q5_K scales unpacked to
bytes), so no scale is rounded: d * sc has at most 11 + 7 significant bits and s * c at most
24, both exact in float32, so s * c + o is gguf's `dequantize` value bit for bit (bound: 0 ulp).
The alternatives the design was weighed against, bytes per weight for Q4_K / Q6_K / Q8_0:
pre-decoded float16 s and o per group 0.625 / 1.125 (8 at 16) / 1.125, not exact (s rounded
to 11 bits: |dw| <= 2^-11 (|s c| + |o|)); float32 s and o 0.75 / 1.25 / 1.25, exact but 33% more
bytes than the file for Q4_K. Keeping d per 256 and sc, m as bytes costs 2.8% over the file at
Q4_K and its decode (two multiplies per group and row) is amortized over the 32 weights of a
thread's unit. 5- and 6-bit codes take a byte: a 4-bit plane plus a high-bit plane would keep
the file's bytes but cost 2-3 more integer instructions per weight, and the GEMV of 4-bit codes
is already instruction-bound on an H200 (~28 weights per SM-clock at 4.25 TB/s copy bandwidth
against 128 instructions issued; the one-row loop takes ~4.6 a Q4_K weight); as bytes Q6_K (1.07 B,
~15 weights per SM-clock) stays memory-bound at ~5.3 instructions a weight, where planes would
need ~7 and could reach at most ~20. A 4 + 2-bit plane layout for Q6_K is the next step if the
H200 shows its GEMV at copy bandwidth.

`repack` is torch code (it runs where the bytes are: on the GPU at load, on the CPU in tests),
in row chunks so its temporaries stay small; `unpack` is its inverse to float32 (tests,
`QuantLinear.dequantized`).
"""

from __future__ import annotations

import torch

from draftflow.layers.quant_linear import LAYOUT

# bits per code, then (weights per group of s, o), the group fields' bytes per group, super fields' bytes per 256
SPEC = {"Q8_0": (8, 32, 2, 0), "Q4_0": (4, 32, 2, 0), "Q4_1": (4, 32, 4, 0), "Q5_0": (8, 32, 2, 0),
        "Q5_1": (8, 32, 4, 0), "Q4_K": (4, 32, 2, 4), "Q5_K": (8, 32, 2, 4), "Q6_K": (8, 16, 1, 2)}
RTYPES = tuple(SPEC)  # the types `repack` covers (all of quant_linear.LAYOUT)
ALIGN = 64  # row bytes are a multiple of this: 16-byte aligned rows with room for Triton's divisibility-16 hints
_CHUNK_ROWS = 2048  # rows repacked at once (bounds the int32 temporaries to ~32 bytes a weight of a chunk)


def sections(qtype: str, k: int) -> tuple[int, int, int, int]:
    """(codes bytes, group-scale offset, super-scale offset, row bytes) of one repacked row of k weights."""
    bits, group, gbytes, sbytes = SPEC[qtype]
    codes = k * bits // 8
    soff = codes + k // group * gbytes
    end = soff + k // 256 * sbytes
    return codes, codes, soff, -(-end // ALIGN) * ALIGN


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one repacked row of k weights (k a whole number of the type's blocks)."""
    return sections(qtype, k)[3]


def bytes_per_weight(qtype: str) -> float:
    """Repacked bytes per weight, without row padding (the module docstring's table)."""
    bits, group, gbytes, sbytes = SPEC[qtype]
    return bits / 8 + gbytes / group + sbytes / 256


def _u16(b: torch.Tensor) -> torch.Tensor:  # [..., 2] uint8 -> [...] int32, little-endian
    return b[..., 0].to(torch.int32) | (b[..., 1].to(torch.int32) << 8)


def _nibbles(qs: torch.Tensor, lanes: int) -> torch.Tensor:
    # [..., groups * lanes] bytes -> [..., groups * 2 * lanes]: each run of `lanes` bytes gives its low nibbles, then
    # its high nibbles (gguf's order for Q4_0/Q4_1/Q5_x blocks (lanes 16) and the K-quants (lanes 32))
    q = qs.reshape(*qs.shape[:-1], -1, 1, lanes).to(torch.int32)
    return torch.cat([q & 15, q >> 4], dim=-2).flatten(-3)


def _k_scales(sb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Q4_K/Q5_K: the 12 packed bytes [..., 12] -> 6-bit scales and mins [..., 8] int32 (gguf's get_scale_min)
    b = sb.to(torch.int32)
    lo_sc, lo_m, hi = b[..., 0:4] & 63, b[..., 4:8] & 63, b[..., 8:12]
    hi_sc = (hi & 15) | ((b[..., 0:4] >> 6) << 4)
    hi_m = (hi >> 4) | ((b[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], -1), torch.cat([lo_m, hi_m], -1)


def _decode(blocks: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """File blocks [R, nb, BB] uint8 -> (codes [R, K] int32, group fields [R, groups, gbytes] uint8, super fields
    [R, nb, sbytes] uint8 or None)."""
    r, nb = blocks.shape[:2]
    if qtype in ("Q8_0", "Q4_0", "Q5_0"):
        gfields, body = blocks[..., 0:2], blocks[..., 2:]
    elif qtype in ("Q4_1", "Q5_1"):
        gfields, body = blocks[..., 0:4], blocks[..., 4:]
    if qtype == "Q8_0":
        codes = body.to(torch.int32) ^ 128  # int8 q -> q + 128
    elif qtype in ("Q4_0", "Q4_1"):
        codes = _nibbles(body, 16)
    elif qtype in ("Q5_0", "Q5_1"):
        bits = torch.arange(32, device=blocks.device)
        qh = (body[..., 0:4].to(torch.int64) << (8 * torch.arange(4, device=blocks.device))).sum(-1, keepdim=True)
        codes = _nibbles(body[..., 4:], 16) | (((qh >> bits) & 1).to(torch.int32) << 4)
    elif qtype in ("Q4_K", "Q5_K"):
        sc, mn = _k_scales(blocks[..., 4:16])
        gfields = torch.stack([sc, mn], -1).to(torch.uint8)  # [R, nb, 8, 2]
        if qtype == "Q4_K":
            codes = _nibbles(blocks[..., 16:144], 32)
        else:
            shifts = torch.arange(8, device=blocks.device)[:, None]
            hb = (blocks[..., 16:48].to(torch.int32)[..., None, :] >> shifts) & 1
            codes = _nibbles(blocks[..., 48:176], 32) | (hb.flatten(-2) << 4)
        return codes.reshape(r, -1), gfields.reshape(r, -1, 2), blocks[..., 0:4]
    elif qtype == "Q6_K":
        ql = blocks[..., 0:128].reshape(r, nb, 2, 1, 64).to(torch.int32)
        lo = torch.cat([ql & 15, ql >> 4], dim=-2).reshape(r, nb, 256)  # weight 128 h + 64 s + b: byte 64 h + b
        qh = blocks[..., 128:192].reshape(r, nb, 2, 1, 32).to(torch.int32)
        hi = (qh >> (2 * torch.arange(4, device=blocks.device)).view(4, 1)) & 3  # weight 128 h + 32 s + l
        codes = lo | (hi.reshape(r, nb, 256) << 4)  # q + 32
        return codes.reshape(r, -1), blocks[..., 192:208].reshape(r, -1, 1), blocks[..., 208:210]
    else:
        raise ValueError(f"no repacked layout for {qtype}; expected one of {', '.join(RTYPES)}")
    return codes.reshape(r, -1), gfields.reshape(r, nb, -1), None


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    # [R, K] int32 codes -> [R, K * bits / 8] uint8 in 16-byte units (weight GW u + 4 j + i in field j of word i)
    r, k = codes.shape
    fields = 32 // bits
    c = codes.reshape(r, k // (4 * fields), fields, 4)  # [R, unit, j, i]
    if bits == 8:
        return c.transpose(-1, -2).to(torch.uint8).reshape(r, -1)  # byte j of word i
    lo, hi = c[:, :, 0::2], c[:, :, 1::2]  # fields 2b and 2b + 1 share byte b of the word
    return (lo | (hi << 4)).transpose(-1, -2).to(torch.uint8).reshape(r, -1)


def repack(blocks: torch.Tensor, qtype: str, k: int) -> torch.Tensor:  # [N, row_bytes(qtype, k)] uint8
    """The file's bytes [N, k / block * block bytes] uint8 of a [N, k] weight, repacked (same device)."""
    block, size = LAYOUT[qtype]
    if qtype not in SPEC or k % block or blocks.shape[-1] != k // block * size or blocks.dtype != torch.uint8:
        raise ValueError(f"{qtype} weight bytes {tuple(blocks.shape)} ({blocks.dtype}) are not rows of {k} weights")
    bits = SPEC[qtype][0]
    codes_b, goff, soff, rb = sections(qtype, k)
    n = blocks.shape[0]
    out = torch.zeros(n, rb, dtype=torch.uint8, device=blocks.device)
    for a in range(0, n, _CHUNK_ROWS):
        chunk = blocks[a:a + _CHUNK_ROWS].reshape(-1, k // block, size)
        codes, gfields, sfields = _decode(chunk, qtype)
        rows = out[a:a + chunk.shape[0]]
        rows[:, :codes_b] = _pack_codes(codes, bits)
        rows[:, goff:soff] = gfields.reshape(chunk.shape[0], -1)
        if sfields is not None:
            rows[:, soff:soff + sfields.numel() // chunk.shape[0]] = sfields.reshape(chunk.shape[0], -1)
    return out


def _f16(b: torch.Tensor) -> torch.Tensor:  # [..., 2] uint8 -> [...] float32 (a little-endian float16)
    return _u16(b).to(torch.int16).view(torch.float16).float()


def group_scales(packed: torch.Tensor, qtype: str, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, o) [N, k / group] float32 of repacked rows, as the kernels form them."""
    bits, group, gbytes, sbytes = SPEC[qtype]
    n = packed.shape[0]
    _, goff, soff, _ = sections(qtype, k)
    g = packed[:, goff:soff].reshape(n, k // group, gbytes)
    if qtype in ("Q8_0", "Q4_0", "Q5_0"):
        s = _f16(g)
        return s, -{"Q8_0": 128.0, "Q4_0": 8.0, "Q5_0": 16.0}[qtype] * s
    if qtype in ("Q4_1", "Q5_1"):
        return _f16(g[..., 0:2]), _f16(g[..., 2:4])
    sup = packed[:, soff:soff + k // 256 * sbytes].reshape(n, k // 256, sbytes)
    per = 256 // group  # groups per super-block
    if qtype == "Q6_K":
        s = _f16(sup).repeat_interleave(per, 1) * (g[..., 0].view(torch.int8).float())
        return s, -32.0 * s
    d, dmin = _f16(sup[..., 0:2]).repeat_interleave(per, 1), _f16(sup[..., 2:4]).repeat_interleave(per, 1)
    return d * g[..., 0].float(), -(dmin * g[..., 1].float())


def unpack(packed: torch.Tensor, qtype: str, k: int) -> torch.Tensor:  # [N, k] float32
    """The weight of repacked rows: s * c + o per weight (equal to gguf's dequantization bit for bit)."""
    bits, group = SPEC[qtype][:2]
    n = packed.shape[0]
    fields = 32 // bits
    raw = packed[:, :k * bits // 8].reshape(n, -1, 4, 4).to(torch.int32)  # [N, unit, word i, byte]
    if bits == 8:
        c = raw.transpose(-1, -2)  # [N, unit, j, i]
    else:
        c = torch.stack([raw & 15, raw >> 4], -1).flatten(-2).transpose(-1, -2)  # field 2b + h = nibble h of byte b
    c = c.reshape(n, -1, fields * 4).reshape(n, k).float()
    s, o = group_scales(packed, qtype, k)
    return c * s.repeat_interleave(group, 1) + o.repeat_interleave(group, 1)
