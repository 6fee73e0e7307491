"""`draftflow serve` against bad requests and rough clients: one real server subprocess, every call bounded in time.

The table sends each bad request as an OpenAI API user (or a broken HTTP client) might and
asserts a 4xx JSON error naming the field; after every case the server must still answer.
The other tests pin a burst of connections, clients that leave mid-request, a taken port,
and that every 5xx is logged with its exception.
"""

from __future__ import annotations

import http.client
import json
import re
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import GRAPHS  # noqa: E402

GRAPH = GRAPHS / "default.yaml"  # the tiny Qwen3 with a ChatML template, drafted by prompt lookup (built-in plugins)
MODEL = "default"
KEY = "sk-reliability"
TIMEOUT_S = 20  # any one HTTP exchange
COMPLETION = {"model": MODEL, "prompt": "def fib(n):", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _start(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """A `draftflow -v serve` subprocess logging to ``log``; returns it and its URL once it listens."""
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "draftflow", "-v", "serve", str(GRAPH), "--port", "0", *args],
                                stdout=subprocess.PIPE, stderr=err, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.2)[0]:
            line = proc.stdout.readline()
            if match := re.search(r"listening on (http://\S+)", line):
                return proc, match.group(1)
        if proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"the server did not start:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc, url = _start(["--api-key", KEY, "--max-body-bytes", "65536"], log)
    try:
        yield {"url": url, "port": int(url.rsplit(":", 1)[1]), "log": log}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


