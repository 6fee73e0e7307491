"""The CLI end to end: exit codes, one-line errors, the generate --json contract."""

from __future__ import annotations

import json
import re

import toy_plugins
from helpers import FIXTURES, run_cli


def test_check_prints_plan_and_draws(toy_env, tmp_path):
    """`check` prints order, buffers and the VRAM table, exits 0, and --draw writes a PNG."""
    out = tmp_path / "g.png"
    r = run_cli(["check", FIXTURES / "good_toy.yaml", "--draw", out], env=toy_env)
    assert r.returncode == 0, r.stderr
    assert "execution order: drafter [toy-drafter, drafter] -> target [toy-target, target] -> verify" in r.stdout
    assert "toy_kv  target" in r.stdout and "VRAM plan" in r.stdout and "KV cache: 512 tokens" in r.stdout
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_check_reports_every_problem_and_exits_1(toy_env):
    """`check` on a broken graph prints all problems, no traceback, exit 1."""
    r = run_cli(["check", FIXTURES / "many_problems.yaml"], env=toy_env)
    assert r.returncode == 1
    assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    assert "[unknown-plugin]" in r.stderr and "[incompatible]" in r.stderr and "[capability]" in r.stderr


def test_user_errors_are_one_line(toy_env, tmp_path):
    """Malformed YAML, a missing file and bad prompt ids: one line, exit 1, no traceback."""
    for args in (["check", FIXTURES / "malformed.yaml"], ["check", tmp_path / "nope.yaml"],
                 ["generate", "--graph", FIXTURES / "good_toy.yaml", "--prompt-ids", "1,x"],
                 ["generate", "--graph", FIXTURES / "good_toy.yaml", "--prompt", "hello"],
                 ["trace", "summarize", tmp_path / "none.jsonl"]):
        r = run_cli(args, env=toy_env)
        assert r.returncode == 1, (args, r.stderr)
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr


def test_generate_takes_the_graphs_per_device_settings(toy_env, tmp_path):
    """A graph's per_device.cpu reaches a CPU run through the CLI; --spec still wins; a bad section exits 1 in one line."""
    graph = tmp_path / "g.yaml"
    graph.write_text(f"extends: {FIXTURES / 'good_toy.yaml'}\nper_device:\n  cpu: {{num_draft: 2}}\n  cuda: {{num_draft: 9}}\n")
    for extra, k in (([], 2), (["--spec", "4"], 4)):
        r = run_cli(["generate", "--graph", graph, "--prompt-ids", "1,2,3", "--max-new-tokens", "12", "--json", *extra], env=toy_env)
        assert r.returncode == 0, r.stderr
        assert len(json.loads(r.stdout)["stats"]["per_position_acceptance"]) == k
    r = run_cli(["check", graph], env=toy_env)
    assert r.returncode == 0 and "num_draft 2\nper_device cpu: num_draft=2\n" in r.stdout, r.stdout
    graph.write_text(f"extends: {FIXTURES / 'good_toy.yaml'}\nper_device:\n  tpu: {{num_draft: 2}}\n")
    r = run_cli(["check", graph], env=toy_env)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "g.yaml:3:3: per_device: 'tpu' is not a device kind" in r.stderr, r.stderr


def test_usage_error_exits_2(toy_env):
    """An unknown flag is a usage error (exit 2)."""
    assert run_cli(["generate", "--no-such-flag"], env=toy_env).returncode == 2


def test_generate_json_contract(toy_env, tmp_path):
    """generate --json prints the documented object; --trace and trace summarize agree with it."""
    trace = tmp_path / "t.jsonl"
    r = run_cli(["generate", "--graph", FIXTURES / "good_toy.yaml", "--prompt-ids", "1,2,3", "--max-new-tokens", "16",
                 "--json", "--trace", trace, "--spec", "4"], env=toy_env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"text", "token_ids", "prompt_token_ids", "finish_reason", "stats"}
    assert set(out["stats"]) == {"cycles", "drafted", "accepted", "tau", "acceptance_rate", "per_position_acceptance", "tokens_per_s", "ttft_s",
                                 "prefill_ms", "load_s", "warmup_s"}
    assert out["stats"]["load_s"] > 0 and out["stats"]["warmup_s"] >= 0 and out["stats"]["prefill_ms"] > 0
    assert out["text"] is None and out["prompt_token_ids"] == [1, 2, 3] and out["finish_reason"] == "length"
    assert out["token_ids"] == toy_plugins.reference([1, 2, 3], 16, 32)
    assert len(out["stats"]["per_position_acceptance"]) == 4
    s = run_cli(["trace", "summarize", trace, "--json", "--plot", tmp_path / "p.png"], env=toy_env)
    assert s.returncode == 0, s.stderr
    assert json.loads(s.stdout)["tau"] == out["stats"]["tau"]


