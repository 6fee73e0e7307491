"""GGUF tensor types: which ones draftflow reads, the checks on their bytes, dequantization at load.

Every type is turned into the graph's dtype when the file is loaded, on the CPU, block
for block as `gguf.quants.dequantize` does (it *is* that function, called on row chunks
in a few threads; float32, then cast). Q8_0 is the exception: its one multiply runs on the
target device, so only the compact bytes cross the bus (equal to gguf's result too). On
CUDA the attention and dense-MLP projections of the types the Triton kernels cover stay in
their blocks instead (quant_linear.py, `kept`); everything else is held dequantized and the
VRAM plan counts each tensor as the device holds it. On the CPU torch has no quantized GEMM
that we use, so every weight is dequantized.

A GGUF tensor's byte size is implied by its type and dims; llama.cpp requires the data of
tensor i+1 to start where tensor i's (aligned) bytes end. `check_layout` applies that rule,
so a mislabelled type, a short file or rows that are not whole blocks are refused with one
line naming the tensor before any byte is dequantized.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from importlib.metadata import version
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable

import attrs
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from draftflow.core.budget import fmt_bytes
from draftflow.core.errors import ModelFormatError
from draftflow.layers.quant_experts import covered
from draftflow.layers.quant_linear import LAYOUT, kept

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
FLOAT_TYPES = ("F32", "F16", "BF16")
_REQUANTIZE = "re-quantize the model to one of those (llama.cpp's llama-quantize, e.g. Q4_K_M)"
_CHUNK_WEIGHTS = 1 << 22  # weights per dequantization task: bounds the float32 temporaries (16 MiB)
_PROGRESS_MIN_WEIGHTS = 64 << 20


@attrs.frozen
class TensorInfo:
    """One tensor-info record of a GGUF header: what the reader builds its view from."""

    name: str
    type_id: int
    ne: tuple[int, ...]  # GGUF dim order: ne[0] is the row (the last torch dim)
    offset: int  # absolute byte offset of the data in the file

    @classmethod
    def from_field(cls, field: Any, data_start: int) -> TensorInfo:
        """From gguf's tensor-info ReaderField (parts: name length, name, n_dims, dims, type, offset)."""
        _, name, _, dims, raw_type, offset = field.parts
        return cls(bytes(name).decode("utf-8", "replace"), int(raw_type[0]), tuple(int(d) for d in dims),
                   data_start + int(offset[0]))

    @property
    def numel(self) -> int:
        return int(np.prod(self.ne, dtype=np.int64)) if self.ne else 1


def gguf_version() -> str:
    try:
        return "gguf " + version("gguf")
    except Exception:  # noqa: BLE001 - a source checkout without metadata
        return "gguf"


def type_name(type_id: int) -> str:
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type id {type_id}"


def _shape(info: TensorInfo) -> str:
    return "[" + ", ".join(str(d) for d in reversed(info.ne)) + "]"  # torch order, as the other messages print


def check_layout(infos: list[TensorInfo], data_start: int, alignment: int, file_size: int, source: str) -> None:
    """Raise a one-line ModelFormatError for the first tensor whose type, rows or bytes are wrong."""
    expect = 0  # relative offset the next tensor must start at
    prev: tuple[TensorInfo, int] | None = None
    for info in infos:
        kind = type_name(info.type_id)
        if kind not in SUPPORTED_TYPES:
            raise ModelFormatError(f"{source}: tensor {info.name!r} has type {kind}, which draftflow does not read; "
                                   f"expected one of {', '.join(SUPPORTED_TYPES)}; {_REQUANTIZE}")
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(info.type_id)]
        row = info.ne[0] if info.ne else 1
        if row % block:
            raise ModelFormatError(
                f"{source}: tensor {info.name!r} ({kind}, shape {_shape(info)}) has rows of {row} weights, not a "
                f"multiple of the {kind} block of {block}; expected whole blocks per row; the file is corrupt, "
                "re-convert or re-quantize it")
        nbytes = info.numel // block * size
        rel = info.offset - data_start
        if rel != expect:
            if prev is None:
                what = f"tensor {info.name!r} starts at byte {rel} of the data section, expected 0"
            else:
                p, p_bytes = prev
                pk = type_name(p.type_id)
                pb, ps = GGML_QUANT_SIZES[GGMLQuantizationType(p.type_id)]
                what = (f"tensor {p.name!r} ({pk}, shape {_shape(p)}: {p_bytes} bytes at {ps} bytes per {pb} weights) "
                        f"is followed by {info.name!r} at data byte {rel}, expected {expect}: its bytes do not match "
                        f"the {pk} block size")
            raise ModelFormatError(f"{source}: {what}; the header is corrupt or the type mislabelled; "
                                   "re-convert or re-download the file")
        if info.offset + nbytes > file_size:
            raise ModelFormatError(
                f"{source}: tensor {info.name!r} ({kind}, shape {_shape(info)}) needs bytes {info.offset}.."
                f"{info.offset + nbytes} but the file ends at byte {file_size}; the file is truncated or corrupt, "
                "re-download or re-convert it")
        prev, expect = (info, nbytes), rel + nbytes + (-nbytes % alignment)


