"""Write a small random-weight Qwen3 checkpoint in Hugging Face layout, with a real tokenizer.

It is what the shipped default graph runs until trained weights ship, and what tests and
benchmarks use when they need a target without downloading one:

    python -m draftflow.tools.tiny_model OUT_DIR [--hidden 64 --layers 2 --vocab 512 --seed 0 --mtp] [--hybrid]
    python -m draftflow.tools.tiny_model OUT_DIR --experts 16 --top-k 4     # a Qwen3-MoE target

`--hybrid` writes a Qwen3-Next-style hybrid (Gated DeltaNet + gated full attention, every
second layer full attention, dense MLPs) instead of a Qwen3.

The tokenizer is a byte-level BPE trained on draftflow's own documentation, so any text
round-trips. The weights are random: output is not meaningful text, but it is exactly
what the target computes, which is what speculative decoding must reproduce.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftflow.layers.config import TargetConfig, expected_tensors

EOS = "<|endoftext|>"


def hf_config(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, context: int) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": context, "tie_word_embeddings": False, "attention_bias": False,
        "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "float32",
    }


def hybrid_config(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, context: int) -> dict:
    """A Qwen3-Next config: linear / full attention alternating (full_attention_interval 2), dense MLPs."""
    head_dim = hidden // heads
    return {
        **hf_config(vocab, hidden, layers, heads, kv_heads, intermediate, context),
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "layer_types": ["linear_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "linear_num_key_heads": max(1, heads // 2), "linear_num_value_heads": heads, "linear_key_head_dim": head_dim,
        "linear_value_head_dim": head_dim, "linear_conv_kernel_dim": 4, "num_experts": 0, "mlp_only_layers": [],
    }


def moe_config(config: dict, experts: int, top_k: int, moe_intermediate: int) -> dict:
    """Turn a dense Qwen3 config dict into a Qwen3-MoE one (every layer sparse, renormalised top-k)."""
    return {**config, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": experts,
            "num_experts_per_tok": top_k, "moe_intermediate_size": moe_intermediate, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": []}


def random_weights(cfg: TargetConfig, seed: int) -> dict[str, torch.Tensor]:
    """Weights scaled so activations stay O(1) and greedy argmaxes are not near ties."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_tensors(cfg).items():
        if name.endswith("A_log"):  # decay rates exp(A_log) in [1, e): memory over a few tokens
            out[name] = torch.rand(shape, generator=gen)
        elif len(shape) == 3:  # depthwise conv [C, 1, K]
            out[name] = torch.randn(shape, generator=gen) / shape[2] ** 0.5
        elif len(shape) == 1 and cfg.norm_offset and name.endswith("norm.weight") and ".linear_attn." not in name:
            out[name] = 0.1 * torch.randn(shape, generator=gen)  # (1 + w) norms
        elif len(shape) == 1:
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            out[name] = torch.randn(shape, generator=gen) / shape[1] ** 0.5
    return out


def random_mtp_head(cfg: TargetConfig, seed: int) -> dict[str, torch.Tensor]:
    """A DeepSeek-V3-layout MTP head at layer index num_layers (random, like the target)."""
    import attrs

    deeper = attrs.evolve(cfg, num_layers=cfg.num_layers + 1)
    prefix = f"model.layers.{cfg.num_layers}."
    block = {n: s for n, s in expected_tensors(deeper).items() if n.startswith(prefix)}
    h = cfg.hidden_size
    head = {prefix + "enorm.weight": (h,), prefix + "hnorm.weight": (h,), prefix + "eh_proj.weight": (h, 2 * h),
            prefix + "shared_head.norm.weight": (h,), prefix + "shared_head.head.weight": (cfg.vocab_size, h)}
    gen = torch.Generator().manual_seed(seed + 1000)
    return {n: (1.0 + 0.1 * torch.randn(s, generator=gen)) if len(s) == 1 else torch.randn(s, generator=gen) / s[1] ** 0.5
            for n, s in {**block, **head}.items()}


def train_tokenizer(vocab: int, corpus: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def default_corpus() -> list[str]:
    root = Path(__file__).resolve().parent.parent
    texts = [p.read_text(encoding="utf-8") for p in sorted((root / "docs").glob("*.md"))]
    texts += [p.read_text(encoding="utf-8") for p in sorted((root / "core").glob("*.py"))]
    return texts or ["draftflow speculative decoding"]


def write_tiny_model(out: Path, vocab: int = 512, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                     intermediate: int = 176, context: int = 2048, seed: int = 0, corpus: list[str] | None = None,
                     mtp: bool = False, hybrid: bool = False, experts: int = 0, top_k: int = 2,
                     moe_intermediate: int = 32) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab, corpus or default_corpus())
    vocab = tok.get_vocab_size()
    config = (hybrid_config if hybrid else hf_config)(vocab, hidden, layers, heads, kv_heads, intermediate, context)
    if experts:
        config = moe_config(config, experts, top_k, moe_intermediate)
    if mtp:
        config["num_nextn_predict_layers"] = 1  # the target loader leaves these tensors to the mtp node
    cfg = TargetConfig.from_hf_dict(config, str(out / "config.json"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    save_file(random_weights(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    if mtp:
        save_file(random_mtp_head(cfg, seed), str(out / "mtp.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m draftflow.tools.tiny_model", description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=176)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mtp", action="store_true", help="also write a random DeepSeek-V3-layout MTP head (mtp.safetensors)")
    p.add_argument("--hybrid", action="store_true", help="a Qwen3-Next-style hybrid (Gated DeltaNet + gated attention)")
    p.add_argument("--experts", type=int, default=0, help="> 0: a Qwen3-MoE target with this many experts per layer")
    p.add_argument("--top-k", type=int, default=2, help="MoE: experts routed per token")
    p.add_argument("--moe-intermediate", type=int, default=32, help="MoE: width of each expert")
    a = p.parse_args(argv)
    path = write_tiny_model(Path(a.out), a.vocab, a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate, a.context, a.seed,
                            mtp=a.mtp, hybrid=a.hybrid, experts=a.experts, top_k=a.top_k,
                            moe_intermediate=a.moe_intermediate)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
