"""`draftflow serve` flags and graphs that must be refused before the server listens (one line, exit 1 or 2).

A valid `serve` runs until interrupted, so every case here must exit on its own. The HTTP
side (bad requests, rough clients, a taken port) is in test_server_reliability.py.
"""

from harness import Case

G = "{graphs}/default.yaml"
HOST = r"--host '{host}': cannot resolve it .*; pass an address of this machine such as 127\.0\.0\.1"

CASES = [
    Case("serve-port-70000", ["serve", G, "--port", "70000"],
         r"^error: --port 70000 is outside 0\.\.65535; choose a free port, or 0 to let the system pick one$"),
    Case("serve-port-negative", ["serve", G, "--port", "-1"], r"--port -1 is outside 0\.\.65535"),
    Case("serve-port-not-a-number", ["serve", G, "--port", "http"], r"argument --port: invalid int value: 'http'", exit=2),
    Case("serve-max-waiting-negative", ["serve", G, "--max-waiting", "-1"], r"--max-waiting is -1; it must be at least 1"),
    Case("serve-max-n-zero", ["serve", G, "--max-n", "0"], r"--max-n is 0; it must be at least 1"),
    Case("serve-max-batch-zero", ["serve", G, "--max-batch", "0"],
         r"^error: --max-batch '0': it must be an integer from 1 to 256 or 'auto'$"),
    Case("serve-prefill-budget-zero", ["serve", G, "--prefill-budget", "0"], r"--prefill-budget is 0; it must be at least 1"),
    Case("serve-max-waiting-zero", ["serve", G, "--max-waiting", "0"], r"--max-waiting is 0; it must be at least 1"),
    Case("serve-max-body-bytes-zero", ["serve", G, "--max-body-bytes", "0"], r"--max-body-bytes is 0; it must be at least 1"),
    Case("serve-max-tokens-limit-zero", ["serve", G, "--max-tokens-limit", "0"], r"--max-tokens-limit is 0"),
    Case("serve-default-max-tokens-above-limit", ["serve", G, "--default-max-tokens", "5000"],
         r"--default-max-tokens 5000 is above --max-tokens-limit 4096; lower it or raise the limit"),
    Case("serve-host-unresolvable", ["serve", G, "--host", "nosuch.invalid"], HOST.format(host=r"nosuch\.invalid")),
    Case("serve-host-with-port", ["serve", G, "--host", "127.0.0.1:8000"], HOST.format(host=r"127\.0\.0\.1:8000")),
    Case("serve-host-url", ["serve", G, "--host", "http://localhost"], HOST.format(host="http://localhost")),
    Case("serve-host-not-this-machine", ["serve", G, "--host", "192.0.2.1", "--port", "0"],  # TEST-NET-1 (RFC 5737)
         r"cannot listen on 192\.0\.2\.1:0: 192\.0\.2\.1 is not an address of this machine; use 127\.0\.0\.1 or 0\.0\.0\.0"),
    Case("serve-empty-api-key", ["serve", G, "--api-key", ""], r"--api-key is empty; pass a non-empty value"),
    Case("serve-empty-model-name", ["serve", G, "--served-model-name", " "], r"--served-model-name is empty"),
    Case("serve-missing-graph", ["serve", "{tmp}/nope.yaml", "--port", "0"], r"nope\.yaml: no such graph file"),
    Case("serve-malformed-graph", ["serve", "{fixtures}/malformed.yaml", "--port", "0"], r"malformed\.yaml:\d+:\d+: malformed YAML"),
    Case("serve-bad-set", ["serve", G, "--port", "0", "--set", "num_draft"], r"--set 'num_draft': expected KEY=VALUE"),
    Case("serve-trace-into-directory", ["serve", G, "--port", "0", "--trace", "{tmp}"], r"--trace .*: is a directory"),
    Case("serve-trace-onto-graph", ["serve", "{tmp}/g.yaml", "--port", "0", "--trace", "{tmp}/g.yaml"],
         r"--trace .*g\.yaml: is the graph file, which this run reads",
         files={"g.yaml": "name: g\nnodes:\n  target:\n    plugin: target\n    params:\n"
                          "      path: {graphs}/models/tiny-qwen3\n"}),
    Case("serve-no-graph", ["serve"], r"the following arguments are required: graph", exit=2),
]