def dequantize(t: Any, shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype,
               progress: DequantProgress | None = None) -> torch.Tensor:
    """A gguf ReaderTensor -> torch tensor of `shape` (torch order) in `dtype` on `device`."""
    kind = GGMLQuantizationType(t.tensor_type)
    data = np.ascontiguousarray(t.data)
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        out = torch.from_numpy(data).to(device).reshape(shape).to(dtype)
    elif kind == GGMLQuantizationType.BF16:  # bytes [..., 2n] -> bf16 [..., n]
        out = torch.from_numpy(data).to(device).view(torch.bfloat16).reshape(shape).to(dtype)
    elif kind == GGMLQuantizationType.Q8_0:  # one multiply: do it on the device, so only the bytes cross the bus
        block, size = GGML_QUANT_SIZES[kind]
        blocks = torch.from_numpy(data).to(device).reshape(-1, size)  # [n_blocks, 34]
        scale = blocks[:, :2].contiguous().view(torch.float16).float()  # [n_blocks, 1]
        quants = blocks[:, 2:].contiguous().view(torch.int8).float()  # [n_blocks, 32]
        out = (quants * scale).reshape(shape).to(dtype)
    else:
        out = _dequantize_rows(data, kind, shape, dtype).to(device)
    if progress is not None:
        progress.update(out.numel())
    return out


