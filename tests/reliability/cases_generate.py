"""Bad and odd inputs of `draftflow generate` (and `serve --threads`): flags, prompts, traces, paths.

Most fail on the flags alone, before torch or a model loads; the rest run the shipped demo
model (a few seconds on a CPU).
"""

import json
import subprocess
import sys
from pathlib import Path

from harness import DEMO, GRAPHS, Case, copy_demo, env_for

DEMO_GRAPH = "{demo}/demo.yaml"
PROMPT = "def fibonacci(n):"
# The demo graph with absolute model paths, for cases that copy or move the graph file.
GRAPH = (DEMO / "demo.yaml").read_text().replace("path: ./", "path: {demo}/")
# The demo graph whose target path is a placeholder, as in docs/examples/draftflow-bigram/bigram.yaml.
PLACEHOLDER_GRAPH = GRAPH.replace("{demo}/target", "PATH/TO/MODEL")


def _gen(*argv, new="4"):
    return ["generate", *argv, "--max-new-tokens", new]


def _nan_target(tmp: Path) -> None:
    """A copy of the demo target whose every weight is NaN."""
    import torch
    from safetensors.torch import load_file, save_file

    dest = copy_demo(tmp, "target")
    weights = load_file(dest / "model.safetensors")
    save_file({k: torch.full_like(v, float("nan")) for k, v in weights.items()}, dest / "model.safetensors")


def _old_trace(tmp: Path) -> None:
    (tmp / "t.jsonl").write_text(json.dumps({"event": "request_done", "request_id": "old-run"}) + "\n")


def _trace_replaced(r, tmp: Path) -> None:
    lines = (tmp / "t.jsonl").read_text().splitlines()
    assert lines and "old-run" not in lines[0], "an existing trace is truncated, not appended to"
    assert json.loads(lines[-1])["event"] == "request_done"


def _trace_written(r, tmp: Path) -> None:
    assert json.loads((tmp / "t.jsonl").read_text().splitlines()[0])["event"] == "draft_cycle"


def _run(tmp: Path, *argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftflow", *argv], capture_output=True, text=True, cwd=tmp,
                          env=env_for(Case("-", [])), timeout=90)


def _echoes_prompt(r, tmp: Path) -> None:
    """stdout is exactly the prompt followed by --json's text (the continuation)."""
    j = _run(tmp, "generate", PROMPT, "--max-new-tokens", "24", "--json")
    assert r.stdout == PROMPT + json.loads(j.stdout)["text"], (r.stdout, j.stdout)


def _stream_matches(r, tmp: Path) -> None:
    """--stream prints the same bytes as a plain run, only earlier."""
    plain = _run(tmp, "generate", PROMPT, "--max-new-tokens", "24")
    assert r.stdout == plain.stdout and r.stdout.startswith(PROMPT) and len(r.stdout) > len(PROMPT), (r.stdout, plain.stdout)


def _unicode_echo(r, tmp: Path) -> None:
    assert r.stdout.startswith("héllo 🙂 世界") and "\ufffd" not in r.stdout[:12], r.stdout


def _ids_echo(r, tmp: Path) -> None:
    """--prompt-ids with a tokenizer: the prompt is echoed as its decoded text."""
    j = _run(tmp, "generate", "--prompt-ids", "325,285,73", "--max-new-tokens", "4", "--json")
    out = json.loads(j.stdout)
    assert r.stdout.endswith(out["text"]) and len(r.stdout) > len(out["text"]), (r.stdout, out)


def _json_unchanged(r, tmp: Path) -> None:
    out = json.loads(r.stdout)
    assert set(out) == {"text", "token_ids", "prompt_token_ids", "finish_reason", "stats"} and len(out["token_ids"]) == 4


def _logprobs_json(r, tmp: Path) -> None:
    """--logprobs 2 --json: one {id, token, logprob, top} row per output token, the token texts adding up to the text."""
    out = json.loads(r.stdout)
    rows = out["logprobs"]
    assert [row["id"] for row in rows] == out["token_ids"] and "".join(row["token"] for row in rows) == out["text"]
    assert all(len(row["top"]) == 2 and row["logprob"] <= 0 for row in rows), rows


def _schema_valid(r, tmp: Path) -> None:
    doc = json.loads(json.loads(r.stdout)["text"])
    assert doc in ({"c": "red"}, {"c": "green"}), doc


SCHEMA = '{"type": "object", "properties": {"c": {"enum": ["red", "green"]}}, "required": ["c"], "additionalProperties": false}'


def _nested_graph(tmp: Path) -> None:
    copy_demo(tmp, "target")
    copy_demo(tmp, "dflash")
    sub = tmp / "sub"
    sub.mkdir()
    (sub / "g.yaml").write_text(PLACEHOLDER_GRAPH.replace("{demo}", str(DEMO)))


