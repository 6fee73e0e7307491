"""The example third-party plugin in docs/examples/draftflow-bigram: installed, listed, run.

The example is installed with pip into a temporary ``--target`` folder put on
PYTHONPATH of ``python -m draftflow`` subprocesses; its ``.dist-info`` carries the entry
point, so draftflow discovers it exactly as it would a package installed in the
environment, and the test environment itself stays untouched.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftflow.core.errors import SpecError
from draftflow.core.node import Batch, CommitInfo, NodeContext, RequestState, SamplingParams
from draftflow.core.plan import Env
from draftflow.core.registry import DISABLE_AUTOLOAD_ENV, PLUGINS_ENV

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "docs" / "examples" / "draftflow-bigram"
TESTS_DIR = REPO / "tests"
# Toy target: next = (3 * prev + 1) % 32, a cycle of 16 tokens through 0, 1, 4, 13, ...
# The prompt teaches the drafter 5 -> 6, which the target never says, and part of that cycle.
PROMPT_IDS = "5,6,5,6,5,0,1,4,13,8,25,12,5"


def _install(dest: Path) -> Path:
    if importlib.util.find_spec("setuptools") is None:
        pytest.fail("setuptools is not installed in the test environment; the example is built offline with it "
                    "(--no-build-isolation): run `pip install 'setuptools>=64'`")
    src = dest / "src"
    # Build from a copy: an in-tree build would leave build/ and *.egg-info in the repo.
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = dest / "site"
    # --no-build-isolation and --no-index: build with this environment's setuptools, offline.
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
           "--disable-pip-version-check", "--target", str(site), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"pip could not install the example:\n{proc.stdout}\n{proc.stderr}"
    return site


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The example installed into a fresh ``pip install --target`` folder."""
    try:
        md.distribution("draftflow-bigram")
    except md.PackageNotFoundError:
        pass
    else:
        pytest.fail("draftflow-bigram is already installed in the test environment, so draftflow would load it twice; "
                    "run `pip uninstall draftflow-bigram`")
    return _install(tmp_path_factory.mktemp("bigram"))