def _dequantize_rows(data: np.ndarray, kind: GGMLQuantizationType, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """gguf's numpy dequantizer over chunks of whole rows, in threads (numpy releases the GIL), into `dtype`."""
    rows = data.reshape(-1, data.shape[-1])  # [n_rows, bytes per row]
    row_len = shape[-1] if shape else 1
    out = torch.empty(rows.shape[0], row_len, dtype=dtype)  # [n_rows, row_len]
    step = max(1, _CHUNK_WEIGHTS // max(row_len, 1))

    def one(start: int) -> None:
        try:
            chunk = gguf_dequantize(rows[start:start + step], kind)  # float32 [n, row_len]
        except NotImplementedError as exc:  # a gguf package older than its K-quant / IQ4 dequantizers
            raise ModelFormatError(f"the installed gguf package ({gguf_version()}) cannot dequantize {kind.name}; "
                                   "expected gguf >= 0.10 with numpy dequantizers; pip install -U gguf") from exc
        out[start:start + step] = torch.from_numpy(np.ascontiguousarray(chunk, dtype=np.float32)).to(dtype)

    starts = range(0, rows.shape[0], step)
    if len(starts) == 1:
        one(0)
    else:
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            list(pool.map(one, starts))
    return out.reshape(shape)


class DequantProgress:
    """A one-line stderr progress bar over the weights dequantized at load, shown only for big loads on a terminal."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done = max(total, 1), label, 0
        self.enabled = total > _PROGRESS_MIN_WEIGHTS and sys.stderr.isatty()

    def update(self, n: int) -> None:
        self.done += n
        if self.enabled:
            frac = min(1.0, self.done / self.total)
            sys.stderr.write(f"\r{self.label} [{'#' * int(30 * frac):<30}] {100 * frac:5.1f}%")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def dequantized_cost(tensors: Iterable[Any], dtype: torch.dtype, source: str, why: str) -> str | None:
    """The GPU load's warning: quantized types, bytes in the file vs on the device, `why` (None for no quantized tensor)."""
    quantized = [t for t in tensors if type_name(t.tensor_type) not in FLOAT_TYPES]
    if not quantized:
        return None
    kinds = ", ".join(sorted({type_name(t.tensor_type) for t in quantized}))
    in_file = sum(int(t.n_bytes) for t in quantized)
    on_device = sum(int(t.n_elements) for t in quantized) * dtype.itemsize
    return (f"{source}: {kinds} weights are dequantized at load: {fmt_bytes(in_file)} in the file take "
            f"{fmt_bytes(on_device)} of {str(dtype).removeprefix('torch.')} on the GPU; {why}")


def float_experts_warning(merged: list[Any], dtype: torch.dtype, source: str) -> str:
    """The line a `quantized` load logs when its merged experts must be dequantized to the host after all."""
    kinds = ", ".join(sorted({type_name(t.tensor_type) for t in merged} - set(LAYOUT)))
    host = sum(int(t.n_elements) for t in merged) * dtype.itemsize
    return (f"{source}: routed experts of type {kinds} are dequantized at load: "
            f"{fmt_bytes(sum(int(t.n_bytes) for t in merged))} in the file take {fmt_bytes(host)} of "
            f"{str(dtype).removeprefix('torch.')} in host memory; the expert cache keeps only {', '.join(LAYOUT)} "
            "experts quantized; re-quantize to one of those (e.g. Q4_K_M)")


def tensor_group(name: str, ne: tuple[int, ...]) -> str:
    """Which part of the model a llama.cpp tensor belongs to, for the per-group type counts of `draftflow check`."""
    if name.startswith(("token_embd.", "output.")):
        return "embeddings"
    if len(ne) <= 1:
        return "norms+biases"
    parts = name.split(".")
    if "_exps." in name or (len(parts) > 4 and parts[3].isdigit()):  # merged, or one expert (blk.N.ffn_up.J.weight)
        return "experts"
    if ".ffn_gate_inp" in name:
        return "router"
    if ".attn_" in name or ".ssm_" in name:
        return "attention"
    return "mlp" if ".ffn_" in name else "other"


def type_counts(items: Iterable[str]) -> str:
    """`Q4_K x 120, Q6_K x 25` (most common first)."""
    return ", ".join(f"{k} x {n}" for k, n in Counter(items).most_common())


def kept_experts(infos: list[TensorInfo]) -> list[TensorInfo]:
    """The merged routed-expert tensors when a `quantized` load keeps them in their blocks on the host (every one of
    a type the dequantizer reads: quant_experts.covered); [] otherwise."""
    exps = [i for i in infos if "_exps." in i.name]
    return exps if covered([type_name(i.type_id) for i in exps]) else []


def file_bytes(i: TensorInfo) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(i.type_id)]
    return i.numel // block * size


def quantization_lines(infos: list[TensorInfo], dtype: torch.dtype, source: str, keep: bool = False) -> list[str]:
    """What `draftflow check` prints about a GGUF target's weights: types per group, bytes in the file and on the device.

    `keep`: the target keeps its covered projections quantized (CUDA, quant_linear.keeps_quantized)."""
    infos = [i for i in infos if i.name != "rope_freqs.weight"]  # consumed by the config
    in_file = sum(map(file_bytes, infos))
    stay = [i for i in infos if keep and kept(i.name, type_name(i.type_id))]
    held = _repacked_bytes if _repacks() else file_bytes
    device_bytes = sum(map(held, stay)) + (sum(i.numel for i in infos) - sum(i.numel for i in stay)) * dtype.itemsize
    groups: dict[str, list[str]] = {}
    for i in infos:
        groups.setdefault(tensor_group(i.name, i.ne), []).append(type_name(i.type_id))
    quantized = any(type_name(i.type_id) not in FLOAT_TYPES for i in infos)
    how = "dequantized" if quantized else "converted"
    to = f"{how} to {str(dtype).removeprefix('torch.')} at load"
    if stay:
        kinds = ", ".join(sorted({type_name(i.type_id) for i in stay}))
        how = ", repacked" if _repacks() else ""
        to = f"{kinds} projections stay quantized on the GPU ({fmt_bytes(sum(map(held, stay)))}{how}), the rest {to}"
    if keep and (exps := kept_experts(infos)):  # merged routed experts (host-resident, the expert cache's)
        to += (f"; routed experts stay quantized on the host ({fmt_bytes(sum(map(file_bytes, exps)))}, "
               "dequantized on the device per upload)")
    lines = [f"weights of {source}: {fmt_bytes(in_file)} in the file, {to}: {fmt_bytes(device_bytes)} on the device "
             "(what the VRAM plan counts)"]
    order = ("embeddings", "attention", "mlp", "experts", "router", "norms+biases", "other")
    lines += [f"  {g}: {type_counts(groups[g])}" for g in order if g in groups]
    return lines


def header_infos(path: str) -> list[TensorInfo] | None:
    """The tensor records of a GGUF file's header (memory-mapped, no weight read); None for anything else."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return None
        reader = GGUFReader(path)
    except Exception:  # noqa: BLE001 - the target's own checks report unreadable files
        return None
    return [TensorInfo(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.data_offset))
            for t in reader.tensors]


def kept_savings(path: str, dtype: torch.dtype, repacked: bool | None = None) -> int:
    """Bytes the projections kept quantized on the GPU save against holding them in `dtype` (the VRAM plan's weights):
    at their file bytes, or at quant_repack's row bytes when they are repacked (None: quant_linear.REPACK)."""
    infos = header_infos(path) or []
    repacked = _repacks() if repacked is None else repacked
    return sum(i.numel * dtype.itemsize - (_repacked_bytes(i) if repacked else file_bytes(i))
               for i in infos if kept(i.name, type_name(i.type_id)))


def _repacks() -> bool:
    from draftflow.layers import quant_linear

    return quant_linear.REPACK


def _repacked_bytes(i: TensorInfo) -> int:
    from draftflow.layers.quant_repack import row_bytes

    return i.numel // i.ne[0] * row_bytes(type_name(i.type_id), i.ne[0])


def weight_lines(path: str, dtype: torch.dtype, keep: bool = False) -> list[str]:
    """`quantization_lines` of a GGUF file, for `draftflow check`; [] for anything else (a directory, unreadable bytes)."""
    infos = header_infos(path)
    return [] if infos is None else quantization_lines(infos, dtype, os.path.basename(path), keep)
