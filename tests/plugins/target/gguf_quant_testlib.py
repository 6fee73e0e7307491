"""Quantized GGUF files for tests: re-type the tensors of an F32 GGUF, and patch header bytes.

gguf quantizes only F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1; every other type is built
from random bytes to its published block layout (gguf/quants.py), with the fp16 scale
fields set to small finite values so the dequantized weights are ordinary numbers.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from helpers import spread_weights
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T


# CPU tests that run Triton kernels on CPU tensors: they need Triton's interpreter, which tests/conftest.py switches on
# only where there is no CUDA (on a CUDA machine the CUDA tests cover the same paths)
cpu_triton = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU tensors through Triton need its interpreter, off where CUDA is")

QUANTIZABLE = {T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1}
# Byte offsets of the fp16 scale fields (d, dmin) inside one block, per gguf/quants.py's dequantize_blocks.
FP16_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
               T.IQ4_NL: (0,), T.IQ4_XS: (0,)}
ALL_TYPES = [T.F32, *sorted(QUANTIZABLE, key=int), *FP16_FIELDS]


def random_blocks(qtype: T, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """uint8 bytes [rows, row_bytes] of a `shape` (numpy order) tensor in `qtype`, to the type's block layout."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    rows = int(np.prod(shape[:-1]))
    data = rng.integers(0, 256, (rows * shape[-1] // block, size), dtype=np.uint8)
    for at in FP16_FIELDS.get(qtype, ()):
        scale = (rng.uniform(2e-4, 1e-3, len(data)) * rng.choice([-1, 1], len(data))).astype(np.float16)
        data[:, at:at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return data.reshape(*shape[:-1], shape[-1] // block * size)


def encode(values: np.ndarray, qtype: T, seed: int = 0) -> np.ndarray:
    """`values` (float32, numpy order) stored as `qtype`: gguf's quantizer, or random blocks where it has none."""
    if qtype == T.F32:
        return values.astype(np.float32)
    if qtype in QUANTIZABLE:
        return gguf.quants.quantize(values.astype(np.float32), qtype)
    return random_blocks(qtype, values.shape, seed)


def retype(src: Path, dst: Path, types, reference: Path | None = None) -> dict[str, np.ndarray]:
    """Copy the F32 GGUF `src` to `dst` with each 2-D or 3-D tensor stored as `types(name)` (None: keep F32).

    With `reference`, also write an F32 file holding gguf's dequantization of every stored tensor.
    Returns name -> that dequantized float32 array (numpy order).
    """
    reader = gguf.GGUFReader(src)
    arch = reader.get_field("general.architecture").contents()
    writers = [gguf.GGUFWriter(str(p), arch) for p in (dst, reference) if p is not None]
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.alignment"):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        for w in writers:
            w.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    want = {}
    for i, t in enumerate(reader.tensors):
        values = np.asarray(t.data, dtype=np.float32)
        qtype = types(t.name) if values.ndim >= 2 else None
        stored = values if qtype is None else encode(values, qtype, seed=i)
        kind = T.F32 if qtype is None else qtype
        if kind in ALL_TYPES:  # (an unsupported type is written to test that it is refused)
            want[t.name] = values if qtype is None else gguf.quants.dequantize(stored, kind).astype(np.float32)
        writers[0].add_tensor(t.name, stored, raw_dtype=None if kind == T.F32 else kind)
        if reference is not None:
            writers[1].add_tensor(t.name, want[t.name])
    for w in writers:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return want


def set_type_id(path: Path, name: str, type_id: int) -> None:
    """Overwrite the GGML type id of tensor `name` in the header (the data bytes stay as they are)."""
    raw = bytearray(path.read_bytes())
    key = len(name).to_bytes(8, "little") + name.encode()
    at = raw.index(key) + len(key)
    n_dims = int.from_bytes(raw[at:at + 4], "little")
    at += 4 + 8 * n_dims
    raw[at:at + 4] = type_id.to_bytes(4, "little")
    path.write_bytes(bytes(raw))


def build_qwen3_256(seed: int = 0) -> transformers.Qwen3ForCausalLM:
    """A 2-layer Qwen3 whose every row is 256 wide, so each 2-D weight can take a 256-block K-quant."""
    cfg = transformers.Qwen3Config(vocab_size=320, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
                                   eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    spread_weights(model, torch.Generator().manual_seed(seed + 1))
    return model
