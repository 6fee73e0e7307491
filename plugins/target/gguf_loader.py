"""Load a llama.cpp GGUF file (qwen3, llama, qwen2) into a TargetModel.

GGUF stores dims reversed (ne[0] is the last torch dim); the reader already hands back
numpy-ordered views, so only the *reported* shape needs reversing. llama.cpp's converter
permutes llama's attn_q / attn_k rows into its interleaved RoPE layout; we undo that so
the model keeps the HF half-split layout. Every supported type (layers/gguf_quants.py:
F32/F16/BF16, Q8_0, Q4_0..Q5_1, Q2_K..Q6_K, IQ4_NL/IQ4_XS, so Q4_K_M-style mixes) is
dequantized at load to the graph's dtype, except on CUDA, where the attention and dense-MLP
projections of the types the Triton kernels read (quant_linear.QTYPES) stay in their blocks
as `QuantLinear` layers; the header's types and byte spans are checked before any tensor
view is built.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import structlog
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from draftflow.layers.config import RopeScaling, TargetConfig, expected_tensors
from draftflow.plugin import ModelFormatError
from draftflow.plugins.target.hf_loader import LoadedTarget, check_tensors
from draftflow.plugins.target.model import TargetModel
from draftflow.layers.moe import HostExperts, host_block, is_expert_tensor
from draftflow.layers.gguf_names import GGUF_ARCHS, gguf_moe_fields, hf_to_gguf_name, merged_views
from draftflow.layers.tensor_parallel import SINGLE, TPGroup, shard_of, take
from draftflow.layers.gguf_quants import (FLOAT_TYPES, DequantProgress, TensorInfo, check_layout, dequantize,
                                          dequantized_cost, float_experts_warning, type_name)
from draftflow.layers import quant_linear
from draftflow.layers.quant_experts import QuantHostExperts, covered
from draftflow.layers.quant_linear import LAYOUT, PROJECTION, kept, repack_all, swap_in

SUPPORTED_GGUF_ARCHS = ("qwen3", "llama", "qwen2", "qwen3moe")
log = structlog.get_logger("draftflow")

# Pre-tokenizer regexes for llama.cpp `tokenizer.ggml.pre` names we can rebuild exactly.
PRE_TOKENIZER_REGEX = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4


def llama_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF half-split rows -> llama.cpp interleaved rows, per head (what llama.cpp's converter does)."""
    # w: [n_heads * head_dim, ...] (weight or bias)
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `llama_permute`."""
    # w: [n_heads * head_dim, ...]
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf_config(path: str | os.PathLike[str]) -> TargetConfig:
    """Parse a GGUF file's metadata (memory-mapped; no tensor data is read)."""
    return _config(_open(path), str(path))


