"""The HumanEval benchmark runs end to end on a handful of prompts and reports every drafter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import SMALL_PAIR

from draftflow.plugins.dflash.dflash2_config import DFlash2Config
from draftflow.plugins.target.hf_loader import load_hf
from draftflow.tools.bench_humaneval import demo_configs, main, same_outputs
from draftflow.tools.dflash_peer import unavailable
from draftflow.tools.train.dflash2_recipe import DFlash2Recipe, init_backbone_config, new_drafter

DEMO = SMALL_PAIR  # the small trained pair: the benchmark's mechanics, not the shipped demo's numbers


def test_benchmark_runs_on_a_few_prompts(tmp_path, capsys):
    """Two prompts, 12 tokens, T=0 and T=1: a table row per drafter, JSON with tau and speedup, a plot."""
    out, plot = tmp_path / "r.json", tmp_path / "p.png"
    assert main(["--demo", str(DEMO), "--limit", "2", "--max-new-tokens", "12", "--json", str(out), "--plot", str(plot)]) == 0
    printed = capsys.readouterr().out
    assert "2 of 2 prompts fit" in printed
    results = json.loads(out.read_text())
    assert len(results) == 2 * len(demo_configs("cpu", 3, DEMO)) >= 10  # every drafter configuration x 2 temperatures
    assert results["target only @ T=0"]["tau"] == 1.0 and results["target only @ T=0"]["speedup"] == 1.0
    assert results["MTP @ T=0"]["tau"] >= 1.0 and results["DFlash @ T=1"]["drafted"] > 0
    assert plot.read_bytes()[:4] == b"\x89PNG"
    # Greedy rows repeat the target-only row's tokens on every prompt (float32); sampled rows are not compared.
    greedy = [k for k in results if k.endswith("@ T=0")]
    assert {results[k]["same_as_target"] for k in greedy} == {"2/2"}, results
    assert not any("same_as_target" in results[k] for k in results if k.endswith("@ T=1"))
    assert "outputs" not in results["DFlash @ T=0"]


def test_same_outputs_counts_prompts_that_differ():
    """The same-tokens count is per prompt: one differing token makes the prompt differ."""
    assert same_outputs([[1, 2], [3, 4]], [[1, 2], [3, 4]]) == "2/2"
    assert same_outputs([[1, 2], [3, 5]], [[1, 2], [3, 4]]) == "1/2"
    with pytest.raises(ValueError):
        same_outputs([[1, 2]], [[1, 2], [3, 4]])


@pytest.fixture(scope="module")
def demo2(tmp_path_factory):
    """The demo folder plus a DFlash2 drafter started from the demo DFlash one, its selector made non-trivial."""
    root = tmp_path_factory.mktemp("demo2")
    for name in ("target", "dflash", "mtp"):
        (root / name).symlink_to(DEMO / name)
    target = load_hf(DEMO / "target", "cpu", torch.float32).model
    cfg = DFlash2Config(init_backbone_config(str(DEMO / "dflash"), target), 2, 16, 16, 8)
    drafter = new_drafter(cfg, seed=0, init_from=str(DEMO / "dflash"))
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook.weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(1))
    DFlash2Recipe(target, drafter).save(root / "dflash2")
    return root


def test_benchmark_adds_dflash2_rows_and_dflash_reference_rows(demo2, tmp_path, capsys):
    """With demo/dflash2: both selectors get rows; top-1 drafts as DFlash; dflash's own loop agrees at T=0."""
    if unavailable():
        pytest.skip(unavailable())
    out = tmp_path / "r.json"
    assert main(["--demo", str(demo2), "--limit", "2", "--max-new-tokens", "16", "--temperatures", "0", "--peer",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert {"DFlash2 @ T=0", "DFlash2 top-1 @ T=0", "dflash ref: DFlash @ T=0", "dflash ref: DFlash2 @ T=0"} <= set(r)
    same = ("cycles", "drafted", "accepted", "per_position_acceptance")
    # Identity convolutions on the DFlash backbone: the top-1 ablation is that DFlash drafter.
    assert [r["DFlash2 top-1 @ T=0"][k] for k in same] == [r["DFlash @ T=0"][k] for k in same]
    # dflash's loop takes its first token from the prefill, draftflow drafts it: the cycles differ by about one.
    for ours, ref in (("DFlash", "dflash ref: DFlash"), ("DFlash2", "dflash ref: DFlash2")):
        mine, theirs = r[f"{ours} @ T=0"], r[f"{ref} @ T=0"]
        assert theirs["drafted"] > 0 and 1.0 <= theirs["tau"] <= 4.0 and "tokens_per_s" in theirs, ref
        assert abs(theirs["accepted"] - mine["accepted"]) <= 3 and abs(theirs["cycles"] - mine["cycles"]) <= 4, (ours, r)
    assert "dflash ref: DFlash2" in capsys.readouterr().out


def test_peer_module_imports_neither_dflash_nor_transformers():
    """Importing the benchmark and its peer module loads no dflash/transformers code (they load only for --peer)."""
    code = ("import sys, draftflow.tools.bench_humaneval, draftflow.tools.dflash_peer; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('dflash', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_unknown_config_name_is_one_line_and_exit_2(capsys):
    """--configs with a row that does not exist: one `error:` line naming it and the rows there are, before any run."""
    assert main(["--demo", str(DEMO), "--configs", "DFlash", "nope", "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --configs nope: no such row; choose from target only, "), err


def test_a_demo_folder_missing_a_drafter_is_an_error_not_a_traceback(tmp_path, capsys):
    """--demo without the MTP weights a row needs: the graph check's `error:` naming the node, exit 2, no traceback."""
    demo = tmp_path / "demo"
    demo.mkdir()
    for part in ("target", "dflash"):
        (demo / part).symlink_to(DEMO / part)
    (demo / "mtp").mkdir()
    (demo / "mtp" / "config.json").write_text((DEMO / "mtp" / "config.json").read_text())
    assert main(["--demo", str(demo), "--configs", "MTP", "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "node 'mtp'" in err and "Traceback" not in err, err


def test_target_flag_drafts_for_another_copy_of_the_target(tmp_path, capsys):
    """--target: the demo target as an F32 GGUF (the bf16 weights exactly) gives the same DFlash row at T = 0 as
    the safetensors directory; a --target that does not exist is the graph check's report naming the target node,
    the path and the fix, exit 2, no traceback."""
    from draftflow.tools.convert_gguf import convert_hf_to_gguf

    gguf_path = tmp_path / "target-f32.gguf"
    convert_hf_to_gguf(DEMO / "target", gguf_path, "f32")
    rows = {}
    for name, extra in (("hf", []), ("gguf", ["--target", str(gguf_path)])):
        out = tmp_path / f"{name}.json"
        assert main(["--demo", str(DEMO), "--configs", "DFlash", "--limit", "2", "--max-new-tokens", "12",
                     "--temperatures", "0", "--num-draft", "4", "--json", str(out), *extra]) == 0
        rows[name] = json.loads(out.read_text())["DFlash @ T=0"]
    for key in ("tau", "acceptance_rate", "per_position_acceptance"):
        assert rows["gguf"][key] == rows["hf"][key], key
    capsys.readouterr()
    missing = tmp_path / "nope.gguf"
    assert main(["--demo", str(DEMO), "--configs", "DFlash", "--limit", "1", "--target", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    assert f"node 'target' (target) [manifest]: {missing}: no such model directory or file" in err, err


def test_interleaved_rows_give_the_sequential_tokens(tmp_path):
    """Interleaved (the default) runs prompt by prompt through every row; the rows' tau, cycles and acceptance are
    the sequential run's (--no-interleave; only the timing order changes), each row with its speedup."""
    runs = {}
    for flag in (["--no-interleave"], ["--interleave"]):
        out = tmp_path / f"{flag[0]}.json"
        assert main(["--demo", str(DEMO), "--limit", "3", "--max-new-tokens", "12", "--temperatures", "0", "1",
                     "--configs", "target only", "prompt lookup", "DFlash", "--json", str(out), *flag]) == 0
        runs[flag == ["--interleave"]] = json.loads(out.read_text())
    assert set(runs[True]) == set(runs[False]) and len(runs[True]) == 6
    for key, r in runs[True].items():
        assert {k: r[k] for k in ("cycles", "drafted", "accepted")} == \
            {k: runs[False][key][k] for k in ("cycles", "drafted", "accepted")}, key
        assert r["tokens_per_s"] > 0
    assert runs[True]["DFlash @ T=0"]["drafted"] > 0 and runs[True]["target only @ T=1"]["speedup"] == 1.0


def test_cut_adds_the_dflash2_rows_with_min_path_prob(tmp_path):
    """--cut P: the DFlash2 rows again with the dflash2 node's min_path_prob at P, named "..., cut P"; on the shipped
    pair the cut row gives the target-only tokens and drafts fewer than whole blocks."""
    from helpers import ROOT

    shipped = ROOT / "graphs" / "models" / "demo"
    configs = demo_configs("cpu", 15, shipped, cut=0.01)
    assert configs["DFlash2, cut 0.01"]["nodes"]["dflash2"]["params"]["min_path_prob"] == 0.01
    assert configs["lookup, else DFlash2, cut 0.01"]["nodes"]["dflash2"]["params"]["min_path_prob"] == 0.01
    assert configs["DFlash, cut 0.01"]["nodes"]["dflash"]["params"]["min_path_prob"] == 0.01
    assert "min_path_prob" not in configs["DFlash"]["nodes"]["dflash"]["params"]  # the uncut row is left as it was
    assert "min_path_prob" not in configs["DFlash2"]["nodes"]["dflash2"]["params"]
    assert not any("cut" in name for name in demo_configs("cpu", 15, shipped))
    out = tmp_path / "r.json"
    assert main(["--demo", str(shipped), "--cut", "0.01", "--configs", "target only", "DFlash2", "DFlash2, cut 0.01",
                 "--limit", "1", "--max-new-tokens", "24", "--temperatures", "0", "--num-draft", "15",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    whole, cut = rows["DFlash2 @ T=0"], rows["DFlash2, cut 0.01 @ T=0"]
    assert cut["same_as_target"] == whole["same_as_target"] == "1/1"
    assert cut["drafted"] < 15 * cut["cycles"] and whole["drafted"] > cut["drafted"], (whole, cut)


def test_no_triton_sets_the_block_drafters_param():
    """--no-triton (demo_configs' triton=False): every DFlash and DFlash2 node of every row gets `triton: false`; by
    default they get true, and the graphs still build (the param is declared on both nodes)."""
    from helpers import ROOT

    shipped = ROOT / "graphs" / "models" / "demo"
    for triton in (True, False):
        configs = demo_configs("cpu", 15, shipped, triton=triton)
        drafters = [n for g in configs.values() for n in g["nodes"].values() if n["plugin"] in ("dflash", "dflash2")]
        assert len(drafters) >= 6 and all(n["params"]["triton"] is triton for n in drafters)
    assert main(["--demo", str(shipped), "--no-triton", "--configs", "target only", "DFlash", "--limit", "1",
                 "--max-new-tokens", "8", "--temperatures", "0"]) == 0


def test_a_negative_cut_is_one_line_and_exit_2(capsys):
    """--cut below 0 would add no rows silently: one `error:` line instead, before any run."""
    assert main(["--demo", str(DEMO), "--cut", "-1", "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --cut -1: min_path_prob is a probability; give one above 0, or leave --cut out"], err


def _graph_file(path, drafter: bool = True, target=DEMO / "target"):
    from draftflow.plugins.dflash.loader import read_artifact

    taps = list(read_artifact(DEMO / "dflash").config.target_layer_ids)
    nodes = {"target": {"plugin": "target", "params": {"path": str(target), "tap_layers": taps}},
             "verify": {"plugin": "verifier"}}
    if drafter:
        nodes["dflash"] = {"plugin": "dflash", "params": {"path": str(DEMO / "dflash")}}
    else:
        nodes["lookup"] = {"plugin": "prompt-lookup"}
    path.write_text(json.dumps({"name": path.stem, "device": "cpu", "dtype": "float32", "num_draft": 4,
                                "nodes": nodes}))
    return path


def test_graph_files_are_rows_beside_their_target_alone(tmp_path, capsys):
    """--graph: each file is a row named by its file name, next to "target only" of its target; a DFlash graph file
    gives the demo DFlash row's numbers; --set reaches every graph; greedy rows repeat the target-only tokens."""
    mine, other = _graph_file(tmp_path / "mine.yaml"), _graph_file(tmp_path / "lookup.yaml", drafter=False)
    out, ref = tmp_path / "g.json", tmp_path / "d.json"
    common = ["--limit", "2", "--max-new-tokens", "12", "--temperatures", "0"]
    assert main(["--graph", str(mine), str(other), "--json", str(out), *common]) == 0
    assert "K = as each graph sets it (at most 4)" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert list(rows) == ["target only @ T=0", "mine @ T=0", "lookup @ T=0"]
    assert {r["same_as_target"] for r in rows.values()} == {"2/2"}
    assert main(["--demo", str(DEMO), "--configs", "DFlash", "--num-draft", "4", "--json", str(ref), *common]) == 0
    for key in ("tau", "per_position_acceptance"):
        assert rows["mine @ T=0"][key] == json.loads(ref.read_text())["DFlash @ T=0"][key], key
    assert main(["--graph", str(mine), "--set", "num_draft=2", "--configs", "mine", "--json", str(out), *common]) == 0
    assert len(json.loads(out.read_text())["mine @ T=0"]["per_position_acceptance"]) == 2


def test_graph_misuse_is_one_line_and_exit_2(tmp_path, capsys):
    """Demo-only flags with --graph, --set without --graph, and graphs of two targets: one `error:` line each."""
    mine = _graph_file(tmp_path / "mine.yaml")
    (tmp_path / "copy").symlink_to(DEMO / "target")  # another target path
    for argv, want in ((["--graph", str(mine), "--num-draft", "4"], "error: --num-draft: the demo rows' settings"),
                       (["--set", "num_draft=2"], "error: --set: applies to --graph files"),
                       (["--graph", str(mine), str(_graph_file(tmp_path / "b.yaml", target=tmp_path / "copy"))],
                        f"error: --graph: {tmp_path / 'b.yaml'} drafts for {tmp_path / 'copy'} but")):
        assert main([*argv, "--limit", "1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(want) and "Traceback" not in err[0], err


def test_a_policy_graph_at_t1_says_its_seeded_rows_keep_k(tmp_path, capsys):
    """Sampled rows are seeded, and a seeded request keeps the graph's K: a graph with a policy says so at T > 0."""
    graph = _graph_file(tmp_path / "mine.yaml")
    data = json.loads(graph.read_text())
    data["nodes"]["policy"] = {"plugin": "adaptive_k"}
    graph.write_text(json.dumps(data))
    assert main(["--graph", str(graph), "--limit", "1", "--max-new-tokens", "6", "--temperatures", "0", "1"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("a policy node does not choose K in these rows") == 1, printed  # at T = 1 only
