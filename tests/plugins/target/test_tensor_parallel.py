"""Tensor parallelism on the CPU (gloo, 2 processes): a sharded target emits exactly what the whole one emits.

The two ranks are started once for the module (tp_testlib.py runs every scenario at tensor_parallel 1
and 2); one test goes through the public CLI (`generate --tp 2`), which starts its own two ranks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import TESTS, run_cli

from draftflow.core.tp_launch import free_port
from draftflow.tools.convert_gguf import convert_hf_to_gguf
from draftflow.tools.tiny_model import write_tiny_model

sys.path.insert(0, str(TESTS / "plugins" / "dflash"))
from dflash_testlib import BLOCK, agreeing_pair  # noqa: E402

HERE = Path(__file__).resolve().parent
GREEDY = {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True}
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 11, "max_new_tokens": 20, "ignore_eos": True}
PROMPTS = [[3, 4, 5, 6], [10, 11, 12]]


def _graph(target: Path, drafter: Path | None = None, **top) -> dict:
    nodes = {"target": {"plugin": "target", "params": {"path": str(target)}}, "verify": {"plugin": "verifier"}}
    if drafter is not None:
        nodes["target"]["params"]["tap_layers"] = [1, 2]
        nodes["drafter"] = {"plugin": "dflash", "params": {"path": str(drafter)}}
    return {"name": "tp", "max_context": 128, **top, "nodes": nodes}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    target, drafter = agreeing_pair(root)
    dense = write_tiny_model(root / "dense", vocab=300, intermediate=96, corpus=["tensor parallel"] * 4)
    convert_hf_to_gguf(dense, root / "dense-q8_0.gguf", "q8_0")
    return {"gguf": root / "dense-q8_0.gguf",
            "dense": dense,
            "moe": write_tiny_model(root / "moe", vocab=301, experts=8, top_k=2),  # odd: the head's last slice is short
            "hybrid": write_tiny_model(root / "hybrid", vocab=300, layers=4, hybrid=True, corpus=["tensor parallel"] * 4),
            "target": target, "drafter": drafter, "root": root}


@pytest.fixture(scope="module")
def results(models):
    """Every scenario at tensor_parallel 1 and 2, from one pair of gloo ranks."""
    dflash = _graph(models["target"], models["drafter"], num_draft=BLOCK - 1)
    scenarios = {
        "dense": {"graph": _graph(models["dense"]), "prompts": PROMPTS, "sampling": GREEDY},
        "dense_sampled": {"graph": _graph(models["dense"]), "prompts": PROMPTS, "sampling": {**SAMPLED, "logprobs": 2},
                          "overrides": ["nodes.target.kv_mode=grow"]},
        "dense_batched": {"graph": _graph(models["dense"], max_batch=2), "prompts": PROMPTS, "sampling": GREEDY,
                          "together": True},
        "gguf": {"graph": _graph(models["gguf"]), "prompts": PROMPTS, "sampling": GREEDY},
        "target_only": {"graph": _graph(models["target"]), "prompts": PROMPTS, "sampling": GREEDY},
        "dflash": {"graph": dflash, "prompts": PROMPTS, "sampling": GREEDY},
        "dflash_sampled": {"graph": dflash, "prompts": PROMPTS, "sampling": SAMPLED},
        "dflash_policy": {"graph": {**dflash, "nodes": {**dflash["nodes"], "policy": {"plugin": "adaptive_k"}}},
                          "prompts": PROMPTS, "sampling": GREEDY},
        "moe": {"graph": _graph(models["moe"]), "prompts": PROMPTS, "sampling": GREEDY},
        "hybrid": {"graph": _graph(models["hybrid"]), "prompts": PROMPTS, "sampling": GREEDY},
        "hybrid_lookup": {"graph": {**_graph(models["hybrid"]), "nodes": {**_graph(models["hybrid"])["nodes"],
                                                                          "lookup": {"plugin": "prompt-lookup"}}},
                          "prompts": [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]], "sampling": GREEDY,
                          "overrides": ["nodes.target.linear_rollback=replay"]},
    }
    out = models["root"] / "out"
    out.mkdir()
    (out / "scenarios.json").write_text(json.dumps(scenarios))
    port = str(free_port())
    procs = []
    for rank in range(2):  # output to files: a full pipe would stall one rank and with it the other
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        with open(out / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, str(HERE / "tp_testlib.py"), str(out / "scenarios.json"),
                                           str(out)], env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = "\n".join((out / f"rank{r}.log").read_text() for r in range(2))
    assert codes == [0, 0], logs[-4000:]
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("name", ["dense", "dense_batched", "gguf", "moe", "hybrid", "hybrid_lookup"])
def test_greedy_sharded_equals_whole(results, name):
    """Greedy float32 tokens at tensor_parallel 2 equal tensor_parallel 1: dense (HF, GGUF q8_0; batched with
    chunked prefill), MoE (with a vocabulary of 301), hybrid (also drafted by prompt lookup, replay rollback)."""
    r = results[name]
    assert r["tp2"]["tokens"] == r["tp1"]["tokens"]
    assert all(len(t) == GREEDY["max_new_tokens"] for t in r["tp2"]["tokens"])
    if name == "hybrid_lookup":  # the drafts were verified in windows (rollback of the sharded linear states)
        assert r["tp2"]["drafted"] == r["tp1"]["drafted"] > 0


def test_each_rank_holds_half_the_heads(results):
    """Rank 0's shard: 2 of 4 query heads, 1 of 2 KV heads, and a KV cache of 1 KV head."""
    r = results["dense"]
    assert r["tp1"]["heads"] == [4, 2] and r["tp2"]["heads"] == [2, 1]
    assert r["tp1"]["kv_shape"][4] == 2 and r["tp2"]["kv_shape"][4] == 1


