"""Target-only decode speed: draftflow's target node vs transformers `generate`, same weights, same run.

    python benchmarks/target_decode.py [--hidden 512 --layers 8 --vocab 8192] [--device cpu|cuda] [--dtype float32|bfloat16]

Builds a random-weight Qwen3 checkpoint with transformers (save_pretrained), then times
greedy decoding of --new tokens after a --prompt-token prompt, --repeats times each, and
prints a table (median tokens/s) with the ratio against transformers measured in this run.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch


def make_model(path: Path, a) -> None:
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 3,
                                   num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                                   head_dim=a.hidden // a.heads, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).to(getattr(torch, a.dtype)).save_pretrained(path, safe_serialization=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_draftflow(path: Path, prompt: list[int], a) -> list[float]:
    from draftflow.core.node import SamplingParams
    from draftflow.core.session import Session

    graph = {"device": a.device, "dtype": a.dtype, "max_context": 4096, "nodes": {
        "target": {"plugin": "target", "params": {"path": str(path)}}, "verify": {"plugin": "verifier"}}}
    session = Session.open(graph_dict=graph)
    sp = SamplingParams(max_new_tokens=a.new, ignore_eos=True)
    session.generate(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm-up
    rates = []
    for _ in range(a.repeats):
        sync(a.device)
        t = time.perf_counter()
        out = session.generate(prompt, sp)
        sync(a.device)
        rates.append(len(out.token_ids) / (time.perf_counter() - t))
    return rates


def bench_transformers(path: Path, prompt: list[int], a) -> list[float]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, a.dtype)).to(a.device).eval()
    ids = torch.tensor([prompt], device=a.device)
    kw = dict(do_sample=False, min_new_tokens=a.new, max_new_tokens=a.new, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, **{**kw, "min_new_tokens": 8, "max_new_tokens": 8})
        rates = []
        for _ in range(a.repeats):
            sync(a.device)
            t = time.perf_counter()
            out = model.generate(ids, **kw)
            sync(a.device)
            rates.append((out.shape[1] - len(prompt)) / (time.perf_counter() - t))
    return rates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    a = p.parse_args()
    from draftflow.core.tracing import configure_logging

    configure_logging(verbose=False)
    prompt = torch.randint(0, a.vocab, (a.prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        make_model(path, a)
        ours = bench_draftflow(path, prompt, a)
        theirs = bench_transformers(path, prompt, a)
    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"target-only greedy decode, Qwen3 hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}, {a.dtype}, "
          f"prompt {a.prompt_tokens}, {a.new} new tokens, median of {a.repeats}; {dev}; torch {torch.__version__}")
    base = statistics.median(theirs)
    print(f"{'engine':<28}{'tokens/s':>10}{'vs transformers':>18}")
    for name, rates in (("transformers generate", theirs), ("draftflow target node", ours)):
        med = statistics.median(rates)
        print(f"{name:<28}{med:>10.1f}{med / base:>17.2f}x")


if __name__ == "__main__":
    main()
