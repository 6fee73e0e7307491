"""A load test for `draftflow serve`: throughput and latency percentiles at each concurrency.

    python -m draftflow.tools.load_test --concurrency 1,8,32        # starts the demo graph in-process
    python -m draftflow.tools.load_test --url http://127.0.0.1:8000 --api-key KEY --model NAME --json

Without ``--url`` it serves ``--graph`` (default: the shipped tiny Qwen3 + prompt lookup) on a
free loopback port in this process, with ``--max-batch`` slots (default: as ``draftflow serve``).
At each concurrency C, C clients send ``--requests`` streamed completions between them
(``ignore_eos``, so every request generates ``--max-tokens``); time to first token is taken at
the first text chunk, end-to-end latency at the end of the stream, token counts from the usage
chunk. The requests go through the ``openai`` client when it is installed (``--client auto``),
else plain HTTP. The server's ``/metrics`` give the mean batch size and acceptance length of
each level.
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
QUANTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def http_request(url: str, body: dict, api_key: str | None) -> dict:
    """One streamed completion over plain HTTP: latency, ttft, tokens (or error)."""
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


def openai_request(client, body: dict) -> dict:
    """The same through the openai client (the draftflow extras in extra_body)."""
    import openai

    fields = {k: v for k, v in body.items() if k not in ("ignore_eos", "stream")}
    start = time.perf_counter()
    try:
        stream = client.completions.create(stream=True, extra_body={"ignore_eos": body["ignore_eos"]}, **fields)
        ttft, tokens = None, 0
        for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].text:
                ttft = time.perf_counter() - start
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except openai.APIError as exc:
        return {"error": f"{getattr(exc, 'status_code', '')} {exc}"[:200]}
    return {"latency": time.perf_counter() - start, "ttft": ttft, "tokens": tokens}


def get(url: str, path: str, api_key: str | None = None) -> str:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", path, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    text = conn.getresponse().read().decode()
    conn.close()
    return text


def scrape(url: str) -> dict[str, float]:
    """The server's unlabelled counters and histogram sums/counts (label-free lines of /metrics)."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(draftflow_\w+) (\S+)$", get(url, "/metrics"), re.MULTILINE)}


def ratio(before: dict, after: dict, num: str, den: str) -> float | None:
    d = after.get(den, 0) - before.get(den, 0)
    return (after.get(num, 0) - before.get(num, 0)) / d if d else None


def run_level(url: str, args, concurrency: int, client=None) -> dict:
    """``args.requests`` (default 4 per client, at least 8) streamed completions from ``concurrency`` clients."""
    count = args.requests or max(8, 4 * concurrency)
    before = scrape(url)
    bodies = [{"model": args.model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": args.max_tokens,
               "temperature": args.temperature, "seed": i, "stream": True, "stream_options": {"include_usage": True},
               "ignore_eos": True} for i in range(count)]
    send = (lambda b: openai_request(client, b)) if client is not None else (lambda b: http_request(url, b, args.api_key))
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(send, bodies))
    wall = time.perf_counter() - start
    after = scrape(url)
    ok = [r for r in results if "error" not in r]
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    accepted = ratio(before, after, "draftflow_spec_decode_num_accepted_tokens_total", "draftflow_spec_decode_num_drafts_total")
    batch = ratio(before, after, "draftflow_batch_size_per_cycle_sum", "draftflow_batch_size_per_cycle_count")
    return {"concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
            "max_tokens": args.max_tokens, "wall_s": round(wall, 3), "requests_per_s": round(len(ok) / wall, 3),
            "output_tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 1),
            "ttft_s": {f"p{q}": round(percentile(ttft, q), 4) for q in QUANTILES},
            "latency_s": {f"p{q}": round(percentile(lat, q), 4) for q in QUANTILES},
            "mean_batch": round(batch, 2) if batch is not None else None,
            "mean_acceptance_length": round(1 + accepted, 3) if accepted is not None else None,
            "first_error": next((r["error"] for r in results if "error" in r), None)}


