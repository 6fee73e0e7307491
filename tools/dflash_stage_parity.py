"""Every stage of one DFlash block pass against an independent NumPy (float64) implementation.

    python -m draftflow.tools.dflash_stage_parity TARGET DRAFTER [--prompt TEXT]

The target (float32) prefills the prompt minus its last token and hands over its feature
taps at the drafter's `target_layer_ids`; the last prompt token is the anchor of one block
`[anchor, MASK x (B-1)]`. That block pass runs twice on the same inputs:

- through `DFlashModel.draft` (float32), its stages captured with module hooks (inputs
  and outputs of the norms, projections, `o_proj`, MLP) and by recording `rotate`;
- through `numpy_pass` below, written from the checkpoint's tensors (read straight from
  its safetensors files; a GGUF through the loader, for the names) and the config's
  facts, from the math in docs/DFLASH.md: per layer input norm, q/k/v projections over
  the block and k/v over the context, q/k head norms, RoPE (half-split, HF
  `rotate_half`), attention over context + block with the layer kind's mask (full:
  non-causal; causal when `is_causal` or in sliding layers; sliding layers keep the
  window), `o_proj`, residual, post norm, SiLU-gated MLP, residual; final norm; the target
  LM head with the optional multiplier and softcap.

Every stage is compared over every row (context rows for the context K/V, all B block
rows otherwise) in the order the math runs; the first stage whose max abs diff exceeds
`--tol` (default 1e-4) times the stage's largest NumPy value is printed with its layer
and row, else "all stages agree to X" (the largest relative diff seen). 1e-4 because
float32 rounding (eps 1.2e-7) grows by sqrt(reduction length) per product and compounds
over the layers to ~1e-6 on the demo pair, while a wrong mask, RoPE offset, GQA head
order or norm lands at 1e-2 or more. Positions enter RoPE in float32 as the model does
(angle error ~ position x 6e-8), so keep prompts under ~1000 tokens at this tolerance.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from draftflow.core.errors import DraftflowError, ModelFormatError

DEFAULT_PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


# --- the independent implementation (float64) ----------------------------------------------
def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    # x: [T, heads, D]; positions: [T]
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = positions[:, None].astype(np.float64) * inv[None, :]  # [T, D/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def visible(cfg, layer: int, context: int, width: int) -> np.ndarray:
    """[W, C+W] which keys each block row sees in draft layer `layer` (dflash 0.1.0's layer kinds)."""
    kind = cfg.layer_types[layer] if cfg.layer_types else "full_attention"
    causal = cfg.is_causal if cfg.is_causal is not None else kind == "sliding_attention"
    q = context + np.arange(width)[:, None]  # query positions
    k = np.arange(context + width)[None, :]  # key positions: context rows, then the block
    seen = np.ones((width, context + width), dtype=bool)
    if causal:
        seen &= k <= q
    if kind == "sliding_attention":
        seen &= q - k < cfg.sliding_window
        if not causal:
            seen &= k - q < cfg.sliding_window
    return seen


def numpy_pass(cfg, w: dict[str, np.ndarray], features: np.ndarray, block: np.ndarray, head: np.ndarray) -> dict:
    """Every stage of one block pass: {(layer or '-', stage): array with rows first}."""
    # features: [C, n_taps*H]; block: [W, H] (embedded, scaled); head: [V, H]
    eps, d, nh, kvh = cfg.rms_norm_eps, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    c, width = features.shape[0], block.shape[0]
    pos_c, pos_b = np.arange(c), c + np.arange(width)
    out = {}
    fc = features @ w["fc.weight"].T
    ctx = _rms(fc, w["hidden_norm.weight"], eps)
    out["-", "fc (context)"], out["-", "hidden_norm (context)"], out["-", "block input"] = fc, ctx, block
    x = block
    for i in range(cfg.num_layers):
        p = f"layers.{i}."

        def wt(name):
            return w[p + name + ".weight"]

        h = _rms(x, wt("input_layernorm"), eps)
        q = h @ wt("self_attn.q_proj").T
        k_c, v_c = ctx @ wt("self_attn.k_proj").T, ctx @ wt("self_attn.v_proj").T
        k_b, v_b = h @ wt("self_attn.k_proj").T, h @ wt("self_attn.v_proj").T
        q_n = _rms(q.reshape(width, nh, d), wt("self_attn.q_norm"), eps)
        k_cn = _rms(k_c.reshape(c, kvh, d), wt("self_attn.k_norm"), eps)
        k_bn = _rms(k_b.reshape(width, kvh, d), wt("self_attn.k_norm"), eps)
        q_r, k_cr, k_br = _rope(q_n, pos_b, cfg.rope_theta), _rope(k_cn, pos_c, cfg.rope_theta), _rope(k_bn, pos_b, cfg.rope_theta)
        keys = np.concatenate([k_cr, k_br])  # [S, KVH, D]
        values = np.concatenate([v_c, v_b]).reshape(c + width, kvh, d)
        per_head = np.arange(nh) // (nh // kvh)  # the KV head each query head reads
        scores = np.einsum("whd,shd->hws", q_r, keys[:, per_head]) / math.sqrt(d)  # [QH, W, S]
        scores = np.where(visible(cfg, i, c, width)[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hws,shd->whd", probs, values[:, per_head]).reshape(width, nh * d)
        o = attn @ wt("self_attn.o_proj").T
        mid = x + o
        post = _rms(mid, wt("post_attention_layernorm"), eps)
        gate = post @ wt("mlp.gate_proj").T
        mlp = (gate / (1.0 + np.exp(-gate)) * (post @ wt("mlp.up_proj").T)) @ wt("mlp.down_proj").T
        stages = {"input": x, "input_norm": h, "q_proj": q, "k_proj (context)": k_c, "v_proj (context)": v_c,
                  "k_proj (block)": k_b, "v_proj (block)": v_b, "q_norm": q_n, "k_norm (context)": k_cn, "k_norm (block)": k_bn,
                  "rope q": q_r, "rope k (context)": k_cr, "rope k (block)": k_br, "attention": attn, "o_proj": o,
                  "residual": mid, "post_norm": post, "mlp": mlp}
        x = mid + mlp
        stages["output"] = x
        out.update({(i, name): value for name, value in stages.items()})
    final = _rms(x, w["norm.weight"], eps)
    logits = final @ head.T * cfg.output_multiplier
    if cfg.final_logit_softcapping:
        logits = np.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    out["-", "final norm"], out["-", "logits"] = final, logits
    return out


def checkpoint_tensors(path: str) -> dict[str, np.ndarray]:
    """The drafter's tensors as float64, by HF name: safetensors files read directly (GGUF: through the loader)."""
    from draftflow.plugins.dflash.loader import is_gguf, read_artifact

    if is_gguf(path):
        return {n: t.double().numpy() for n, t in read_artifact(path).tensors.items()}
    from safetensors import safe_open

    out = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({n: f.get_tensor(n).double().numpy() for n in f.keys()})
    return out


# --- the model under test ------------------------------------------------------------------
def torch_pass(model, cfg, features: torch.Tensor, block: torch.Tensor, head: torch.Tensor) -> dict:
    """The same stages from `DFlashModel.draft` (eager, fresh cache), captured by hooks."""
    # features: [C, n_taps*H]; block: [W, H]; head: [V, H]
    from draftflow.layers.kv_cache import KVCache
    from draftflow.plugins.dflash import model as dflash_model
    from draftflow.plugins.dflash.config import kv_shape

    ins, outs, rotated = {}, {}, []
    handles = []
    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(lambda m, a, name=name: ins.setdefault(name, []).append(a[0].clone())))
            handles.append(module.register_forward_hook(lambda m, a, o, name=name: outs.setdefault(name, []).append(o.clone())))
    real_rotate = dflash_model.rotate

    def recording_rotate(x, cos, sin):
        y = real_rotate(x, cos, sin)
        rotated.append(y.clone())
        return y

    c, width = features.shape[0], block.shape[0]
    cache = KVCache.from_static(torch.zeros(kv_shape(cfg, c + width), dtype=torch.float32))
    try:
        with mock.patch.object(dflash_model, "rotate", recording_rotate), torch.inference_mode():
            hidden = model.draft(features[None], 0, block[None], cache)
            logits = dflash_model.draft_logits(hidden, head, cfg)
    finally:
        for handle in handles:
            handle.remove()
    out = {("-", "fc (context)"): outs["fc"][0], ("-", "hidden_norm (context)"): outs["hidden_norm"][0],
           ("-", "block input"): block}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        nxt = ins[f"layers.{i + 1}.input_layernorm"][0] if i + 1 < cfg.num_layers else ins["norm"][0]
        # The context and block rows share one k/v projection (context rows first), then the queries are rotated.
        k_c, k_b = _split(outs[p + "self_attn.k_proj"][0], c)
        v_c, v_b = _split(outs[p + "self_attn.v_proj"][0], c)
        kn_c, kn_b = _split(outs[p + "self_attn.k_norm"][0], c)
        (rk_c, rk_b), rq = _split(rotated[2 * i], c), rotated[2 * i + 1]  # keys_values(context + block), folded_queries
        stages = {"input": ins[p + "input_layernorm"][0], "input_norm": outs[p + "input_layernorm"][0],
                  "q_proj": outs[p + "self_attn.q_proj"][0], "k_proj (context)": k_c, "v_proj (context)": v_c,
                  "k_proj (block)": k_b, "v_proj (block)": v_b, "q_norm": outs[p + "self_attn.q_norm"][0], "k_norm (context)": kn_c,
                  "k_norm (block)": kn_b, "rope q": rq, "rope k (context)": rk_c, "rope k (block)": rk_b,
                  "attention": ins[p + "self_attn.o_proj"][0], "o_proj": outs[p + "self_attn.o_proj"][0],
                  "residual": ins[p + "post_attention_layernorm"][0], "post_norm": outs[p + "post_attention_layernorm"][0],
                  "mlp": outs[p + "mlp"][0], "output": nxt}
        out.update({(i, name): value for name, value in stages.items()})
    out["-", "final norm"], out["-", "logits"] = hidden, logits
    # Batch of one: rows first, as numpy_pass.
    return {key: (v[0] if v.dim() > 1 and v.shape[0] == 1 and key[1] != "block input" else v).double().numpy()
            for key, v in out.items()}


def _split(rows: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A recorded [1, C+W, ...] output of the shared context + block projection: (context rows, block rows)."""
    return rows[:, :c], rows[:, c:]


# --- the comparison ------------------------------------------------------------------------
def check_supported(cfg, path: str) -> None:
    if cfg.rope_scaling is not None:
        raise ModelFormatError(f"DRAFTER {path}: RoPE scaling ({cfg.rope_scaling.rope_type}) is not in this tool's "
                               "NumPy reference; compare a drafter with default RoPE")


def compare(ref: dict, got: dict, tol: float) -> tuple[list[tuple], tuple | None]:
    """Per stage (layer, stage, shape, max abs diff, relative, row of the max); and the first one beyond `tol`."""
    rows, first = [], None
    for key, want in ref.items():
        have = got[key]
        if have.shape != want.shape:
            row = (*key, have.shape, math.inf, math.inf, 0)
        else:
            diff = np.abs(have - want).reshape(want.shape[0], -1)
            worst = float(diff.max())
            row = (*key, want.shape, worst, worst / max(float(np.abs(want).max()), 1e-30), int(diff.max(-1).argmax()))
        rows.append(row)
        if first is None and not row[4] <= tol:
            first = row
    return rows, first


def run(args) -> int:
    from draftflow.plugins.dflash.dflash2_loader import is_dflash2
    from draftflow.plugins.dflash.loader import load_drafter, read_config
    from draftflow.tools.dflash_taps import load_target, prefill_taps

    for path, what in ((args.target, "TARGET"), (args.drafter, "DRAFTER")):
        if not Path(path).exists():
            raise DraftflowError(f"{what} {path}: no such directory or file; pass a checkpoint directory or .gguf file")
    if is_dflash2(args.drafter):
        raise ModelFormatError(f"DRAFTER {args.drafter} is a DFlash2 artifact; this tool checks the DFlash block pass "
                               "(no convolutions): pass a DFlash drafter")
    try:
        cfg = read_config(args.drafter)
    except ModelFormatError as exc:
        raise ModelFormatError(f"DRAFTER {args.drafter} is not a DFlash drafter ({exc})") from None
    check_supported(cfg, args.drafter)
    target = load_target(args.target, "cpu")
    if target.tokenizer is None:
        raise DraftflowError(f"TARGET {args.target} has no tokenizer to encode --prompt; use a target with tokenizer.json")
    ids = target.tokenizer.encode(args.prompt, add_special_tokens=False).ids
    if len(ids) < 2:
        raise DraftflowError(f"--prompt {args.prompt!r} is {len(ids)} token(s); pass at least two")
    bad = [t for t in cfg.target_layer_ids if not 0 <= t < target.config.num_layers]
    embed, head = target.model.embed_tokens.weight.detach(), target.model.head_weight().detach()
    if bad or embed.shape[1] != cfg.hidden_size or not 0 <= cfg.mask_token_id < embed.shape[0]:
        raise ModelFormatError(f"DRAFTER {args.drafter} was not trained for TARGET {args.target} (taps {list(cfg.target_layer_ids)}, "
                               f"hidden {cfg.hidden_size}, mask id {cfg.mask_token_id}; the target has "
                               f"{target.config.num_layers} layers, hidden {embed.shape[1]}, vocabulary {embed.shape[0]})")
    features = prefill_taps(target.model, ids[:-1], tuple(cfg.target_layer_ids), "cpu")  # [C, n_taps*H]
    model, _ = load_drafter(args.drafter, "cpu", torch.float32)
    tokens = torch.tensor([[ids[-1]] + [cfg.mask_token_id] * (cfg.block_size - 1)])
    block = model.embed_block(tokens, embed)[0]  # [B, H]
    got = torch_pass(model, cfg, features, block, head)
    ref = numpy_pass(cfg, checkpoint_tensors(args.drafter), features.double().numpy(),
                     embed.double().numpy()[tokens[0].numpy()] * cfg.input_embedding_scale, head.double().numpy())
    rows, first = compare(ref, got, args.tol)
    print(f"DFlash block pass: {cfg.num_layers} layers, block {cfg.block_size}, context {features.shape[0]} rows, "
          f"layer kinds {list(cfg.layer_types) or 'full'}{'' if cfg.is_causal is None else f', is_causal {cfg.is_causal}'}")
    print(f"{'layer':>5}  {'stage':<22} {'shape':<16} {'max abs diff':>12}  {'relative':>9}")
    for row in rows:
        layer, stage, shape, worst, rel, _ = row
        print(f"{layer:>5}  {stage:<22} {str(tuple(shape)):<16} {worst:>12.3e}  {rel:>9.1e}"
              f"{'  <- first divergence' if row is first else ''}")
    if first is not None:
        layer, stage, shape, worst, rel, row = first
        where = "all rows" if math.isinf(worst) else f"row {row}"
        print(f"error: first divergence at stage {stage!r}, layer {layer}, {where}: max abs diff {worst:.3e} "
              f"({rel:.1e} of the stage's largest value; tolerance {args.tol:g})", file=sys.stderr)
        return 1
    print(f"all stages agree to {max(r[4] for r in rows):.1e} (relative; tolerance {args.tol:g})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draftflow.tools.dflash_stage_parity", description=__doc__.split("\n")[0])
    parser.add_argument("target", help="target checkpoint directory or .gguf file")
    parser.add_argument("drafter", help="DFlash drafter directory or .gguf file trained for the target")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text (its last token is the block's anchor)")
    parser.add_argument("--tol", type=float, default=1e-4, help="largest allowed max abs diff / max |NumPy value| per stage")
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (DraftflowError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
