"""GPU spot checks (run on a CUDA machine): the verification functions never synchronise with the host,
and the demo pair is lossless on the GPU through the whole graph.

    python3 benchmarks/gpu_checks.py
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftflow.verify import filter_logits, greedy_accept, rejection_sample

ROOT = Path(__file__).resolve().parent.parent


def no_sync() -> None:
    dev, g = "cuda", torch.Generator(device="cuda").manual_seed(0)
    b, k, v, c = 4, 5, 1000, 8
    logits = torch.randn(b, k + 1, v, device=dev)
    drafts = torch.randint(0, v, (b, k), device=dev)
    q_full = torch.softmax(torch.randn(b, k, v, device=dev), -1)
    cand = torch.randint(0, v, (b, k, c), device=dev)
    q_cand = torch.softmax(torch.randn(b, k, c, device=dev), -1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation below raises
    p = filter_logits(logits, 0.8, 50, 0.9)
    greedy_accept(drafts, logits)
    rejection_sample(drafts, p, None, None, generator=g)
    rejection_sample(drafts, p, q_full, None, generator=g)
    rejection_sample(drafts, p, q_cand, cand, generator=g)
    torch.cuda.set_sync_debug_mode("default")
    print("verify functions: no host synchronisation (sync debug mode 'error'): OK")


def demo_gate() -> None:
    from draftflow.core.spec import load_graph
    from draftflow.testing import greedy_gate

    spec = load_graph(ROOT / "graphs" / "demo.yaml", ["device=cuda"])
    report = greedy_gate(spec, prompts=[[5, 6, 7, 8], [100, 200, 300]], max_new_tokens=48)
    print(f"demo graph on CUDA, float32: greedy gate passed, drafted {report.drafted}, accepted {report.accepted}")


if __name__ == "__main__":
    no_sync()
    demo_gate()