def request(port: int, method: str, path: str, body=None, headers: dict | None = None, key: str | None = KEY):
    """One HTTP exchange on its own connection; returns (status, headers, body bytes)."""
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    elif isinstance(body, str):
        body = body.encode("utf-8", "surrogatepass")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        conn.request(method, path, body=body, headers={**({"Authorization": f"Bearer {key}"} if key else {}),
                                                       **(headers or {})})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def raw_request(port: int, data: bytes, method: str = "POST"):
    """Send ``data`` as-is on a fresh connection; returns (status, body bytes) of the one response."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        sock.sendall(data)
        resp = http.client.HTTPResponse(sock, method=method)
        resp.begin()
        return resp.status, resp.read()


def healthy(port: int) -> bool:
    return request(port, "GET", "/health")[0] == 200


# --- the table ------------------------------------------------------------------------------
def C(**fields):
    return {**COMPLETION, **fields}


def H(**fields):
    return {**CHAT, **fields}


def without(base: dict, key: str) -> dict:
    return {k: v for k, v in base.items() if k != key}


def head(**headers) -> bytes:
    """A raw POST /v1/completions head with the auth header and ``headers`` (body not included)."""
    lines = ["POST /v1/completions HTTP/1.1", "Host: x", f"Authorization: Bearer {KEY}",
             *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


CP, CH = "/v1/completions", "/v1/chat/completions"
# id, method, path, body (dict: JSON; str/bytes: as-is), expected status, param (None: not checked), message regex
CASES = [
    # fields of both endpoints: wrong types and ranges
    ("seed-2**70", "POST", CP, C(seed=2**70), 400, "seed",
     r"'seed' must be an integer in \[0, 9223372036854775807\], got 1180591620717411303424"),
    ("seed-negative", "POST", CP, C(seed=-1), 400, "seed", r"'seed' must be an integer in \[0, "),
    ("seed-string", "POST", CP, C(seed="7"), 400, "seed", r"'seed'"),
    ("seed-float", "POST", CP, C(seed=1.5), 400, "seed", r"'seed'"),
    ("temperature-string", "POST", CP, C(temperature="hot"), 400, "temperature", r"'temperature' must be a finite"),
    ("temperature-negative", "POST", CP, C(temperature=-1), 400, "temperature", r"'temperature'"),
    ("temperature-infinity", "POST", CP, json.dumps(C()).replace("}", ', "temperature": Infinity}'), 400,
     "temperature", r"finite number"),
    ("temperature-nan", "POST", CP, json.dumps(C()).replace("}", ', "temperature": NaN}'), 400, "temperature",
     r"finite number"),
    ("temperature-int-1e400", "POST", CP, json.dumps(C()).replace("}", ', "temperature": 1' + "0" * 400 + "}"), 400,
     "temperature", r"finite number"),
    ("top-p-zero", "POST", CP, C(top_p=0), 400, "top_p", r"'top_p' must be a number in \(0, 1\]"),
    ("top-p-two", "POST", CP, C(top_p=2), 400, "top_p", r"'top_p'"),
    ("top-k-string", "POST", CP, C(top_k="5"), 400, "top_k", r"'top_k'"),
    ("top-k-minus-two", "POST", CP, C(top_k=-2), 400, "top_k", r"'top_k' must be an integer >= -1"),
    ("max-tokens-zero", "POST", CP, C(max_tokens=0), 400, "max_tokens", r"'max_tokens' must be an integer in \[1, 4096\]"),
    ("max-tokens-1e30", "POST", CP, C(max_tokens=10**30), 400, "max_tokens", r"'max_tokens'"),
    ("max-tokens-bool", "POST", CP, C(max_tokens=True), 400, "max_tokens", r"'max_tokens'"),
    ("max-tokens-float", "POST", CP, C(max_tokens=2.5), 400, "max_tokens", r"'max_tokens'"),
    ("max-tokens-past-context", "POST", CP, C(max_tokens=4000), 400, "max_tokens", r"exceeds the context of 2048"),
    ("max-tokens-5000-digits", "POST", CP, json.dumps(C()).replace('"max_tokens": 2', '"max_tokens": ' + "9" * 5000),
     400, None, r"not valid JSON: .*digits"),
    ("stop-17-strings", "POST", CP, C(stop=[f"s{i}" for i in range(17)]), 400, "stop", r"at most 16"),
    ("stop-number", "POST", CP, C(stop=5), 400, "stop", r"'stop' must be"),
    ("stop-empty-string", "POST", CP, C(stop=[""]), 400, "stop", r"'stop' must be a non-empty string"),
    ("stop-token-ids-strings", "POST", CP, C(stop_token_ids=["a"]), 400, "stop_token_ids", r"a list of token ids"),
    ("stop-token-id-outside-vocab", "POST", CP, C(stop_token_ids=[10**9]), 400, "stop_token_ids", r"token ids in \[0, "),
    ("n-zero", "POST", CP, C(n=0), 400, "n", r"'n' must be an integer in \[1, 8\] \(draftflow serve --max-n\), got 0"),
    ("n-nine", "POST", CP, C(n=9), 400, "n", r"'n' must be an integer in \[1, 8\]"),
    ("n-true", "POST", CP, C(n=True), 400, "n", r"'n' must be .*got True"),
    ("n-chat-string", "POST", CH, H(n="2"), 400, "n", r"'n' must be"),
    ("best-of-below-n", "POST", CP, C(n=3, best_of=2), 400, "best_of", r"'best_of' must be an integer in \[n, 8\]"),
    ("best-of-nine", "POST", CP, C(best_of=9), 400, "best_of", r"'best_of'"),
    ("best-of-streamed", "POST", CP, C(best_of=2, stream=True), 400, "best_of", r"cannot be streamed"),
    ("best-of-chat", "POST", CH, H(best_of=2), 400, "best_of", r"best_of is a completions field"),
    ("presence-penalty-three", "POST", CP, C(presence_penalty=3), 400, "presence_penalty",
     r"'presence_penalty' must be a number in \[-2, 2\]"),
    ("presence-penalty-string", "POST", CH, H(presence_penalty="x"), 400, "presence_penalty", r"'presence_penalty'"),
    ("frequency-penalty-minus-three", "POST", CP, C(frequency_penalty=-3), 400, "frequency_penalty",
     r"'frequency_penalty' must be a number in \[-2, 2\]"),
    ("frequency-penalty-nan", "POST", CP, json.dumps(C()).replace("}", ', "frequency_penalty": NaN}'), 400,
     "frequency_penalty", r"'frequency_penalty'"),
    ("repetition-penalty-zero", "POST", CP, C(repetition_penalty=0), 400, "repetition_penalty",
     r"'repetition_penalty' must be a number in \(0, 100\]"),
    ("repetition-penalty-bool", "POST", CP, C(repetition_penalty=True), 400, "repetition_penalty", r"'repetition_penalty'"),
    ("min-p-two", "POST", CP, C(min_p=2), 400, "min_p", r"'min_p' must be a number in \[0, 1\]"),
    ("logit-bias-list", "POST", CP, C(logit_bias=[1, 2]), 400, "logit_bias", r"'logit_bias' must be an object"),
    ("logit-bias-word-key", "POST", CP, C(logit_bias={"hello": 5}), 400, "logit_bias", r"key 'hello' is not a token id"),
    ("logit-bias-negative-key", "POST", CP, C(logit_bias={"-1": 5}), 400, "logit_bias", r"key '-1' is not a token id"),
    ("logit-bias-outside-vocab", "POST", CH, H(logit_bias={"999999": 5}), 400, "logit_bias",
     r"key '999999' is not a token id in \[0, \d+\)"),
    ("logit-bias-value-200", "POST", CP, C(logit_bias={"5": 200}), 400, "logit_bias",
     r"value for token 5 must be a number in \[-100, 100\], got 200"),
    ("logit-bias-value-string", "POST", CP, C(logit_bias={"5": "up"}), 400, "logit_bias", r"value for token 5"),
    ("logprobs-completion-21", "POST", CP, C(logprobs=21), 400, "logprobs", r"'logprobs' must be an integer in \[0, 20\]"),
    ("logprobs-completion-true", "POST", CP, C(logprobs=True), 400, "logprobs", r"'logprobs'"),
    ("logprobs-chat-int", "POST", CH, H(logprobs=3), 400, "logprobs", r"'logprobs' must be true or false"),
    ("top-logprobs-without-logprobs", "POST", CH, H(top_logprobs=2), 400, "top_logprobs", r"needs 'logprobs': true"),
    ("top-logprobs-21", "POST", CH, H(logprobs=True, top_logprobs=21), 400, "top_logprobs", r"\[0, 20\]"),
    ("top-logprobs-completion", "POST", CP, C(top_logprobs=2), 400, "top_logprobs", r"is a chat field"),
    ("response-format-string", "POST", CP, C(response_format="json"), 400, "response_format", r"an object"),
    ("response-format-unknown-type", "POST", CH, H(response_format={"type": "xml"}), 400, "response_format",
     r"'response_format.type' must be .*got \"xml\""),
    ("response-format-schema-missing", "POST", CH, H(response_format={"type": "json_schema"}), 400, "response_format",
     r"'response_format.json_schema' must be an object"),
    ("response-format-schema-not-object", "POST", CH,
     H(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}), 400, "response_format",
     r"must be a JSON schema object"),
    ("response-format-and-guided-regex", "POST", CP, C(response_format={"type": "json_object"}, guided_regex="a+"),
     400, "guided_regex", r"ask for one output format"),
    ("guided-regex-empty", "POST", CP, C(guided_regex=""), 400, "guided_regex", r"'guided_regex' must be a non-empty"),
    ("guided-json-not-json", "POST", CP, C(guided_json="{nope"), 400, "guided_json", r"'guided_json' is not valid JSON"),
    ("guided-regex-unclosed", "POST", CP, C(guided_regex="(ab"), 400, "guided_regex", r"invalid regex"),
    ("guided-grammar-broken", "POST", CP, C(guided_grammar="start: ::="), 400, "guided_grammar", r"\(lark\)"),
    ("response-format-schema-bad-type", "POST", CH, H(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}), 400, "response_format", r"\(json_schema\): .*no-such-type"),
    ("echo-true", "POST", CP, C(echo=True), 400, "echo", r"'echo' is not supported"),
    ("stream-string", "POST", CP, C(stream="yes"), 400, "stream", r"'stream' must be true or false"),
    ("stream-options-string", "POST", CP, C(stream=True, stream_options="x"), 400, "stream_options", r"an object"),
    ("stream-options-usage-string", "POST", CP, C(stream=True, stream_options={"include_usage": "yes"}), 400,
     "stream_options", r"'stream_options.include_usage' must be true or false"),
    ("ignore-eos-string", "POST", CP, C(ignore_eos="yes"), 400, "ignore_eos", r"'ignore_eos'"),
    ("return-spec-stats-int", "POST", CP, C(return_spec_stats=1), 400, "return_spec_stats", r"'return_spec_stats'"),
    ("user-number", "POST", CP, C(user=5), 400, "user", r"'user' must be a string"),
    ("model-missing", "POST", CP, without(COMPLETION, "model"), 400, "model", r"'model' is required"),
    ("model-number", "POST", CP, C(model=5), 400, "model", r"'model' is required"),
    ("model-unknown", "POST", CP, C(model="gpt-4o"), 404, "model", r"'gpt-4o' does not exist; .*\['default'\]"),
    # completions: prompt
    ("prompt-missing", "POST", CP, without(COMPLETION, "prompt"), 400, "prompt", r"'prompt' must be a non-empty"),
    ("prompt-empty", "POST", CP, C(prompt=""), 400, "prompt", r"'prompt' must be a non-empty"),
    ("prompt-empty-list", "POST", CP, C(prompt=[]), 400, "prompt", r"'prompt'"),
    ("prompt-batch", "POST", CP, C(prompt=["a", "b"]), 400, "prompt", r"send one request each"),
    ("prompt-float-ids", "POST", CP, C(prompt=[1.5]), 400, "prompt", r"'prompt'"),
    ("prompt-bool-ids", "POST", CP, C(prompt=[True]), 400, "prompt", r"'prompt'"),
    ("prompt-id-outside-vocab", "POST", CP, C(prompt=[1, -1]), 400, "prompt", r"token ids must lie in \[0, "),
    ("prompt-object", "POST", CP, C(prompt={"text": "hi"}), 400, "prompt", r"'prompt'"),
    ("prompt-lone-surrogate", "POST", CP, json.dumps(C()).replace("def fib(n):", "\\ud800"), 400, "prompt",
     r"not valid text: character 0 is a lone surrogate U\+D800"),
    # chat: messages and template variables
    ("messages-missing", "POST", CH, without(CHAT, "messages"), 400, "messages", r"'messages' must be a non-empty list"),
    ("messages-empty", "POST", CH, H(messages=[]), 400, "messages", r"'messages' must be a non-empty list"),
    ("messages-string", "POST", CH, H(messages="hi"), 400, "messages", r"'messages'"),
    ("message-not-object", "POST", CH, H(messages=[5]), 400, "messages", r"messages\[0\] must be an object"),
    ("message-unknown-role", "POST", CH, H(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages",
     r"messages\[0\]\.role 'wizard' is not one of system, developer, user"),
    ("message-no-role", "POST", CH, H(messages=[{"content": "hi"}]), 400, "messages", r"string 'role'"),
    ("message-content-number", "POST", CH, H(messages=[{"role": "user", "content": 5}]), 400, "messages",
     r"string 'content'"),
    ("message-image-part", "POST", CH, H(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, "messages", r"only text parts"),
    ("message-lone-surrogate", "POST", CH, json.dumps(CHAT).replace('"hi"', '"\\udfff"'), 400, "messages",
     r"lone surrogate"),
    ("max-completion-tokens-zero", "POST", CH, H(max_completion_tokens=0), 400, "max_completion_tokens",
     r"'max_completion_tokens'"),
    ("template-kwargs-string", "POST", CH, H(chat_template_kwargs="x"), 400, "chat_template_kwargs",
     r"'chat_template_kwargs' must be an object"),
    ("template-kwargs-list", "POST", CH, H(chat_template_kwargs=[["a", 1]]), 400, "chat_template_kwargs", r"an object"),
    ("template-kwargs-messages", "POST", CH, H(chat_template_kwargs={"messages": []}), 400, "chat_template_kwargs",
     r"may not set 'messages'"),
    # the body and the HTTP layer
    ("body-truncated-json", "POST", CP, b'{"model": "default", "prompt": ', 400, None, r"not valid JSON"),
    ("body-array", "POST", CP, b"[]", 400, None, r"must be a JSON object"),
    ("body-null", "POST", CP, b"null", 400, None, r"must be a JSON object"),
    ("body-empty", "POST", CP, b"", 400, None, r"not valid JSON"),
    ("body-not-utf8", "POST", CP, b"\xff\xfe{}", 400, None, r"not valid JSON"),
    ("body-form-encoded", "POST", CP, b"model=default&prompt=hi", 400, None, r"not valid JSON"),
    ("body-nested-100k", "POST", CP, b"[" * 50000, 400, None, r"nested too deeply"),
    ("body-over-limit", "POST", CP, C(prompt="x" * 70000), 413, None, r"the limit is 65536 \(draftflow serve --max-body"),
    ("wrong-api-key", "POST", CP, C(), 401, None, r"missing or wrong API key"),
    ("get-on-post-route", "GET", CP, None, 405, None, r"/v1/completions takes POST, not GET"),
    ("post-on-get-route", "POST", "/health", b"{}", 405, None, r"/health takes GET, HEAD, not POST"),
    ("put-on-post-route", "PUT", CH, b"{}", 405, None, r"takes POST, not PUT"),
    ("delete-models", "DELETE", "/v1/models", None, 405, None, r"takes GET, HEAD, not DELETE"),
    ("unknown-route", "GET", "/v2/nothing", None, 404, None, r"no route /v2/nothing"),
    ("unknown-method", "BREW", CP, None, 501, None, r"Unsupported method \('BREW'\)"),
]
RAW = [  # id, bytes sent as-is, expected status, message regex
    ("content-length-missing", head(Transfer_Encoding="chunked"), 411, r"with a Content-Length header"),
    ("content-length-negative", head(Content_Length="-5"), 400, r"Content-Length"),
    ("content-length-not-number", head(Content_Length="abc"), 400, r"Content-Length"),
    ("content-length-superscript", head(Content_Length="\xb2"), 400, r"Content-Length"),
    ("content-length-1e12", head(Content_Length=str(10**12)), 413, r"has 1000000000000 bytes; the limit is 65536"),
    ("request-line-one-word", b"HELLO\r\n\r\n", 400, r"Bad request syntax"),
    ("request-line-bad-version", b"GET /health HTTX/1.1\r\n\r\n", 400, r"Bad request version"),
    ("http-version-2", b"GET /health HTTP/2.0\r\n\r\n", 505, r"Invalid HTTP version"),
]
_BY_ID = [c[0] for c in CASES] + [r[0] for r in RAW]
assert len(_BY_ID) == len(set(_BY_ID)), "case ids must be unique"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_json_4xx(server, case):
    """A bad request gets its status and a JSON error naming the field; the server keeps serving."""
    _, method, path, body, status, param, message = case
    key = "sk-wrong" if case[0] == "wrong-api-key" else KEY
    got, headers, data = request(server["port"], method, path, body, key=key)
    assert got == status, data[:500]
    assert headers.get("Content-Type") == "application/json", headers
    error = json.loads(data)["error"]
    assert re.search(message, error["message"]), error
    if param is not None:
        assert error["param"] == param, error
    assert healthy(server["port"])


@pytest.mark.parametrize("case", RAW, ids=[r[0] for r in RAW])
def test_broken_http_gets_json_error(server, case):
    """Broken HTTP (bad request line, Content-Length, header size, version) gets a JSON error, not HTML or silence."""
    _, data, status, message = case
    got, body = raw_request(server["port"], data)
    assert got == status, body[:500]
    assert re.search(message, json.loads(body)["error"]["message"]), body[:500]
    assert healthy(server["port"])


def test_odd_but_valid_requests_are_served(server):
    """HEAD, text parts, a text/plain Content-Type, and chat_template_kwargs that override ours are all served."""
    port = server["port"]
    status, headers, body = request(port, "HEAD", "/health")
    assert (status, body) == (200, b"") and int(headers["Content-Length"]) > 0
    assert request(port, "HEAD", CP)[0] == 405
    for kwargs in ({"add_generation_prompt": False}, {"enable_thinking": False, "bos_token": ""}):
        status, _, body = request(port, "POST", CH, H(chat_template_kwargs=kwargs))
        assert status == 200 and json.loads(body)["object"] == "chat.completion", body[:500]
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    assert request(port, "POST", CH, H(messages=[{"role": "user", "content": parts}]))[0] == 200
    assert request(port, "POST", CP, C(), headers={"Content-Type": "text/plain"})[0] == 200  # curl -d sends form type


def test_add_generation_prompt_false_renders_no_assistant_turn(server):
    """The user's add_generation_prompt wins over our default: the prompt then ends with the user's turn."""
    def prompt_tokens(kwargs):
        status, _, body = request(server["port"], "POST", CH, H(chat_template_kwargs=kwargs))
        assert status == 200, body[:500]
        return json.loads(body)["usage"]["prompt_tokens"]

    assert prompt_tokens({"add_generation_prompt": False}) < prompt_tokens({})  # no "<|im_start|>assistant\n"


def test_pipelined_keep_alive_requests(server):
    """Requests pipelined on one kept-alive connection are all answered, in order."""
    ok = json.dumps(C()).encode()
    data = (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
            + head(Content_Length=5) + b"{bad}"
            + head(Content_Length=len(ok)) + ok
            + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server["port"]), timeout=TIMEOUT_S) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", received) == [b"200", b"400", b"200", b"200"]


def test_burst_of_32_clients_all_served(server):
    """32 clients connecting at once, 3 requests each on fresh connections: all 96 answered 200 with the T=0 text."""
    port, body = server["port"], C(temperature=0, max_tokens=4)
    status, _, data = request(port, "POST", CP, body)
    assert status == 200
    reference = json.loads(data)["choices"][0]["text"]
    start, results, lock = threading.Barrier(32), [], threading.Lock()

    def client():
        start.wait()
        for _ in range(3):
            try:
                status, _, data = request(port, "POST", CP, body)
                out = (status, json.loads(data)["choices"][0]["text"] if status == 200 else data[:200])
            except OSError as exc:
                out = (type(exc).__name__, str(exc))
            with lock:
                results.append(out)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(32)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "the burst did not finish within 60 s"
    failed = [r for r in results if r != (200, reference)]
    assert len(results) == 96 and not failed, f"{len(failed)} of 96 failed, e.g. {failed[:3]}"


def _leave(port: int, data: bytes, reset: bool) -> None:
    """Connect, send ``data``, and go: a plain close, or a reset (SO_LINGER 0)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
    sock.sendall(data)
    if reset:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _metric(port: int, name: str) -> float:
    text = request(port, "GET", "/metrics")[2].decode()
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE).group(1))


