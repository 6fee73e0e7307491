"""A short load test for `draftflow serve`: requests/s and latency percentiles.

    python -m draftflow.tools.load_test                       # starts the demo graph in-process
    python -m draftflow.tools.load_test --url http://127.0.0.1:8000 --api-key KEY --model NAME

Without ``--url`` it serves ``--graph`` (default: the shipped tiny Qwen3 + prompt lookup)
on a free loopback port in this process. Every request streams, so time to first token is
measured at the first text chunk; token counts come from the final usage chunk. Standard
library only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

PROMPTS = ("def fib(n):", "import numpy as np\n", "The quick brown fox", "for i in range(10):",
           "Once upon a time", "class Stack:\n    def push(self, x):")


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def one_request(url: str, body: dict, api_key: str | None) -> dict:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    resp = conn.getresponse()
    if resp.status != 200:
        return {"error": f"{resp.status} {resp.read().decode()[:200]}"}
    ttft, tokens = None, 0
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("choices") and event["choices"][0].get("text") and ttft is None:
            ttft = time.perf_counter() - start
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    conn.close()
    return {"latency": time.perf_counter() - start, "ttft": ttft, "tokens": tokens}


def get(url: str, path: str, api_key: str | None = None) -> str:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", path, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    text = conn.getresponse().read().decode()
    conn.close()
    return text


def scrape(url: str) -> dict[str, float]:
    text = get(url, "/metrics")
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(draftflow_spec_decode_\w+_total) (\S+)$", text, re.MULTILINE)}


def run(url: str, args) -> dict:
    before = scrape(url)
    bodies = [{"model": args.model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": args.max_tokens,
               "temperature": args.temperature, "seed": i, "stream": True, "stream_options": {"include_usage": True},
               "ignore_eos": True} for i in range(args.requests)]
    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(lambda b: one_request(url, b, args.api_key), bodies))
    wall = time.perf_counter() - start
    after = scrape(url)
    ok = [r for r in results if "error" not in r]
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    drafts = after.get("draftflow_spec_decode_num_drafts_total", 0) - before.get("draftflow_spec_decode_num_drafts_total", 0)
    accepted = (after.get("draftflow_spec_decode_num_accepted_tokens_total", 0)
                - before.get("draftflow_spec_decode_num_accepted_tokens_total", 0))
    return {"requests": len(results), "errors": len(results) - len(ok), "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "wall_s": round(wall, 3), "requests_per_s": round(len(ok) / wall, 3),
            "output_tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 1),
            "latency_s": {f"p{q}": round(percentile(lat, q), 4) for q in (50, 90, 99)},
            "ttft_s": {f"p{q}": round(percentile(ttft, q), 4) for q in (50, 90, 99)},
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
            "first_error": next((r["error"] for r in results if "error" in r), None)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m draftflow.tools.load_test", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: serve --graph in this process)")
    p.add_argument("--graph", help="graph to serve when no --url (default: the shipped default.yaml)")
    p.add_argument("--model", help="model name to send (default: the graph's name)")
    p.add_argument("--api-key")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    from draftflow.core.tracing import configure_logging

    configure_logging(verbose=False)  # cycle events would otherwise print
    server = None
    if args.url is None:
        from pathlib import Path

        from draftflow.core.server import DraftflowServer, ServeConfig
        from draftflow.core.serving import Engine
        from draftflow.core.session import Session

        session = Session.open(graph_path=Path(args.graph) if args.graph else Session.shipped_graph("default.yaml"))
        waiting = max(64, args.concurrency)  # every client may be waiting at once
        server = DraftflowServer(ServeConfig(port=0, max_waiting=waiting), Engine(session, max_waiting=waiting))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        args.url = server.url
    if args.model is None:
        args.model = json.loads(get(args.url, "/v1/models", args.api_key))["data"][0]["id"]
    try:
        report = run(args.url, args)
    finally:
        if server is not None:
            server.shutdown()
            server.engine.close()
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{report['requests']} requests ({report['errors']} errors), concurrency {report['concurrency']}, "
              f"max_tokens {report['max_tokens']}, {report['wall_s']} s")
        print(f"  {report['requests_per_s']} requests/s, {report['output_tokens_per_s']} output tokens/s, "
              f"mean acceptance length {report['mean_acceptance_length'] or 'n/a (no drafts)'}")
        for key in ("latency_s", "ttft_s"):
            print(f"  {key:<10} " + "  ".join(f"{q} {v:.3f}" for q, v in report[key].items()))
        if report["first_error"]:
            print(f"  first error: {report['first_error']}")
    return 0 if report["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