def test_plugins_lists_origin(toy_env):
    """`plugins` lists node types with role, plugin, version and origin."""
    r = run_cli(["plugins"], env=toy_env)
    assert r.returncode == 0
    line = next(l for l in r.stdout.splitlines() if l.startswith("verifier "))
    assert "verifier" in line and "builtin_verifier" in line and "built-in" in line
    assert any(l.startswith("toy-target") and "DRAFTFLOW_PLUGINS" in l for l in r.stdout.splitlines())


def test_generate_processor_flags_reach_the_engine(tmp_path):
    """The penalty, bias, min-p, grammar and --logprobs flags give Session.generate's result with those
    SamplingParams, speculative (the shipped default graph) as target-only; plain mode prints a logprob line per token."""
    from helpers import ROOT

    from draftflow.core.node import GrammarSpec, SamplingParams
    from draftflow.core.session import Session

    graph = ROOT / "graphs" / "default.yaml"
    schema = {"type": "object", "properties": {"c": {"enum": ["red", "green"]}}, "required": ["c"],
              "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    runs = [(["--repetition-penalty", "1.3", "--presence-penalty", "0.5", "--frequency-penalty", "0.4",
              "--logit-bias", "457=-100,85=3", "--logprobs", "2"],
             dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, logit_bias={457: -100, 85: 3},
                  logprobs=2)),
            (["--temperature", "1", "--seed", "3", "--min-p", "0.2", "--json-schema", tmp_path / "s.json"],
             dict(temperature=1.0, seed=3, min_p=0.2, grammar=GrammarSpec("json_schema", json.dumps(schema))))]
    session = Session.open(graph_path=graph, overrides=["num_draft=0"])
    try:
        for flags, fields in runs:
            r = run_cli(["generate", "--graph", graph, "--prompt", "def fib(n):", "--max-new-tokens", "12", "--json",
                         *flags])
            assert r.returncode == 0, r.stderr
            out = json.loads(r.stdout)
            ref = session.generate(out["prompt_token_ids"], SamplingParams(max_new_tokens=12, **fields))
            if fields.get("temperature"):  # sampled: the speculative sample is the in-process speculative one
                spec = Session.open(graph_path=graph)
                ref = spec.generate(out["prompt_token_ids"], SamplingParams(max_new_tokens=12, **fields))
                spec.close()
                json.loads(out["text"])
            assert out["token_ids"] == list(ref.token_ids)
            if "logprobs" in fields:
                assert [row["logprob"] for row in out["logprobs"]] == [t.logprob for t in ref.logprobs]
                assert [[a["id"] for a in row["top"]] for row in out["logprobs"]] == [[t for t, _ in x.top]
                                                                                    for x in ref.logprobs]
    finally:
        session.close()
    plain = run_cli(["generate", "--graph", graph, "--prompt", "def fib(n):", "--max-new-tokens", "5", "--logprobs", "1"])
    assert plain.returncode == 0, plain.stderr
    lines = plain.stdout.splitlines()[-5:]
    assert [line.split()[0] for line in lines] == ["0", "1", "2", "3", "4"] and all(" | " in line for line in lines)


def test_generate_summary_names_the_dtype_it_ran():
    """The summary line says which dtype ran: float32 by default, the --dtype override when given."""
    from helpers import ROOT

    for flags, dtype in (([], "float32"), (["--dtype", "bfloat16"], "bfloat16")):
        r = run_cli(["generate", "--graph", ROOT / "graphs" / "default.yaml", "--prompt-ids", "1,2,3",
                     "--max-new-tokens", "4", *flags])
        assert r.returncode == 0, r.stderr
        assert re.search(rf" tok/s(, \d+ threads?)?, {dtype}, finish: length\]", r.stderr), r.stderr


def test_an_inherited_path_is_relative_to_the_file_that_wrote_it(tmp_path):
    """A graph in another folder that extends a shipped one finds the base's models (its paths are relative to the
    base file); a path the child writes itself is relative to the child."""
    from helpers import ROOT

    child = tmp_path / "mine.yaml"
    child.write_text(f"extends: {ROOT / 'graphs' / 'demo-dflash.yaml'}\nnum_draft: 7\n")
    r = run_cli(["check", child])
    assert r.returncode == 0 and "num_draft 7" in r.stdout, r.stderr
    child.write_text(f"extends: {ROOT / 'graphs' / 'demo-dflash.yaml'}\nnodes:\n  target:\n    params: {{path: my/target}}\n")
    r = run_cli(["check", child])
    assert r.returncode == 1 and f"{tmp_path / 'my' / 'target'}: no such model directory" in r.stderr, r.stderr
    assert "models/demo/dflash" not in r.stderr  # the inherited drafter path still resolves
