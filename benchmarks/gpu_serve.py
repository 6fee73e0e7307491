"""`draftflow serve` under load at Qwen3-8B / DFlash-b16 shapes (random bf16 weights), through the load-test tool.

    python benchmarks/gpu_serve.py [--concurrency 1,8,32] [--max-tokens 128] [--tiny]

The user's path: the OpenAI-compatible server in this process (tools/load_test.py: HTTP
clients, streaming off) over two graphs on the same in-memory weights: target-only, and the
target with a DFlash drafter and the adaptive_k policy (num_draft 15). The target's tokenizer
is the demo model's (its LM head rows past that vocabulary are zeroed so text decodes).
Random weights accept nothing, so this measures what the policy does when drafting cannot
pay: it should fall back towards K = 0 and stay close to target-only at every load.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_batch as gb  # noqa: E402
import gpu_target as gt  # noqa: E402

DEMO_TOKENIZER = Path(__file__).resolve().parent.parent / "graphs" / "models" / "demo" / "target" / "tokenizer.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--tiny", action="store_true", help="a CPU dry run at toy shapes")
    a = p.parse_args()
    from tokenizers import Tokenizer

    from draftflow.tools import load_test

    root, _, dcfg = gb.random_pair(a.tiny, Tokenizer.from_file(str(DEMO_TOKENIZER)))
    head = f"device: {gt.DEV}\ndtype: bfloat16\nmax_context: 1024\n"
    graphs = {
        "target-only": head + "num_draft: 0\nnodes:\n  target: {plugin: target, params: {path: target}}\n"
                              "  verify: {plugin: verifier}\n",
        "dflash + adaptive_k": head + f"num_draft: 15\nnodes:\n  target: {{plugin: target, params: {{path: target, "
                                      f"tap_layers: {list(dcfg.target_layer_ids)}}}}}\n"
                                      "  drafter: {plugin: dflash, params: {path: drafter}}\n"
                                      "  policy: {plugin: adaptive_k}\n  verify: {plugin: verifier}\n",
    }
    for name, text in graphs.items():
        path = root / f"{name.split()[0]}.yaml"
        path.write_text(f"name: {name.split()[0]}\n" + text)
        print(f"\n## {name}", flush=True)
        load_test.main(["--graph", str(path), "--max-batch", str(a.max_batch), "--concurrency", a.concurrency,
                        "--max-tokens", str(a.max_tokens)])


if __name__ == "__main__":
    main()