def _draftflow(site: Path, *args: str, cwd: Path, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (DISABLE_AUTOLOAD_ENV, PLUGINS_ENV)}
    paths = [str(site), str(TESTS_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update(PYTHONPATH=os.pathsep.join(paths), **env_extra)
    # cwd outside the repo: its draftflow/ folder would shadow a non-editable install.
    return subprocess.run([sys.executable, "-m", "draftflow", *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=120)


def _row(listing: str, node_type: str) -> str | None:
    return next((line for line in listing.splitlines() if line.split()[:1] == [node_type]), None)


def test_plugins_lists_installed_bigram(site, tmp_path):
    """`draftflow plugins` shows the installed example's node type, entry point, version and distribution."""
    dist = next(md.distributions(path=[str(site)]))
    proc = _draftflow(site, "plugins", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    row = _row(proc.stdout, "bigram")
    assert row is not None, proc.stdout
    assert re.fullmatch(rf"bigram\s+drafter\s+bigram\s+{re.escape(dist.version)}\s+entry point of draftflow-bigram\s+-", row), row


def test_disabled_autoload_hides_bigram(site, tmp_path):
    """With DRAFTFLOW_DISABLE_PLUGIN_AUTOLOAD=1 the installed example is not loaded; built-ins still are."""
    proc = _draftflow(site, "plugins", cwd=tmp_path, **{DISABLE_AUTOLOAD_ENV: "1"})
    assert proc.returncode == 0, proc.stderr
    assert _row(proc.stdout, "bigram") is None, proc.stdout
    assert _row(proc.stdout, "verifier") is not None, proc.stdout


def _generate(site: Path, graph: Path, tmp_path: Path) -> dict:
    proc = _draftflow(site, "generate", "--graph", str(graph), "--prompt-ids", PROMPT_IDS, "--max-new-tokens", "40",
                      "--json", cwd=tmp_path, **{PLUGINS_ENV: "toy_plugins"})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_shipped_graph_with_bigram_is_lossless(site, tmp_path):
    """The shipped bigram.yaml, toy target swapped in, emits the target-only tokens and gets drafts accepted."""
    # The shipped graph names the real `target`; a child graph swaps in the toy one.
    head = f"extends: {json.dumps(str(EXAMPLE / 'bigram.yaml'))}\ndevice: cpu\ndtype: float32\nnodes:\n  target: {{plugin: toy-target}}\n"
    spec = tmp_path / "bigram-toy.yaml"
    spec.write_text(head)
    alone = tmp_path / "target-only.yaml"
    alone.write_text(head + "  bigram: null\n")
    result = _generate(site, spec, tmp_path)
    reference = _generate(site, alone, tmp_path)
    assert result["token_ids"] == reference["token_ids"]
    assert len(result["token_ids"]) == 40
    assert reference["stats"]["drafted"] == 0
    stats = result["stats"]
    assert stats["accepted"] > 0
    # Some drafts were rejected too (the prompt's 5 -> 6), so the equality covers recovery.
    assert stats["drafted"] > stats["accepted"]


# --- the bigram logic, imported straight from the example's source ---------------------
@pytest.fixture(scope="module")
def bigram():
    """The example's plugin module, loaded by path (no install needed)."""
    spec = importlib.util.spec_from_file_location("draftflow_bigram_example", EXAMPLE / "draftflow_bigram" / "plugin.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chain_follows_most_frequent_successor(bigram):
    """Drafts walk the most frequent successor of each token, looping through repeated text."""
    table = bigram.BigramTable()
    table.observe([1, 2, 3, 1, 2, 3, 1, 4])
    assert table.chain(1, 5) == [2, 3, 1, 2, 3]


def test_tie_goes_to_most_recent_successor(bigram):
    """Between successors seen equally often the latest wins, until another is seen more often."""
    table = bigram.BigramTable()
    table.observe([1, 2, 1, 3])
    assert table.successor(1) == 3
    table.observe([1, 2, 1, 3, 1, 2], start=4)
    assert table.successor(1) == 2


def test_chain_stops_where_no_successor_was_seen(bigram):
    """A token never followed by anything ends the chain, so fewer drafts (or none) come back."""
    table = bigram.BigramTable()
    table.observe([1, 2, 3])
    assert table.chain(1, 5) == [2, 3]
    assert table.chain(3, 5) == []
    assert table.chain(9, 5) == []


def test_min_count_withholds_rare_successors(bigram):
    """With min_count 2 a successor seen once is not drafted."""
    table = bigram.BigramTable(min_count=2)
    table.observe([1, 2, 1, 2, 3])
    assert table.chain(1, 4) == [2]


def test_observe_from_start_counts_only_new_pairs(bigram):
    """observe(tokens, start) counts the pairs ending at start or later, including the one across the boundary."""
    table = bigram.BigramTable()
    table.observe([1, 2])
    table.observe([1, 2, 1, 2], start=2)
    assert table.counts == {1: {2: 2}, 2: {1: 1}}


def test_manifest_rejects_min_count_below_one(bigram):
    """min_count 0 is a user error that names the parameter and the fix."""
    with pytest.raises(SpecError, match=r"min_count is 0; set params.min_count to 1 or more"):
        bigram.manifest({"min_count": 0}, Env("cpu", "float32", 4, None))


def _node(bigram, num_draft: int = 4):
    params = {"min_count": 1}
    m = bigram.manifest(params, Env("cpu", "float32", num_draft, None))
    assert m.role == "drafter" and [p.type for p in m.outputs] == ["proposal"]
    ctx = NodeContext(name="bigram", params=params, manifest=m, device=torch.device("cpu"), dtype=torch.float32,
                      num_draft=num_draft, kv_tokens=None, buffers={}, shared={})
    return bigram.BigramDrafter(ctx)


def _request(tokens: list[int], num_draft: int = 4) -> RequestState:
    return RequestState("r", len(tokens), list(tokens), SamplingParams(), torch.Generator(), num_draft=num_draft)


def test_drafter_learns_committed_tokens(bigram):
    """A commit teaches the pair from the old anchor onwards; the next step drafts along it, K <= num_draft."""
    node = _node(bigram)
    req = _request([7, 8, 9])
    node.prefill(req)
    empty = node.step(Batch([req], 4), {})["proposal"]
    assert empty.tokens.shape == (1, 0) and empty.tokens.dtype == torch.int64 and empty.probs is None
    req.tokens.append(7)
    node.commit(req, CommitInfo(position=2, num_draft=0, accepted=0, emitted=(7,)))
    assert node.step(Batch([req], 4), {})["proposal"].tokens.tolist() == [[8, 9, 7, 8]]
    req.num_draft = 2
    assert node.step(Batch([req], 4), {})["proposal"].tokens.tolist() == [[8, 9]]


def test_drafter_forgets_between_requests(bigram):
    """prefill of a new request starts from empty counts: nothing learned from the last request is drafted."""
    node = _node(bigram)
    node.prefill(_request([1, 2, 1, 2]))
    req = _request([5, 1])
    node.prefill(req)
    assert node.step(Batch([req], 4), {})["proposal"].tokens.shape == (1, 0)


def test_drafter_keeps_one_table_per_slot(bigram):
    """Two requests in slots 0 and 2 (slot 1 a pad row) draft from their own counts; release drops the slot's."""
    node = _node(bigram)
    a, b = _request([1, 2, 3, 1]), _request([4, 5, 4], num_draft=2)
    b.slot = 2
    node.prefill(a)
    node.prefill(b)
    out = node.step(Batch([a, None, b], 4), {})["proposal"]
    assert out.lengths.tolist() == [4, 0, 2] and out.tokens[0].tolist() == [2, 3, 1, 2] and out.tokens[2, :2].tolist() == [5, 4]
    node.release(a)
    assert list(node.tables) == [2]