def test_sampled_with_seed_sharded_equals_whole(results):
    """T > 0 with a seed: the same tokens at tensor_parallel 2 as at 1 (target-only with a growing KV cache and
    logprobs riding the verdict broadcast, and with a DFlash drafter)."""
    for name in ("dense_sampled", "dflash_sampled"):
        assert results[name]["tp2"]["tokens"] == results[name]["tp1"]["tokens"], name


def test_dflash_drafter_on_a_sharded_target_is_lossless(results):
    """A replicated DFlash drafter over a sharded target: target-only tokens, with drafts accepted."""
    r = results["dflash"]
    assert r["tp2"]["tokens"] == r["tp1"]["tokens"] == results["target_only"]["tp1"]["tokens"]
    assert results["target_only"]["tp2"]["tokens"] == results["target_only"]["tp1"]["tokens"]
    assert r["tp2"]["accepted"] == r["tp1"]["accepted"] > 0
    # A policy times cycles, which differ per rank: rank 0's K is every rank's, so the ranks stay in step.
    assert results["dflash_policy"]["tp2"]["tokens"] == r["tp1"]["tokens"]


def test_cli_generate_tp2_json(models, tmp_path):
    """`draftflow generate --tp 2 --json` (two spawned ranks) prints what the one-process run prints, once."""
    common = ["generate", "--target", models["target"], "--dflash", models["drafter"], "--prompt-ids", "3,4,5,6",
              "--max-new-tokens", "16", "--ignore-eos", "--json"]
    sharded = run_cli([*common, "--tp", "2"], cwd=tmp_path)
    whole = run_cli(common, cwd=tmp_path)
    assert sharded.returncode == 0 and whole.returncode == 0, sharded.stderr + whole.stderr
    assert len(sharded.stdout.strip().splitlines()) == 1  # rank 0 prints; rank 1 does not
    a, b = json.loads(sharded.stdout), json.loads(whole.stdout)
    assert a["token_ids"] == b["token_ids"] and a["stats"]["accepted"] == b["stats"]["accepted"] > 0


def test_check_refuses_counts_not_divisible(models, tmp_path):
    """`check --tp 3`: one error line per split count that 3 does not divide, each with the fix."""
    graph = tmp_path / "g.yaml"
    graph.write_text(f"nodes:\n  target: {{plugin: target, params: {{path: {models['dense']}}}}}\n  verify: {{plugin: verifier}}\n")
    out = run_cli(["check", graph, "--tp", "3"], cwd=tmp_path)
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if "[tensor-parallel]" in line]
    assert len(lines) == 2, out.stderr  # heads 4 and KV heads 2; the MLP width 96 divides by 3
    assert any("attention heads (num_attention_heads) = 4 is not divisible by tensor_parallel 3" in line for line in lines)
    assert any("KV heads (num_key_value_heads) = 2 is not divisible by tensor_parallel 3" in line for line in lines)
    assert all("fix: use a tensor_parallel that divides every split count of this model (1, 2)" in line for line in lines)