def test_clients_that_leave_mid_request(server):
    """Half a body, half the headers, or a whole request then gone: no traceback, an info event, no slot kept."""
    port, log = server["port"], server["log"]
    before = log.read_text().count('"client_gone"')
    cancelled = 'draftflow_requests_total{finish_reason="cancelled"}'
    cancelled_before, tokens_before = _metric(port, cancelled), _metric(port, "draftflow_generation_tokens_total")
    body = json.dumps(C(max_tokens=1000, ignore_eos=True, temperature=0)).encode()
    for reset in (False, True):
        _leave(port, head(Content_Length=len(body)) + body[: len(body) // 2], reset)  # half the body
        _leave(port, head(Content_Length=len(body))[:40], reset)  # half the headers
        _leave(port, head(Content_Length=len(body)) + body, reset)  # the whole request, then gone before the answer
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (_metric(port, "draftflow_requests_running")
                                           or _metric(port, "draftflow_requests_waiting")):
        time.sleep(0.05)
    assert _metric(port, "draftflow_requests_running") == 0 and _metric(port, "draftflow_requests_waiting") == 0
    # the whole requests (1000 tokens each) stopped early; one reset before it was read may never have started
    assert _metric(port, cancelled) > cancelled_before
    assert _metric(port, "draftflow_generation_tokens_total") - tokens_before < 1000
    assert request(port, "POST", CP, C())[0] == 200
    while time.monotonic() < deadline and log.read_text().count('"client_gone"') == before:
        time.sleep(0.05)
    text = log.read_text()
    assert "Traceback" not in text and "Exception occurred" not in text, text[-3000:]
    assert text.count('"client_gone"') > before  # the reset clients, at info (shown with -v)


def test_server_log_has_no_traceback(server):
    """After every case above, the server's log holds no traceback: none of them was a server error."""
    assert healthy(server["port"])
    text = server["log"].read_text()
    assert "Traceback" not in text and '"level": "error"' not in text, text[-3000:]


def test_taken_port_is_one_line_before_loading(tmp_path):
    """`serve --port P` with P already listening: one `error:` line naming the port, before the model loads."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "draftflow", "serve", str(GRAPH), "--port", str(port)],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr == f"error: cannot listen on 127.0.0.1:{port}: the address is already in use (another server?); " \
                       "stop it or choose another --port\n"
    assert "checked" not in r.stderr and time.monotonic() - start < 30


def test_every_5xx_is_logged_with_its_exception(monkeypatch):
    """A bug in the worker or in a handler answers 500 and logs the exception's type, message and traceback;
    a DraftflowError for one request is a 400 with its message; a client that stalls mid-body is dropped."""
    import io

    import structlog

    from draftflow.core.errors import RequestError
    from draftflow.core.server import DraftflowServer, Handler, ServeConfig
    from draftflow.core.serving import Engine
    from draftflow.core.session import Session
    from draftflow.core.tracing import configure_logging

    saved = structlog.get_config()
    logs = io.StringIO()
    monkeypatch.setattr(sys, "stderr", logs)
    configure_logging(json_lines=True)  # as `draftflow serve` logs when stderr is not a terminal
    session = Session.open(graph_path=GRAPH)
    engine = Engine(session, max_waiting=4)
    server = DraftflowServer(ServeConfig(port=0, model_names=(MODEL,)), engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        def fail(exc):
            def raiser(*args, **kwargs):
                raise exc
            return raiser

        monkeypatch.setattr(engine.executor, "step", fail(RuntimeError("boom in step")))
        status, _, body = request(port, "POST", CP, C(), key=None)
        assert status == 500 and "RuntimeError: boom in step" in json.loads(body)["error"]["message"]
        monkeypatch.setattr(engine.executor, "step", fail(RequestError("the prompt is too long for X")))
        status, _, body = request(port, "POST", CP, C(), key=None)
        assert (status, json.loads(body)["error"]["message"]) == (400, "the prompt is too long for X")
        monkeypatch.setattr(server.api, "parse", fail(RequestError("sampling: top_k is wrong")))
        status, _, body = request(port, "POST", CP, C(), key=None)
        assert (status, json.loads(body)["error"]["message"]) == (400, "sampling: top_k is wrong")
        monkeypatch.setattr(server.api, "parse", fail(KeyError("bug in parse")))
        status, _, body = request(port, "POST", CP, C(), key=None)
        assert status == 500 and "KeyError: 'bug in parse'" in json.loads(body)["error"]["message"]
        assert healthy(port)
        monkeypatch.setattr(Handler, "timeout", 0.3)  # IDLE_TIMEOUT_S, shortened
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as stalled:
            stalled.sendall(head(Content_Length=100) + b'{"model": ')  # half a body, then silence
            start = time.monotonic()
            assert stalled.recv(100) == b"" and time.monotonic() - start < 5  # the server hung up on it
    finally:
        server.shutdown()
        server.server_close()
        engine.close()
        session.close()
        structlog.configure(**saved)
    events = [json.loads(line) for line in logs.getvalue().splitlines() if line.startswith("{")]
    failed = [e for e in events if e.get("event") == "request_failed"]
    assert [e["error"] for e in failed] == ["RuntimeError: boom in step", "KeyError: 'bug in parse'"], events
    for event in failed:
        assert event["status"] == 500 and event["level"] == "error"
        assert event["exception"].startswith("Traceback") and "in raiser" in event["exception"], event