CASES = [
    # --- sampling flags: refused before the model loads, naming the field -----------------
    Case("gen-temperature-nan", _gen(PROMPT, "--temperature", "nan"), r"'temperature' is nan; it must be a finite number >= 0"),
    Case("gen-temperature-inf", _gen(PROMPT, "--temperature", "inf"), r"'temperature' is inf"),
    Case("gen-temperature-negative", _gen(PROMPT, "--temperature=-0.5"), r"'temperature' is -0\.5"),
    Case("gen-temperature-word", _gen(PROMPT, "--temperature", "hot"), r"--temperature: invalid float value", exit=2),
    Case("gen-top-p-zero", _gen(PROMPT, "--temperature", "1", "--top-p", "0"), r"'top_p' is 0\.0; it must be a number in \(0, 1\]"),
    Case("gen-top-p-above-one", _gen(PROMPT, "--top-p", "1.5"), r"'top_p' is 1\.5"),
    Case("gen-top-p-nan", _gen(PROMPT, "--top-p", "nan"), r"'top_p' is nan"),
    Case("gen-top-k-negative", _gen(PROMPT, "--top-k=-1"), r"'top_k' is -1; it must be an integer >= 0"),
    Case("gen-max-new-tokens-zero", _gen(PROMPT, new="0"), r"'max_new_tokens' is 0"),
    Case("gen-max-new-tokens-negative", _gen(PROMPT, new="-3"), r"'max_new_tokens' is -3"),
    Case("gen-max-new-tokens-huge", _gen(PROMPT, new="1000000000000"), r"'max_new_tokens' is 1000000000000; it must be an integer in"),
    Case("gen-max-new-tokens-past-context", _gen(PROMPT, new="100000"),
         r"max_new_tokens \(100000\) = \d+ exceeds the context of 1024 tokens"),  # the shipped demo's
    Case("gen-seed-huge", _gen(PROMPT, "--seed", "100000000000000000000000"), r"'seed' is 100000000000000000000000; it must be an integer in \[0, "),
    Case("gen-seed-negative", _gen(PROMPT, "--seed=-1"), r"'seed' is -1"),
    Case("gen-seed-word", _gen(PROMPT, "--seed", "abc"), r"--seed: invalid int value", exit=2),
    Case("gen-seed-max", _gen(PROMPT, "--seed", str(2**63 - 1), "--temperature", "1"), r"\[4 tokens", exit=0),
    # --- logit processors, structured output, logprobs ---------------------------------------
    Case("gen-presence-penalty-three", _gen(PROMPT, "--presence-penalty", "3"),
         r"'presence_penalty' is 3\.0; it must be a number in \[-2, 2\]"),
    Case("gen-frequency-penalty-nan", _gen(PROMPT, "--frequency-penalty", "nan"), r"'frequency_penalty' is nan"),
    Case("gen-repetition-penalty-zero", _gen(PROMPT, "--repetition-penalty", "0"),
         r"'repetition_penalty' is 0\.0; it must be a number in \(0, 100\]"),
    Case("gen-repetition-penalty-word", _gen(PROMPT, "--repetition-penalty", "lots"),
         r"--repetition-penalty: invalid float value", exit=2),
    Case("gen-min-p-two", _gen(PROMPT, "--min-p", "2"), r"'min_p' is 2\.0; it must be a number in \[0, 1\]"),
    Case("gen-logit-bias-no-equals", _gen(PROMPT, "--logit-bias", "42"),
         r"--logit-bias '42': expected ID=BIAS\[,ID=BIAS\.\.\.\]"),
    Case("gen-logit-bias-word-id", _gen(PROMPT, "--logit-bias", "the=5"), r"--logit-bias 'the=5': expected ID=BIAS"),
    Case("gen-logit-bias-word-bias", _gen(PROMPT, "--logit-bias", "42=up"), r"--logit-bias '42=up': expected"),
    Case("gen-logit-bias-trailing-comma-item", _gen(PROMPT, "--logit-bias", "42=1,=3"), r"--logit-bias '42=1,=3'"),
    Case("gen-logit-bias-200", _gen(PROMPT, "--logit-bias", "42=200"), r"'logit_bias' is .*numbers in \[-100, 100\]"),
    Case("gen-logit-bias-outside-vocab", _gen(PROMPT, "--logit-bias", "99999=1"),
         r"'logit_bias' names token id 99999, outside the vocabulary \[0, \d+\)"),
    Case("gen-json-schema-missing", _gen(PROMPT, "--json-schema", "{tmp}/none.json"),
         r"--json-schema .*none\.json: no such file"),
    Case("gen-json-schema-directory", _gen(PROMPT, "--json-schema", "{tmp}"), r"--json-schema .*: cannot read it"),
    Case("gen-json-schema-not-json", _gen(PROMPT, "--json-schema", "s.json"), r"--json-schema s\.json: not valid JSON",
         files={"s.json": "{nope"}),
    Case("gen-json-schema-array", _gen(PROMPT, "--json-schema", "s.json"), r"a JSON schema is an object .*not list",
         files={"s.json": "[1, 2]"}),
    Case("gen-json-schema-bad-type", _gen(PROMPT, "--json-schema", "s.json"), r"'grammar' \(json_schema\): .*no-such-type",
         files={"s.json": '{"type": "no-such-type"}'}),
    Case("gen-regex-unclosed", _gen(PROMPT, "--regex", "(ab"), r"'grammar' \(regex\): invalid regex"),
    Case("gen-regex-empty", _gen(PROMPT, "--regex", ""), r"--regex is empty"),
    Case("gen-two-grammars", _gen(PROMPT, "--json-object", "--regex", "a+"), r"--json-object and --regex each constrain"),
    Case("gen-logprobs-21", _gen(PROMPT, "--logprobs", "21"), r"'logprobs' is 21; it must be an integer in \[0, 20\]"),
    Case("gen-logprobs-json", _gen(PROMPT, "--logprobs", "2", "--json"), r'"logprobs": \[', exit=0, check=_logprobs_json),
    Case("gen-json-schema-file", ["generate", PROMPT, "--json-schema", "s.json", "--max-new-tokens", "40", "--json"],
         r'"finish_reason": "stop"', exit=0, files={"s.json": SCHEMA}, check=_schema_valid),
    # --- prompts ---------------------------------------------------------------------------
    Case("gen-no-prompt", ["generate"], r"no prompt: pass PROMPT, --prompt TEXT or --prompt-ids"),
    Case("gen-prompt-twice", _gen(PROMPT, "--prompt", "x"), r"give the prompt once"),
    Case("gen-prompt-and-ids", _gen(PROMPT, "--prompt-ids", "1,2"), r"give the prompt once: either text .* or --prompt-ids"),
    Case("gen-prompt-empty", _gen(""), r"the prompt is empty"),
    Case("gen-prompt-not-utf8", _gen("\udcff\udcfeabc"), r"the prompt is not valid text: character 0 is the byte 0xff"),
    Case("gen-prompt-huge", _gen("x" * 100_000), r"prompt \(\d+ tokens\) \+ max_new_tokens \(4\) = \d+ exceeds the context"),
    Case("gen-prompt-unicode", _gen("héllo 🙂 世界"), r"\[4 tokens", exit=0, check=_unicode_echo),
    Case("gen-prompt-ids-only-commas", _gen("--prompt-ids", ",,"), r"--prompt-ids ',,': no token ids"),
    Case("gen-prompt-ids-negative", _gen("--prompt-ids=-5,1"), r"--prompt-ids: -5 is not a token id"),
    Case("gen-prompt-ids-huge", _gen("--prompt-ids", "1," + "9" * 30), r"--prompt-ids: 9{30} is not a token id"),
    Case("gen-prompt-ids-out-of-vocab", _gen("--prompt-ids", "1,99999"), r"prompt token id 99999 is outside the vocabulary \[0, 8192\)"),
    Case("gen-prompt-ids-echoed", _gen("--prompt-ids", "325,285,73"), r"\[4 tokens", exit=0, check=_ids_echo),
    # --- output: the prompt is echoed, --stream prints the same text, --json is unchanged ---
    Case("gen-echo-prompt", ["generate", PROMPT, "--max-new-tokens", "24"], r"\[24 tokens", exit=0, check=_echoes_prompt),
    Case("gen-stream", ["generate", PROMPT, "--max-new-tokens", "24", "--stream"], r"\[24 tokens", exit=0, check=_stream_matches),
    Case("gen-json-unchanged", _gen(PROMPT, "--json"), r'"finish_reason": "length"', exit=0, check=_json_unchanged),
    Case("gen-stream-and-json", _gen(PROMPT, "--stream", "--json"), r"--stream .* --json .*; choose one"),
    # --- --trace: never onto an input, a directory or into a missing folder ----------------
    Case("gen-trace-onto-graph", _gen(PROMPT, "--graph", "{tmp}/g.yaml", "--trace", "{tmp}/g.yaml"),
         r"--trace .*g\.yaml: is the graph file, which this run reads", files={"g.yaml": GRAPH}),
    Case("gen-trace-onto-graph-relative", _gen(PROMPT, "--graph", "g.yaml", "--trace", "./g.yaml"),
         r"--trace .*g\.yaml: is the graph file", files={"g.yaml": GRAPH}),
    Case("gen-trace-inside-model-folder", _gen(PROMPT, "--target", "{tmp}/target", "--trace", "{tmp}/target/t.jsonl"),
         r"--trace .*t\.jsonl: is inside node 'target' param 'path' \(.*target\), which this run reads",
         setup=lambda tmp: copy_demo(tmp, "target")),
    Case("gen-trace-onto-model-file", _gen(PROMPT, "--target", "{tmp}/target", "--trace", "{tmp}/target/model.safetensors"),
         r"model\.safetensors: (is inside node 'target'|.* exists and is not a draftflow trace)",
         setup=lambda tmp: copy_demo(tmp, "target")),
    Case("gen-trace-onto-other-file", _gen(PROMPT, "--trace", "{tmp}/notes.txt"),
         r"notes\.txt exists and is not a draftflow trace; refusing to overwrite it", files={"notes.txt": "my notes\n"}),
    Case("gen-trace-directory", _gen(PROMPT, "--trace", "{tmp}"), r"--trace .*: is a directory; name a file in it"),
    Case("gen-trace-missing-folder", _gen(PROMPT, "--trace", "{tmp}/no/such/t.jsonl"),
         r"--trace .*t\.jsonl: the folder .*no/such does not exist"),
    Case("gen-trace-replaces-old-trace", _gen(PROMPT, "--trace", "t.jsonl"), r"\[4 tokens", exit=0, setup=_old_trace,
         outputs=["t.jsonl"], check=_trace_replaced),
    Case("gen-trace-relative", _gen(PROMPT, "--trace", "t.jsonl"), r"\[4 tokens", exit=0, outputs=["t.jsonl"],
         check=_trace_written),
    # --- graph, shortcuts and paths ----------------------------------------------------------
    Case("gen-graph-plus-shortcut", _gen(PROMPT, "--graph", DEMO_GRAPH, "--lookup"), r"drafter shortcut flags .* use them without --graph"),
    Case("gen-graph-missing", _gen(PROMPT, "--graph", "{tmp}/none.yaml"), r"none\.yaml"),
    Case("gen-graph-relative-target", _gen(PROMPT, "--graph", "sub/g.yaml", "--target", "target"), r"\[4 tokens", exit=0,
         setup=_nested_graph),
    Case("gen-shortcut-relative-target", _gen(PROMPT, "--target", "target"), r"\[4 tokens", exit=0,
         setup=lambda tmp: copy_demo(tmp, "target")),
    Case("gen-target-missing", _gen(PROMPT, "--target", "nope"), r"node 'target' .*/nope: no such model", lines=2),
    Case("gen-target-not-a-model", _gen(PROMPT, "--target", "{tmp}/empty"), r"empty/config\.json: file is missing", lines=2,
         files={"empty/README": "not a model"}),
    Case("gen-target-empty-string", _gen(PROMPT, "--target", ""), r"--target is empty; give a path"),
    Case("gen-dflash-not-a-drafter", _gen(PROMPT, "--target", str(DEMO / "target"), "--dflash", "{tmp}/empty"),
         r"node 'dflash' .*empty/config\.json", lines=2, files={"empty/README": "x"}),
    Case("gen-mtp-missing", _gen(PROMPT, "--target", str(DEMO / "target"), "--mtp", "nope"), r"node 'mtp' .*/nope", lines=2),
    Case("gen-spec-zero", _gen(PROMPT, "--spec", "0"), r"\[4 tokens", exit=0),
    Case("gen-spec-negative", _gen(PROMPT, "--spec=-1"), r"num_draft must be an integer from 0 to 64, got -1"),
    Case("gen-spec-huge", _gen(PROMPT, "--spec", "100000"), r"num_draft must be an integer from 0 to 64, got 100000"),
    Case("gen-dtype-float16-cpu", _gen(PROMPT, "--dtype", "float16"), r"\[4 tokens", exit=0),
    Case("gen-device-cuda", _gen(PROMPT, "--device", "cuda"), r"device 'cuda' needs CUDA", lines=2),
    Case("gen-device-cuda-99", _gen(PROMPT, "--device", "cuda:99"), r"device 'cuda:99' (needs CUDA|.*)", lines=2),
    Case("gen-nan-weights", _gen(PROMPT, "--target", "{tmp}/target"),
         r"node 'target' \(target, .*/target\) produced NaN or infinite logits for the prompt", setup=_nan_target),
    # --- threads ---------------------------------------------------------------------------
    Case("gen-threads-zero", _gen(PROMPT, "--threads", "0"), r"--threads 0: it must be at least 1"),
    Case("gen-threads-two", _gen(PROMPT, "--threads", "2"), r"2 threads", exit=0),
    Case("gen-default-threads-small-target", _gen(PROMPT, "--graph", DEMO_GRAPH), r"1 thread,", exit=0),  # 4 MB target
    Case("gen-serve-threads-zero", ["serve", DEMO_GRAPH, "--threads", "0"], r"--threads 0: it must be at least 1"),
]