def load_gguf(path: str | os.PathLike[str], device: torch.device | str, dtype: torch.dtype, tp: TPGroup = SINGLE,
              quantized: bool | None = None, repacked: bool | None = None) -> LoadedTarget:
    """Load config, weights (any of gguf_quants.SUPPORTED_TYPES, dequantized to `dtype`) and the embedded tokenizer.

    `quantized` (None: on CUDA): keep the covered projections in their GGUF blocks (`QuantLinear`,
    Triton kernels; on the CPU only under TRITON_INTERPRET, for tests); False: dequantize every
    weight at load. Kept, a MoE's merged experts of covered types also stay in their blocks, on the host
    (quant_experts.QuantHostExperts: the expert cache dequantizes each upload on the device). One rank
    only: a tensor-parallel target dequantizes at load. `repacked` (None:
    quant_linear.REPACK): kept projections are rewritten once into quant_repack's layout for its kernels.

    With a tensor-parallel group `tp` a rank reads and dequantizes only its rows of a column-parallel
    tensor, and only its columns of a row-parallel one when they fall on quantization-block
    boundaries (`rank_view`); otherwise (unaligned columns, merged experts) the tensor is dequantized
    whole on the host and sliced there. Only the rank's shard reaches the device.
    """
    source = str(path)
    reader = _open(path)
    cfg = _config(reader, source)
    to_hf = {hf_to_gguf_name(n): n for n in expected_tensors(cfg)}
    if cfg.tie_word_embeddings:
        to_hf["output.weight"] = "lm_head.weight"
    found, names, tensors = {}, {}, {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # consumed by the config (llama3 RoPE factors)
            continue
        hf = to_hf.get(t.name, t.name)
        found[hf] = tuple(int(d) for d in reversed(t.shape))  # ne order -> torch order
        names[hf] = t.name
        tensors[hf] = t
    views = merged_views(found)  # llama.cpp's merged experts -> per-expert entries
    for hf, (merged, j) in views.items():
        found[hf], names[hf], tensors[hf] = found[merged][1:], f"{merged}[{j}]", (tensors[merged], found[merged], j)
    for merged in {m for m, _ in views.values()}:
        del found[merged]
    check_tensors(found, cfg, source, names={**{hf: g for g, hf in to_hf.items()}, **names})

    model = TargetModel(cfg, dtype=dtype, device="meta", tp=tp)
    local = expected_tensors(model.config)  # this rank's shapes (tensor_parallel.py)
    keep = (torch.device(device).type == "cuda" if quantized is None else quantized) and tp.size == 1
    stay = {hf: type_name(t.tensor_type) for hf, t in tensors.items()
            if keep and type(t) is not tuple and kept(names[hf], type_name(t.tensor_type))}  # hf name -> GGUF type
    merged = {m: tensors[m] for m, _ in views.values()}  # GGUF name -> merged expert tensor
    # `quantized`: merged experts of covered types stay in their blocks on the host (quant_experts.py)
    quant_experts = keep and covered([type_name(t.tensor_type) for t in merged.values()])
    every = {id(t): t for t in (v[0] if type(v) is tuple else v for v in tensors.values())}
    stayed = {id(tensors[hf]) for hf in stay} | ({id(t) for t in merged.values()} if quant_experts else set())
    loaded = {k: t for k, t in every.items() if k not in stayed}  # dequantized here
    progress = DequantProgress(sum(int(t.n_elements) for t in loaded.values() if type_name(t.tensor_type) not in FLOAT_TYPES),
                               f"dequantizing {os.path.basename(source)} to {str(dtype).removeprefix('torch.')}")
    state, last = {}, (None, None)
    for hf, full in expected_tensors(cfg).items():
        if hf not in local:  # o_proj's bias: rank 0 adds it
            continue
        if quant_experts and is_expert_tensor(hf):  # kept as the merged tensors' blocks, below
            continue
        if hf in stay:  # the file's bytes, [out_features, row bytes] uint8: rows are whole blocks
            blocks = torch.from_numpy(np.ascontiguousarray(tensors[hf].data)).to(device)
            if cfg.arch == "llama" and (".self_attn.q_proj." in hf or ".self_attn.k_proj." in hf):
                blocks = llama_unpermute(blocks, blocks.shape[0] // cfg.head_dim)  # permutes whole rows
            state[hf.removeprefix("model.").removesuffix("weight") + "blocks"] = blocks
            continue
        pieces = shard_of(hf, full, local[hf], cfg, tp.rank, tp.size)
        view = rank_view(tensors[hf], found[hf], pieces) if pieces and type(tensors[hf]) is not tuple else None
        where = "cpu" if is_expert_tensor(hf) or (pieces and view is None) else device  # MoE experts stay on the host
        if view is not None:  # only this rank's rows (or block-aligned columns) are read and dequantized
            w, pieces = dequantize(view, local[hf], where, dtype, _counted(tensors[hf], progress)), []
        elif type(tensors[hf]) is tuple:  # one expert of a merged tensor (ReaderTensor is a NamedTuple)
            t, shape, j = tensors[hf]
            if last[0] is not t:
                last = (t, dequantize(t, shape, where, dtype, _counted(t, progress)))
            w = last[1][j]
        else:
            w = dequantize(tensors[hf], found[hf], where, dtype, _counted(tensors[hf], progress))
        if cfg.arch == "llama" and (".self_attn.q_proj." in hf or ".self_attn.k_proj." in hf):
            w = llama_unpermute(w, w.shape[0] // cfg.head_dim)  # per head: whole heads, or a rank's whole heads
        if pieces:
            w = take(w, pieces).to("cpu" if is_expert_tensor(hf) else device)
        state[hf.removeprefix("model.")] = w
    progress.close()
    pin = torch.device(device).type == "cuda"
    if cfg.moe_layers and quant_experts:
        model.host_experts = _quant_host_experts(merged, cfg, dtype, pin)
    elif cfg.moe_layers:
        model.host_experts = HostExperts.pop_from_state(state, model.config, pin=pin)
    for hf, qtype in stay.items():
        swap_in(model, hf.removeprefix("model.").removesuffix(".weight"), qtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device)
    if stay and (quant_linear.REPACK if repacked is None else repacked):
        repack_all(model)
    if torch.device(device).type == "cuda":
        kept_quantized = [tensors[hf] for hf in stay] + (list(merged.values()) if quant_experts else [])
        _warn_dequantized(every.values(), kept_quantized, dtype, source, keep, tp.size)
        if keep and merged and not quant_experts:  # asked to keep them, and cannot: say what it costs, never silently
            log.warning(float_experts_warning(list(merged.values()), dtype, source))
    eos = tuple(
        v for k in ("eos_token_id", "eot_token_id", "eom_token_id")
        if (v := _value(reader, f"tokenizer.ggml.{k}")) is not None
    )
    return LoadedTarget(model, cfg, gguf_tokenizer(reader), tuple(dict.fromkeys(eos)), source)


def _quant_host_experts(merged: dict[str, Any], cfg: TargetConfig, dtype: torch.dtype, pin: bool) -> QuantHostExperts:
    """The merged `blk.N.ffn_{gate,up,down}_exps` tensors' bytes per MoE layer, [E, rows, row bytes] uint8 (pinned
    for uploads to CUDA; a copy, so the file can close)."""
    tensors = [merged[f"blk.{layer}.ffn_{kind}_exps.weight"] for layer in cfg.moe_layers for kind in ("gate", "up", "down")]
    data = [np.asarray(t.data) for t in tensors]
    data = [d.reshape(cfg.num_experts, -1, d.shape[-1]) for d in data]  # [E, rows, row bytes]
    stacks = host_block([(d.shape, torch.uint8) for d in data], pin)  # one (pinned) allocation for every layer
    for stack, d in zip(stacks, data):
        stack.copy_(torch.from_numpy(d))
    types = [type_name(t.tensor_type) for t in tensors]
    return QuantHostExperts(tuple(cfg.moe_layers), stacks[0::3], stacks[1::3], stacks[2::3],
                            [tuple(types[k:k + 3]) for k in range(0, len(types), 3)], cfg.hidden_size,
                            cfg.moe_intermediate_size, dtype)


def rank_view(t: Any, shape: tuple[int, ...], pieces: list[tuple[int, int, int]]) -> Any | None:
    """Tensor `t` (torch `shape`) narrowed to one rank's `pieces` without reading the rest: its rows (a row of a
    quantized tensor is whole blocks), or its columns when they start and end on block boundaries. None when the
    split needs the whole tensor (several pieces, unaligned columns)."""
    if len(pieces) != 1 or not 1 <= len(shape) <= 2:
        return None
    dim, a, b = pieces[0]
    data = t.data  # numpy, torch order: [rows, elements or bytes per row]
    if dim == 0:
        return SimpleNamespace(tensor_type=t.tensor_type, data=data[a:b])
    block = GGML_QUANT_SIZES[GGMLQuantizationType(t.tensor_type)][0]
    if a % block or b % block:
        return None
    per = data.shape[-1] // (shape[1] // block)  # numpy items per block of the row
    return SimpleNamespace(tensor_type=t.tensor_type, data=data[:, a // block * per:b // block * per])


def _counted(t: Any, progress: DequantProgress) -> DequantProgress | None:
    """The progress bar counts dequantized weights only (float tensors are a copy)."""
    return None if type_name(t.tensor_type) in FLOAT_TYPES else progress


def _warn_dequantized(tensors, stay, dtype: torch.dtype, source: str, keep: bool = True, tp_size: int = 1) -> None:
    """One line when a GPU load dequantizes projections it could keep quantized: what that costs, and why.

    `stay`: the tensors kept quantized. The embedding and LM head are always dequantized (drafters
    read them as float; docs/GGUF.md), so they are not warned about while the projections stay."""
    covered = ", ".join(LAYOUT)
    if keep:
        stayed = {id(t) for t in stay}
        tensors = [t for t in tensors if PROJECTION.match(t.name) and id(t) not in stayed]
        why = f"the GPU kernels keep only {covered} quantized; re-quantize to one of those (e.g. Q4_K_M)"
    elif tp_size > 1:
        why = "a tensor-parallel target dequantizes at load (the kernels run on one rank)"
    else:
        why = (f"the target's `quantized: false` (the default, faster today) asks for that; true keeps {covered} "
               "projections quantized")
    text = dequantized_cost(tensors, dtype, source, why)
    if text is not None:  # the default's cost is information; a load that could not keep what it was asked to warns
        (log.warning if keep or tp_size > 1 else log.info)(text)


class _CheckedReader(GGUFReader):
    """A GGUFReader that checks every tensor's type and byte span (gguf_quants.check_layout) before building views."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.source = str(path)
        # 'c' (copy-on-write) gives writable views, so torch.from_numpy shares memory without warnings.
        super().__init__(path, "c")

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        self.infos = [TensorInfo.from_field(f, start_offs) for f in fields]
        check_layout(self.infos, start_offs, int(self.alignment), len(self.data), self.source)
        super()._build_tensors(start_offs, fields)


def _open(path: str | os.PathLike[str]) -> _CheckedReader:
    if not os.path.exists(path):
        raise ModelFormatError(f"{path}: file is missing; expected a GGUF file; check the path")
    try:
        return _CheckedReader(path)
    except ModelFormatError:
        raise
    except Exception as exc:  # noqa: BLE001 - the reader raises ValueError, IndexError, ... on bad bytes
        raise ModelFormatError(
            f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc}); expected a complete GGUF v3 file; "
            "it is truncated or corrupt, re-download or re-convert it"
        ) from exc


def _value(reader: GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _config(reader: GGUFReader, source: str) -> TargetConfig:
    arch = _value(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ModelFormatError(
            f"{source}: general.architecture is {arch!r}; expected one of {', '.join(SUPPORTED_GGUF_ARCHS)}; "
            "this runtime cannot run that architecture"
        )

    def need(key: str) -> Any:
        value = _value(reader, f"{arch}.{key}")
        if value is None:
            raise ModelFormatError(f"{source}: metadata key '{arch}.{key}' is missing; expected it; re-convert the model")
        return value

    tensors = {t.name: t for t in reader.tensors}
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    if "token_embd.weight" not in tensors:
        raise ModelFormatError(f"{source}: tensor 'token_embd.weight' is missing; expected it; re-convert the model")
    vocab = int(tensors["token_embd.weight"].shape[-1])  # ne = {hidden, vocab}
    scaling_type = _value(reader, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        raise ModelFormatError(
            f"{source}: '{arch}.rope.scaling.type' is {scaling_type!r}; expected none (llama3 scaling comes as "
            "rope_freqs.weight); this RoPE scaling is not supported"
        )
    rope = None
    if "rope_freqs.weight" in tensors:
        factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float32)
        rope = RopeScaling(rope_type="freq_factors", freq_factors=tuple(float(f) for f in factors))
    has_bias = "blk.0.attn_q.bias" in tensors
    eos = _value(reader, "tokenizer.ggml.eos_token_id")
    layers = int(need("block_count"))
    moe = gguf_moe_fields(lambda k: _value(reader, k), tensors, arch, layers, source) if arch in GGUF_ARCHS else {}
    return TargetConfig(
        arch=GGUF_ARCHS.get(arch, arch),
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(_value(reader, f"{arch}.attention.head_count_kv") or heads),
        head_dim=int(_value(reader, f"{arch}.attention.key_length") or hidden // heads),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_value(reader, f"{arch}.rope.freq_base") or 10000.0),
        rope_scaling=rope,
        max_position_embeddings=int(_value(reader, f"{arch}.context_length") or 2048),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=True if arch == "qwen2" else has_bias,
        o_bias="blk.0.attn_output.bias" in tensors,
        qk_norm=arch in ("qwen3", "qwen3moe"),
        bos_token_id=_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        source=source,
        **moe,
    )


def gguf_tokenizer(reader: GGUFReader) -> Tokenizer | None:
    """Rebuild a byte-level BPE `tokenizers.Tokenizer` from `tokenizer.ggml.*` metadata.

    Only `tokenizer.ggml.model == "gpt2"` with a pre-tokenizer we know (`gpt-2`,
    `llama-bpe`, `qwen2`) is rebuilt; anything else returns None (eos ids still load).
    """
    if _value(reader, "tokenizer.ggml.model") != "gpt2":
        return None
    pre = _value(reader, "tokenizer.ggml.pre") or "gpt-2"
    if pre != "gpt-2" and pre not in PRE_TOKENIZER_REGEX:
        return None
    tokens = _value(reader, "tokenizer.ggml.tokens") or []
    types = _value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _value(reader, "tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    if pre == "gpt-2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEX[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, k in enumerate(types) if k == _TOKEN_CONTROL]
    added = [AddedToken(tokens[i], special=False, normalized=False) for i, k in enumerate(types) if k == _TOKEN_USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(added)
    bos = _value(reader, "tokenizer.ggml.bos_token_id")
    if _value(reader, "tokenizer.ggml.add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)]
        )
    return tok
