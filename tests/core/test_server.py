"""`draftflow serve` end to end with the real `openai` client, plus the queue and stop-string units."""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import pytest

from draftflow.core.cli import build_parser, cmd_generate
from helpers import FIXTURES, ROOT, run_cli

openai = pytest.importorskip("openai")

GRAPH = ROOT / "graphs" / "default.yaml"
KEY = "sk-test"
MODEL = "default"


def chatml(user: str) -> str:
    """The tiny model's chat template (graphs/models/tiny-qwen3/tokenizer_config.json), rendered by hand."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


# name -> (`draftflow generate` flags, request fields). "sampled" drafts at temperature 0.2 (rejection sampling).
CASES = {
    "greedy": (["--prompt", "def fib(n):", "--max-new-tokens", "12"],
               {"prompt": "def fib(n):", "max_tokens": 12, "temperature": 0}),
    "sampled": (["--prompt", "def fib(n):", "--max-new-tokens", "12", "--temperature", "0.2", "--top-p", "0.9",
                 "--top-k", "40", "--seed", "7"],
                {"prompt": "def fib(n):", "max_tokens": 12, "temperature": 0.2, "top_p": 0.9, "seed": 7,
                 "extra_body": {"top_k": 40}}),
    "chat": (["--prompt", chatml("Say hi"), "--max-new-tokens", "10"],
             {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 10, "temperature": 0}),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A `draftflow serve` subprocess on a free loopback port, and `draftflow generate --json` outputs for CASES."""
    trace = tmp_path_factory.mktemp("serve") / "trace.jsonl"
    server = subprocess.Popen([sys.executable, "-m", "draftflow", "serve", str(GRAPH), "--port", "0", "--api-key", KEY,
                               "--max-body-bytes", "65536", "--trace", str(trace)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reference = {}
    for case, (flags, _) in CASES.items():  # the `draftflow generate` command itself, in this process meanwhile
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cmd_generate(build_parser().parse_args(["generate", "--graph", str(GRAPH), *flags, "--json"])) == 0
        reference[case] = json.loads(out.getvalue().splitlines()[-1])  # after any unconfigured structlog lines
    try:
        line = server.stdout.readline()
        match = re.search(r"listening on (http://\S+)", line)
        assert match, line + server.stderr.read()
        url = match.group(1)
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        yield {"url": url, "client": client, "reference": reference, "trace": trace}
    finally:
        server.terminate()
        server.wait(timeout=30)


def call(client, case: str, stream: bool = False, **extra):
    """Send CASES[case]; return (text, finish_reason, response or last chunk)."""
    fields = {k: v for k, v in CASES[case][1].items()}
    fields["extra_body"] = {**fields.get("extra_body", {}), **extra.pop("extra_body", {})}
    fields.update(extra)
    api = client.chat.completions if case == "chat" else client.completions
    out = api.create(model=MODEL, stream=stream, **fields)
    if not stream:
        choice = out.choices[0]
        return (choice.message.content if case == "chat" else choice.text), choice.finish_reason, out
    parts, finish, last = [], None, None
    for chunk in out:
        last = chunk
        for choice in chunk.choices:
            parts.append((choice.delta.content or "") if case == "chat" else choice.text)
            finish = choice.finish_reason or finish
    return "".join(parts), finish, last


def metric(url: str, name: str) -> float:
    body = raw(url, "GET", "/metrics")[1]
    return float(re.search(rf"^{re.escape(name)} (\S+)$", body, re.MULTILINE).group(1))


def raw(url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """One plain HTTP request; returns (status, text)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request(method, path, body=body, headers={"Authorization": f"Bearer {KEY}", **(headers or {})})
    resp = conn.getresponse()
    out = resp.status, resp.read().decode()
    conn.close()
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_equal_generate(served, case):
    """Completion and chat, streamed and not, give exactly `draftflow generate`'s text for the same settings and seed."""
    ref = served["reference"][case]
    for stream in (False, True):
        text, finish, _ = call(served["client"], case, stream=stream)
        assert (text, finish) == (ref["text"], ref["finish_reason"]), (case, stream)


def test_sixteen_concurrent_requests(served):
    """16 concurrent requests (mixed kinds, half streamed) all complete with their sequential outputs."""
    jobs = [(case, i % 2 == 1) for i, case in enumerate(list(CASES) * 6)][:16]
    url = served["url"]
    cycles, single = metric(url, "draftflow_batch_size_per_cycle_count"), metric(url, 'draftflow_batch_size_per_cycle_bucket{le="1"}')
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda job: call(served["client"], job[0], stream=job[1]), jobs))
    for (case, _), (text, finish, _) in zip(jobs, results):
        assert (text, finish) == (served["reference"][case]["text"], served["reference"][case]["finish_reason"])
    batched = metric(url, "draftflow_batch_size_per_cycle_count") - cycles - (
        metric(url, 'draftflow_batch_size_per_cycle_bucket{le="1"}') - single)
    assert batched > 0  # cycles that stepped two requests or more


def test_stop_strings_cut_text(served):
    """A stop string ends the text just before it with finish_reason 'stop', streamed or not."""
    ref = served["reference"]["greedy"]["text"]
    stop = ref[5:8]
    for stream in (False, True):
        text, finish, _ = call(served["client"], "greedy", stream=stream, stop=[stop, "never-seen"])
        assert (text, finish) == (ref[:ref.index(stop)], "stop")


def test_spec_stats_are_opt_in(served):
    """return_spec_stats adds the same speculative stats `generate` reports; the drafter runs at temperature > 0."""
    _, _, plain = call(served["client"], "greedy")
    assert "speculative_decoding" not in (plain.model_extra or {})
    keys = ("cycles", "drafted", "accepted", "tau", "per_position_acceptance")
    for case in ("greedy", "sampled"):
        ref = served["reference"][case]["stats"]
        _, _, resp = call(served["client"], case, extra_body={"return_spec_stats": True})
        stats = resp.model_extra["speculative_decoding"]
        assert [stats[k] for k in keys] == [ref[k] for k in keys] and stats["drafted"] > 0
        assert {"acceptance_rate", "ttft_s", "queue_s", "latency_s"} <= set(stats)
        _, _, last = call(served["client"], case, stream=True, extra_body={"return_spec_stats": True})
        assert [last.model_extra["speculative_decoding"][k] for k in keys] == [ref[k] for k in keys]


def test_models_health_metrics_and_trace(served):
    """/v1/models, /health and /metrics answer; every served request's cycles are traced under its id."""
    assert [m.id for m in served["client"].models.list().data] == [MODEL]
    assert raw(served["url"], "GET", "/health") == (200, '{"status": "ok"}')
    _, _, resp = call(served["client"], "greedy")
    body = raw(served["url"], "GET", "/metrics")[1]
    for name in ("draftflow_spec_decode_num_drafts_total", "draftflow_spec_decode_num_draft_tokens_total",
                 "draftflow_spec_decode_num_accepted_tokens_total", 'per_pos_total{position="0"}',
                 "draftflow_request_latency_seconds_bucket", "draftflow_time_to_first_token_seconds_count"):
        assert name in body
    assert metric(served["url"], 'draftflow_requests_total{finish_reason="length"}') >= 1
    events = [json.loads(line) for line in served["trace"].read_text().splitlines()]
    mine = [e for e in events if e["request_id"] == resp.id]
    assert mine[-1]["event"] == "request_done" and sum(e["event"] == "draft_cycle" for e in mine) == mine[-1]["cycles"]


def test_bad_requests_get_json_4xx(served):
    """Malformed JSON 400, oversize body 413, unknown model 404, wrong key 401, bad field 400: all JSON errors."""
    url, client = served["url"], served["client"]
    status, body = raw(url, "POST", "/v1/completions", b'{"model": "default", "prompt": ')
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_json"
    status, body = raw(url, "POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "x" * 70000}).encode())
    assert status == 413 and "the limit is 65536" in json.loads(body)["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-nope", prompt="hi", max_tokens=2)
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="'temperature' must be a finite number >= 0"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=-1)
    admitted = metric(url, "draftflow_queue_time_seconds_count")
    with pytest.raises(openai.BadRequestError, match="exceeds the context of 2048 tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4000)
    assert metric(url, "draftflow_queue_time_seconds_count") == admitted  # refused at once, never admitted
    with pytest.raises(openai.BadRequestError, match=r"'n' must be an integer in \[1, 8\]"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=9)


def test_disconnect_mid_stream_frees_slot(served):
    """A client that drops a long stream cancels it within a cycle; the next request runs and is still exact."""
    client, url = served["client"], served["url"]
    before = metric(url, 'draftflow_requests_total{finish_reason="cancelled"}')
    tokens_before = metric(url, "draftflow_generation_tokens_total")
    stream = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=1900, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.response.close()
    deadline = time.time() + 20
    while metric(url, 'draftflow_requests_total{finish_reason="cancelled"}') == before and time.time() < deadline:
        time.sleep(0.05)
    assert metric(url, 'draftflow_requests_total{finish_reason="cancelled"}') == before + 1
    assert metric(url, "draftflow_requests_running") == 0
    assert metric(url, "draftflow_generation_tokens_total") - tokens_before < 1900
    text, finish, _ = call(client, "greedy")
    assert (text, finish) == (served["reference"]["greedy"]["text"], served["reference"]["greedy"]["finish_reason"])


# --- in-process: queue limit, missing chat template, units ------------------------------------
def test_serve_checks_graph_before_listening(toy_env):
    """`serve` on a broken graph prints every check problem and exits 1 without ever listening."""
    r = run_cli(["serve", FIXTURES / "many_problems.yaml", "--port", "0"], env=toy_env)
    assert r.returncode == 1 and "listening" not in r.stdout
    assert r.stderr.startswith("error: ") and "[unknown-plugin]" in r.stderr and "[capability]" in r.stderr


def test_max_batch_flag(tmp_path):
    """--max-batch sets the graph's max_batch; without it a graph that sets none is served with 'auto'; a bad value is
    one error line before anything loads."""
    from draftflow.core.serve_cli import batch_overrides

    assert batch_overrides(GRAPH, [], None)[-1][1] == "max_batch=auto"
    assert batch_overrides(GRAPH, ["max_batch=3"], None) == ["max_batch=3"]
    assert batch_overrides(GRAPH, ["max_batch=3"], "5")[-1] == ("--max-batch 5", "max_batch=5")
    own = tmp_path / "own.yaml"
    own.write_text(GRAPH.read_text().replace("num_draft: 4", "num_draft: 4\nmax_batch: 2"))
    assert batch_overrides(own, [], None) == []
    r = run_cli(["serve", GRAPH, "--max-batch", "0", "--port", "0"])
    assert (r.returncode, r.stderr) == (1, "error: --max-batch '0': it must be an integer from 1 to 256 or 'auto'\n")


def test_full_queue_answers_503_and_missing_template_400():
    """With the waiting line full a request gets 503; a model without a chat template gets a clear 400."""
    from draftflow.core.server import DraftflowServer, ServeConfig
    from draftflow.core.serving import Engine
    from draftflow.core.session import Session

    session = Session.open(graph_path=GRAPH)
    engine = Engine(session, max_waiting=1, start=False)  # no worker: queued requests stay queued
    server = DraftflowServer(ServeConfig(port=0), engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
        first = threading.Thread(target=lambda: raw(server.url, "POST", "/v1/completions", body), daemon=True)
        first.start()
        while len(engine.queue) < 1:
            time.sleep(0.01)
        u = urlparse(server.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("POST", "/v1/completions", body=body)
        resp = conn.getresponse()
        assert resp.status == 503 and json.loads(resp.read())["error"]["code"] == "queue_full"
        assert resp.getheader("Retry-After") == "1"
        conn.close()
        server.api.chat_template = None
        status, text = raw(server.url, "POST", "/v1/chat/completions",
                           json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode())
        assert status == 400 and "has no chat template" in json.loads(text)["error"]["message"]
    finally:
        server.shutdown()
        server.server_close()
        engine.close()
        session.close()
    first.join(timeout=10)
    assert not first.is_alive()


def test_worker_steps_and_cancels_between_cycles():
    """The worker is no trace sink: a cancel seen after cycle 1 ends the request there; a failing sink is a 500, then the next request is exact."""
    from draftflow.core.hookspecs import hookimpl
    from draftflow.core.node import SamplingParams
    from draftflow.core.serving import Engine, ServeRequest
    from draftflow.core.session import Session

    class Sink:  # cancels its target request from cycle 1 on (only setting a flag); raises on request "boom"
        target, done = None, []

        @hookimpl
        def draftflow_cycle_event(self, event):
            if event["request_id"] == "boom":
                raise RuntimeError("sink failed")
            if self.target is not None and event["request_id"] == self.target.id and event["cycle"] == 1:
                self.target.cancelled.set()

        @hookimpl
        def draftflow_request_event(self, event):
            self.done.append(event)

    def run(engine, req):
        engine.submit(req)
        events = [req.events.get(timeout=60)]
        while events[-1][0] == "delta":
            events.append(req.events.get(timeout=60))
        last = events[-1]  # ("finish", index, reason, info) -> ("finish", reason, info); ("error", status, message)
        return "".join(e[2] for e in events[:-1]), (last[0], *last[2:]) if last[0] == "finish" else last

    session = Session.open(graph_path=GRAPH)
    sink = Sink()
    session.registry.pm.register(sink)
    engine = Engine(session)
    try:
        assert not any(isinstance(p, Engine) for p in session.registry.pm.get_plugins())
        prompt = session.encode("def fib(n):")
        sink.target = ServeRequest("cmpl-a", prompt, SamplingParams(max_new_tokens=300, ignore_eos=True))
        text, (kind, finish, info) = run(engine, sink.target)
        assert (kind, finish, info["stats"]["cycles"]) == ("finish", "cancelled", 2)
        assert sink.done[-1]["finish_reason"] == "cancelled" and sink.done[-1]["tokens"] == info["completion_tokens"]
        expected = session.executor.generate(prompt, SamplingParams(max_new_tokens=info["completion_tokens"], ignore_eos=True))
        assert text == expected.text
        _, (kind, status, message) = run(engine, ServeRequest("boom", prompt, SamplingParams(max_new_tokens=8)))
        assert (kind, status) == ("error", 500) and "sink failed" in message
        text, (kind, finish, info) = run(engine, ServeRequest("cmpl-b", prompt, SamplingParams(max_new_tokens=8)))
        assert (text, finish) == (session.executor.generate(prompt, SamplingParams(max_new_tokens=8)).text, "length")
    finally:
        engine.close()
        session.close()


def test_fair_queue_round_robin():
    """Requests are taken round-robin across client keys, FIFO within one; the limit raises QueueFull."""
    from draftflow.core.node import SamplingParams
    from draftflow.core.fair_queue import FairQueue, QueueFull
    from draftflow.core.serving import ServeRequest

    q = FairQueue(max_waiting=4)
    reqs = [ServeRequest(name, [1], SamplingParams(), client=name[0]) for name in ("a1", "a2", "a3", "b1")]
    for r in reqs:
        q.put(r)
    with pytest.raises(QueueFull, match="the limit is 4"):
        q.put(ServeRequest("c1", [1], SamplingParams(), client="c"))
    assert q.remove(reqs[2]) and not q.remove(reqs[2])
    assert [q.get(0).id for _ in range(3)] == ["a1", "b1", "a2"] and q.get(0) is None


def test_stop_scanner_holds_back_partial_stop():
    """Text that may start a stop string is held back, released when it does not, cut when it does."""
    from draftflow.core.stop_strings import StopScanner

    vocab = {1: "ab", 2: "c#", 3: "#d", 4: "e"}
    s = StopScanner(lambda ids: "".join(vocab[i] for i in ids), ("##",))
    assert s.feed([1]) == ("ab", False)
    assert s.feed([2]) == ("c", False)  # "#" may begin "##"
    assert s.feed([3]) == ("", True)  # "c##d": cut before "##"
    t = StopScanner(lambda ids: "".join(vocab[i] for i in ids), ("##",))
    assert t.feed([2]) == ("c", False) and t.feed([4]) == ("#e", False) and t.flush() == ""


def test_serve_opens_the_graph_on_the_thread_that_decodes(monkeypatch):
    """`draftflow serve` loads and warms the graph up on the engine's worker thread, which then runs every cycle: on the
    CPU each thread running torch's parallel regions has its own OpenMP team, and a main-thread warm-up beside a
    worker that decodes made the demo graph's requests ~1.5x slower (docs/SERVING.md)."""
    from draftflow.core import serve_cli
    from draftflow.core.cli import main
    from draftflow.core.node import SamplingParams
    from draftflow.core.serving import ServeRequest
    from draftflow.plugins.target.plugin import Target

    threads = {"warmup": set(), "step": set()}
    real_warmup, real_step = Target.warmup, Target.step

    def warmup(self):
        threads["warmup"].add(threading.get_ident())
        return real_warmup(self)

    def step(self, batch, inputs):
        threads["step"].add(threading.get_ident())
        return real_step(self, batch, inputs)

    def fake_serve(session, config, ready=None, engine=None):  # serve's engine, one request through it, then stop
        from draftflow.core.serving import Engine

        engine = engine or Engine(session)
        req = ServeRequest(id="t", prompt_ids=[5, 6, 7, 5, 6, 7], sampling=SamplingParams(max_new_tokens=6))
        engine.submit(req)
        while (event := req.events.get(timeout=60))[0] != "finish":
            assert event[0] == "delta", event
        threads["engine"] = engine._thread.ident
        engine.close()

    monkeypatch.setattr(Target, "warmup", warmup)
    monkeypatch.setattr(Target, "step", step)
    monkeypatch.setattr(serve_cli, "serve", fake_serve)
    monkeypatch.setattr(serve_cli.signal, "signal", lambda *args: None)  # leave this process's SIGTERM alone
    assert main(["serve", str(GRAPH), "--port", "0"]) == 0
    assert threads["warmup"] == threads["step"] == {threads["engine"]} != {threading.get_ident()}


def test_a_graph_error_on_the_worker_thread_is_raised_to_serve(tmp_path):
    """The open runs on the worker thread; its error still ends `draftflow serve` as one line, exit 1, no traceback."""
    r = run_cli(["serve", GRAPH, "--port", "0", "--set", "nodes.target.params.path=" + str(tmp_path / "nope")])
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert re.fullmatch(r"error: 1 problem in .*default\.yaml:\n  .*node 'target' .*nope: no such model directory.*\n",
                        r.stderr), r.stderr