def test_check_prints_the_per_rank_plan(models, tmp_path):
    """`check --tp 2` plans one rank: the target's KV cache is half of the whole one's."""
    graph = tmp_path / "g.yaml"
    graph.write_text(f"max_context: 128\nnodes:\n  target: {{plugin: target, params: {{path: {models['dense']}}}}}\n"
                     "  verify: {plugin: verifier}\n")
    whole, sharded = run_cli(["check", graph], cwd=tmp_path), run_cli(["check", graph, "--tp", "2"], cwd=tmp_path)
    assert whole.returncode == sharded.returncode == 0, whole.stderr + sharded.stderr
    assert "VRAM plan per rank, tensor_parallel 2" in sharded.stdout
    kv = {text: next(line.split()[3:5] for line in out.stdout.splitlines() if line.strip().startswith("kv_cache"))
          for text, out in (("whole", whole), ("sharded", sharded))}  # kv_cache  target  -  32.62 KiB
    assert kv["sharded"][1] == kv["whole"][1] and float(kv["sharded"][0]) * 2 == float(kv["whole"][0])


def test_one_process_asked_for_two_ranks_is_one_error_line(models):
    """A library caller opening a `tensor_parallel: 2` graph in one process (no launcher): one line naming both."""
    from draftflow.core.errors import DraftflowError
    from draftflow.core.session import Session

    with pytest.raises(DraftflowError) as err:
        Session.open(graph_dict=_graph(models["dense"], tensor_parallel=2))
    assert str(err.value) == ("tensor_parallel 2 needs 2 processes, one per rank, but this is a single process; run it "
                              "with `draftflow generate/serve ... --tp 2` or `torchrun --nproc-per-node 2 -m draftflow ...`")


def test_serve_tp2_answers_like_generate(models, tmp_path):
    """`draftflow serve` of a graph with `tensor_parallel: 2`: rank 0 serves, concurrent requests come back as a
    one-process `generate --tp 1` prints them; SIGTERM to the launcher ends every rank."""
    graph = tmp_path / "g.yaml"
    graph.write_text(f"name: tp\nmax_context: 128\ntensor_parallel: 2\nnodes:\n"
                     f"  target: {{plugin: target, params: {{path: {models['dense']}}}}}\n  verify: {{plugin: verifier}}\n")
    server = subprocess.Popen([sys.executable, "-m", "draftflow", "serve", str(graph), "--port", "0",
                               "--max-batch", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        match = re.search(r"listening on (http://\S+)", line)
        assert match, line + server.stderr.read()
        bodies = [{"model": "tp", "prompt": "tensor", "max_tokens": 10, "temperature": 0},
                  {"model": "tp", "prompt": "parallel", "max_tokens": 10, "temperature": 0.8, "seed": 5}]
        with ThreadPoolExecutor(2) as pool:
            served = list(pool.map(lambda body: _post(match.group(1) + "/v1/completions", body), bodies))
    finally:
        server.terminate()
        code = server.wait(timeout=90)
    assert code == 0, server.stdout.read() + server.stderr.read()
    for body, answer in zip(bodies, served):
        flags = ["--temperature", str(body["temperature"])] + (["--seed", str(body["seed"])] if "seed" in body else [])
        ref = run_cli(["generate", "--graph", graph, "--tp", "1", "--prompt", body["prompt"], "--max-new-tokens", "10",
                       "--json", *flags], cwd=tmp_path)
        assert ref.returncode == 0, ref.stderr
        assert answer["choices"][0]["text"] == json.loads(ref.stdout)["text"], (body, answer, ref.stdout)


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("fmt", ["hf", "q8_0"])
def test_each_rank_loads_exactly_its_slice(hf_dir, tmp_path, arch, fmt):
    """Every tensor a rank loads (safetensors slices; GGUF rows, block-aligned columns, llama's q/k un-permuted per
    head) equals that rank's slice of the whole load; o_proj's and q/k/v's biases included."""
    from draftflow.layers.tensor_parallel import TPGroup, shard_of, take
    from draftflow.plugins.target.gguf_loader import load_gguf
    from draftflow.plugins.target.hf_loader import load_hf

    _, path = hf_dir(arch)
    load = load_hf
    if fmt != "hf":
        convert_hf_to_gguf(path, tmp_path / "m.gguf", fmt)
        path, load = tmp_path / "m.gguf", load_gguf
    whole = load(path, "cpu", torch.float32)
    params = dict(whole.model.named_parameters())
    for rank in range(2):
        part = load(path, "cpu", torch.float32, TPGroup(rank, 2))
        assert part.model.config.num_heads == 2 and part.config == whole.config
        for name, p in part.model.named_parameters():
            full = params[name]
            pieces = shard_of(name, tuple(full.shape), tuple(p.shape), whole.config, rank, 2)
            assert torch.equal(p, take(full, pieces) if pieces else full), (rank, name)