def concurrencies(text: str) -> list[int]:
    try:
        levels = [int(c) for c in text.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give concurrencies >= 1, comma-separated, e.g. 1,8,32")
    return levels


def make_client(kind: str, url: str, api_key: str | None):
    """The openai client (``kind`` openai, or auto when it is installed), else None (plain HTTP)."""
    if kind == "http":
        return None
    try:
        import openai
    except ImportError:
        if kind == "openai":
            raise SystemExit("error: --client openai: the openai package is not installed; pip install openai, "
                             "or use --client http") from None
        return None
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key or "unused", max_retries=0, timeout=600)


def start_server(args):
    """Serve ``args.graph`` in this process on a free loopback port; returns the server (its url is server.url)."""
    from pathlib import Path

    from draftflow.core.serve_cli import batch_overrides
    from draftflow.core.server import DraftflowServer, ServeConfig
    from draftflow.core.serving import Engine
    from draftflow.core.session import Session

    graph = Path(args.graph) if args.graph else Session.shipped_graph("default.yaml")
    waiting = max(64, max(args.concurrency))  # every client may be waiting at once
    # opened on the worker thread that decodes, as `draftflow serve` does (Engine.open_in_worker: one OpenMP team)
    engine = Engine.open_in_worker(lambda: Session.open(graph_path=graph, overrides=batch_overrides(graph, [], args.max_batch)),
                                   max_waiting=waiting)
    server = DraftflowServer(ServeConfig(port=0, max_waiting=waiting), engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def print_table(reports: list[dict], client: str) -> None:
    print(f"client {client}, max_tokens {reports[0]['max_tokens']}")
    print(f"{'conc':>5} {'reqs':>5} {'err':>4} {'req/s':>8} {'tok/s':>9} {'batch':>6} {'tau':>6}   "
          f"{'ttft p50/p90/p99 (s)':>23}   {'e2e p50/p90/p99 (s)':>23}")
    for r in reports:
        t, e = r["ttft_s"], r["latency_s"]
        print(f"{r['concurrency']:>5} {r['requests']:>5} {r['errors']:>4} {r['requests_per_s']:>8.2f} "
              f"{r['output_tokens_per_s']:>9.1f} {r['mean_batch'] or 0:>6.2f} {r['mean_acceptance_length'] or 0:>6.2f}   "
              f"{t['p50']:>7.3f} {t['p90']:>7.3f} {t['p99']:>7.3f}   {e['p50']:>7.3f} {e['p90']:>7.3f} {e['p99']:>7.3f}")
        if r["first_error"]:
            print(f"      first error: {r['first_error']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m draftflow.tools.load_test", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: serve --graph in this process)")
    p.add_argument("--graph", help="graph to serve when no --url (default: the shipped default.yaml)")
    p.add_argument("--max-batch", help="request slots of the in-process server (as serve --max-batch)")
    p.add_argument("--model", help="model name to send (default: the server's first)")
    p.add_argument("--api-key")
    p.add_argument("--concurrency", type=concurrencies, default=[1, 8, 32], help="clients at each level (default 1,8,32)")
    p.add_argument("--requests", type=int, default=0, help="requests per level (default: 4 per client, at least 8)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--client", choices=("auto", "openai", "http"), default="auto",
                   help="auto: the openai client when installed, else plain HTTP")
    p.add_argument("--warmup", type=int, default=0, metavar="N",
                   help="send N requests at the highest concurrency first, unmeasured (CUDA graphs, policy tables)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    from draftflow.core.tracing import configure_logging

    configure_logging(verbose=False)  # cycle events would otherwise print
    server = start_server(args) if args.url is None else None
    url = args.url or server.url
    try:
        if args.model is None:
            args.model = json.loads(get(url, "/v1/models", args.api_key))["data"][0]["id"]
        client = make_client(args.client, url, args.api_key)
        if args.warmup:
            run_level(url, argparse.Namespace(**{**vars(args), "requests": args.warmup}), max(args.concurrency), client)
        reports = [run_level(url, args, c, client) for c in args.concurrency]
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
            server.engine.close()
            server.engine.session.close()
    kind = "openai" if client is not None else "http"
    if args.json:
        print(json.dumps({"client": kind, "url": url, "levels": reports}))
    else:
        print_table(reports, kind)
    return 0 if all(r["errors"] == 0 for r in reports) else 1


if __name__ == "__main__":
    raise SystemExit(main())
