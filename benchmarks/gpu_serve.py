"""`draftflow serve` under load at Qwen3-8B / DFlash-b16 shapes (random bf16 weights), through the load-test tool.

    python benchmarks/gpu_serve.py [--concurrency 1,8,32] [--max-tokens 128] [--warmup 64] [--tiny]

The user's path: the OpenAI-compatible server in its own process (spawned; it builds the
random models in memory and serves them through draftflow's loaders) and the load-test tool
(tools/load_test.py: streamed completions from HTTP clients) in this one, over two graphs on
the same weights: target-only, and the target with a DFlash drafter and the adaptive_k policy
(num_draft 15). The target's tokenizer is the demo model's (its LM head rows past that
vocabulary are zeroed so text decodes). `--warmup` requests go first, unmeasured (CUDA graph
captures, the policy's cost table). Random weights accept nothing, so this measures what the
policy does when drafting cannot pay: it should fall back towards K = 0 and stay close to
target-only at every load.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEMO_TOKENIZER = HERE.parent / "graphs" / "models" / "demo" / "target" / "tokenizer.json"


def graph_text(name: str, device: str, taps: list[int]) -> str:
    head = f"name: {name}\ndevice: {device}\ndtype: bfloat16\nmax_context: 1024\n"
    if name == "target-only":
        return head + "num_draft: 0\nnodes:\n  target: {plugin: target, params: {path: target}}\n  verify: {plugin: verifier}\n"
    return head + (f"num_draft: 15\nnodes:\n  target: {{plugin: target, params: {{path: target, tap_layers: {taps}}}}}\n"
                   "  drafter: {plugin: dflash, params: {path: drafter}}\n  policy: {plugin: adaptive_k}\n"
                   "  verify: {plugin: verifier}\n")


def serve_child(name: str, tiny: bool, max_batch: int, port, ready, switch: float | None = None) -> None:
    """In the server process: random models, the graph, `draftflow serve`'s server on a free port."""
    sys.path.insert(0, str(HERE))
    if switch:
        sys.setswitchinterval(switch)
    import threading

    import gpu_batch as gb
    import gpu_target as gt
    from tokenizers import Tokenizer

    from draftflow.core.serve_cli import batch_overrides
    from draftflow.core.server import DraftflowServer, ServeConfig
    from draftflow.core.serving import Engine
    from draftflow.core.session import Session
    from draftflow.core.tracing import configure_logging

    configure_logging(verbose=False)
    root, _, dcfg = gb.random_pair(tiny, Tokenizer.from_file(str(DEMO_TOKENIZER)))
    path = root / f"{name}.yaml"
    path.write_text(graph_text(name, gt.DEV, list(dcfg.target_layer_ids)))
    # opened on the worker thread that decodes, as `draftflow serve` does (Engine.open_in_worker)
    engine = Engine.open_in_worker(lambda: Session.open(graph_path=path, overrides=batch_overrides(path, [], str(max_batch))),
                                   max_waiting=256)
    server = DraftflowServer(ServeConfig(port=0, max_waiting=256), engine)
    port.value = server.server_address[1]
    ready.set()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    threading.Event().wait()  # until the parent terminates this process


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--warmup", type=int, default=64)
    p.add_argument("--tiny", action="store_true", help="a CPU dry run at toy shapes")
    p.add_argument("--graphs", default="target-only,dflash-adaptive")
    p.add_argument("--switch-interval", type=float, default=None, help="the server process's sys.setswitchinterval")
    a = p.parse_args()
    from draftflow.tools import load_test

    ctx = multiprocessing.get_context("spawn")
    for name in a.graphs.split(","):
        port, ready = ctx.Value("i", 0), ctx.Event()
        child = ctx.Process(target=serve_child, args=(name, a.tiny, a.max_batch, port, ready, a.switch_interval), daemon=True)
        child.start()
        if not ready.wait(timeout=600):
            raise SystemExit(f"the {name} server did not start")
        print(f"\n## {name}", flush=True)
        try:
            load_test.main(["--url", f"http://127.0.0.1:{port.value}", "--concurrency", a.concurrency,
                            "--max-tokens", str(a.max_tokens), "--warmup", str(a.warmup)])
        finally:
            child.terminate()
            child.join()


if __name__ == "__main__":
    main()
