"""dflash2 + selector nodes in graphs: greedy gate, the top-1 ablation swap, sampling proposals, static checks."""

from __future__ import annotations

import types

import attrs

import pytest
import torch
from dflash2_testlib import BLOCK, agreeing_pair2, build_reference2, build_target, save_reference, write_graph
from numerics import assert_close_to_scale, tiny_model_bound

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.session import shortcut_graph
from draftflow.core.spec import GraphSpec, load_graph
from draftflow.testing import greedy_gate

TOP_K = 8


@pytest.fixture(scope="module")
def registry():
    return load_registry()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Target and drafter that agree at times (mixed acceptance)."""
    return agreeing_pair2(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    """Unrelated random target and drafter: varied drafts, so selectors visibly differ."""
    root = tmp_path_factory.mktemp("random")
    build_target().save_pretrained(root / "target", safe_serialization=True)
    ref = build_reference2(seed=11)
    save_reference(ref, root / "drafter")
    with torch.no_grad():
        ref.candidate_selector.successor_codebook.weight.zero_()
    save_reference(ref, root / "zero-successor")
    return root / "target", root / "drafter", root / "zero-successor"


def spy_run(graph, registry, node_names, prompt, sampling):
    """Run `graph`, recording each named node's output per anchor position."""
    ex = Executor(build_plan(load_graph(graph), registry))
    seen = {n: {} for n in node_names}
    for name in node_names:
        node = ex.nodes[name]

        def spy(batch, inputs, _step=node.step, _name=name):
            out = _step(batch, inputs)
            seen[_name][batch.rows[0].position] = next(iter(out.values()))
            return out

        node.step = spy
    return ex.generate(prompt, sampling), seen


def test_greedy_gate_matches_target_only_with_mixed_acceptance(pair, tmp_path, registry):
    """target + dflash2 + dflash2-selector + verifier emits exactly the target-only tokens, some drafts accepted."""
    report = greedy_gate(write_graph(tmp_path / "g.yaml", *pair), prompts=[[3, 4, 5, 6], [10, 11]], max_new_tokens=24,
                         registry=registry)
    assert 0 < report.accepted < report.drafted


@pytest.mark.parametrize("selector", ["dflash2-selector", "top1-selector"])
def test_both_selectors_pass_the_greedy_gate(random_pair, tmp_path, registry, selector):
    """Either selector behind the dflash2 drafter is lossless at temperature 0."""
    graph = write_graph(tmp_path / "g.yaml", random_pair[0], random_pair[1], selector=selector)
    report = greedy_gate(graph, prompts=[[3, 4, 5, 6, 7]], max_new_tokens=20, registry=registry)
    assert report.drafted > 0


def test_top1_swap_changes_drafts_as_expected(random_pair, tmp_path, registry):
    """top1 drafts = argmax of the drafter's logits; the learned selector departs from them; zero successors = top-1."""
    target, drafter, zero = random_pair
    sampling, prompt = SamplingParams(max_new_tokens=20, ignore_eos=True), [3, 4, 5, 6, 7]
    runs = {}
    for label, path, selector in (("learned", drafter, "dflash2-selector"), ("top1", drafter, "top1-selector"),
                                  ("zero", zero, "dflash2-selector")):
        graph = write_graph(tmp_path / f"{label}.yaml", target, path, selector=selector)
        runs[label] = spy_run(graph, registry, ["drafter", "selector"], prompt, sampling)
    result, seen = runs["top1"]
    for pos, proposal in seen["selector"].items():
        cand = seen["drafter"][pos]
        assert torch.equal(proposal.tokens, cand.ids[..., 0]) and proposal.probs is None  # sorted: best first
        assert cand.ids.shape[-1] == TOP_K
    assert result.token_ids == runs["learned"][0].token_ids == runs["zero"][0].token_ids  # all lossless
    learned, zero_run = runs["learned"][1]["selector"], runs["zero"][1]["selector"]
    common = [p for p in learned if p in seen["selector"]]
    differ = [p for p in common if not torch.equal(learned[p].tokens, seen["selector"][p].tokens)]
    assert len(common) >= 10 and 0 < len(differ) < len(common)
    for pos, proposal in zero_run.items():
        # With S = 0 the pairwise term vanishes: the walk is top-1 of the unary logits.
        assert torch.equal(proposal.tokens, runs["zero"][1]["drafter"][pos].ids[..., 0])


@pytest.mark.parametrize("selector", ["dflash2-selector", "top1-selector"])
def test_sampling_proposal_carries_q_over_candidates(random_pair, tmp_path, registry, selector):
    """At T > 0 the proposal holds q [1, K, M] over candidate_ids [1, K, M]; rows sum to 1; drafts have q > 0."""
    graph = write_graph(tmp_path / "g.yaml", random_pair[0], random_pair[1], selector=selector)
    result, seen = spy_run(graph, registry, ["selector"], [3, 4, 5, 6],
                           SamplingParams(temperature=0.8, top_k=50, max_new_tokens=10, seed=1))
    assert len(result.token_ids) == 10
    first = seen["selector"][min(seen["selector"])]
    assert first.probs.shape == first.candidate_ids.shape == (1, BLOCK - 1, TOP_K)
    torch.testing.assert_close(first.probs.sum(-1), torch.ones(1, BLOCK - 1))
    picked = first.candidate_ids == first.tokens[..., None]
    assert bool(((first.probs * picked).sum(-1) > 0).all())


def test_check_reports_taps_and_kv_grow(random_pair, tmp_path, registry):
    """Mismatched tap layers are a [dflash2-taps] problem with the fix; kv_mode grow is [incompatible]."""
    graph = write_graph(tmp_path / "g.yaml", random_pair[0], random_pair[1], tap_layers=[0, 2], kv_mode="grow")
    found = [p.render() for p in build_plan(load_graph(graph), registry).problems]
    assert any("[dflash2-taps]" in p and "reads target layers [1, 2] but target 'target' taps [0, 2]" in p
               and "fix: set nodes.target.tap_layers=[1, 2]" in p for p in found), found
    assert any("[incompatible]" in p and "provides 'kv.grow'" in p for p in found), found


def test_generate_shortcut_builds_a_working_graph(random_pair, registry):
    """`generate --target T --dflash2 D` taps the drafter's layers, adds the selector node, and is lossless."""
    args = types.SimpleNamespace(target=str(random_pair[0]), dflash2=str(random_pair[1]), dflash=None, mtp=None,
                                 lookup=False)
    graph = shortcut_graph(args)
    assert graph["nodes"]["target"]["params"]["tap_layers"] == [1, 2]
    assert graph["nodes"]["dflash2"]["plugin"] == "dflash2"
    assert graph["nodes"]["selector"]["plugin"] == "dflash2-selector"
    spec = GraphSpec.from_dict({**graph, "max_context": 128}, source="<test>")
    assert build_plan(spec, registry).problems == []
    assert greedy_gate(spec, prompts=[[3, 4, 5]], max_new_tokens=8, registry=registry).drafted > 0


def test_check_reports_selector_fed_by_another_drafter(random_pair, tmp_path, registry):
    """A dflash2-selector whose candidates come from a non-dflash2 node is a [dflash2-source] problem."""
    from draftflow.plugins.dflash import dflash2_plugin as plugin

    graph = write_graph(tmp_path / "g.yaml", random_pair[0], random_pair[1])
    plan = build_plan(load_graph(graph), registry)
    plan.nodes["drafter"] = attrs.evolve(plan.nodes["drafter"], node_type=registry.node_types["top1-selector"])
    found = [p.render() for p in plugin.check_selector_source(plan)]
    assert any("[dflash2-source]" in p and "feed selector.candidates from a dflash2 node" in p for p in found), found


@pytest.mark.parametrize("name", ["dflash2-example.yaml", "dflash2-top1.yaml"])
def test_shipped_graphs_run_losslessly_with_local_models(random_pair, registry, name):
    """The shipped DFlash2 graphs (selector and top-1 ablation) pass the greedy gate once pointed at real models."""
    from helpers import ROOT

    overrides = [f"nodes.target.path={random_pair[0]}", f"nodes.drafter.path={random_pair[1]}",
                 "nodes.target.tap_layers=[1, 2]", "device=cpu", "dtype=float32", f"num_draft={BLOCK - 1}",
                 "max_context=128"]
    spec = load_graph(ROOT / "graphs" / name, overrides)
    assert greedy_gate(spec, prompts=[[3, 4, 5]], max_new_tokens=8, registry=registry).drafted > 0


def _candidate_scores(graph, registry, static: bool, triton: bool = False, max_new_tokens: int = 16):
    """(tokens, each proposal's candidate scores, the runner, the walk graphs) of one request, eager or through the CUDA-graph step
    run uncaptured; `triton`: the block path of `use_triton` (on the CPU through Triton's interpreter; with CUDA the
    graph runs there, the plain ops unless `triton`)."""
    from draftflow.plugins.dflash.graphs import DraftRunner

    overrides = ["device=cuda", f"nodes.drafter.params.triton={str(triton).lower()}"] \
        if torch.cuda.is_available() else []
    ex = Executor(build_plan(load_graph(graph, overrides=overrides), registry))
    node = ex.nodes["drafter"]
    if triton:
        assert node.model.use_triton()
    if static:
        def make(node=node):
            if node.runner is None:
                node.runner = DraftRunner(node.model, node.cache, node.embed, node.head, BLOCK, capture=False)
            return node.runner
        node._runner = make
    else:
        node._runner = lambda: None
    scores = []
    original = node.step

    def spy(req, inputs):
        out = original(req, inputs)
        scores.append(out["candidates"].scores.clone())
        return out

    node.step = spy
    tokens = ex.generate([3, 4, 5, 6, 7], SamplingParams(max_new_tokens=max_new_tokens)).token_ids
    return tokens, scores, node.runner, node.walk_graphs


def test_static_proposal_step_runs_the_dynamic_convolutions(pair, tmp_path, registry):
    """DFlash2 through the CUDA-graph step (run uncaptured on the CPU) gives the eager node's candidates."""
    graph = write_graph(tmp_path / "g.yaml", *pair)
    want, want_scores, _, no_walk = _candidate_scores(graph, registry, static=False)
    got, got_scores, runner, walk_graphs = _candidate_scores(graph, registry, static=True)
    assert runner is not None and got == want
    # With the runner the selector walks through the drafter's walk graphs (uncaptured here), without it eagerly.
    assert no_walk is None and walk_graphs is not None and walk_graphs.drafts.count_nonzero() > 0
    for g, w in zip(got_scores, want_scores):
        assert_close_to_scale(g, w, tiny_model_bound(4), "candidate scores")  # the 4-layer reference drafter


def test_triton_block_path_runs_the_dynamic_convolutions(pair, tmp_path, registry):
    """`use_triton` on DFlash2 (each convolution one kernel, plugins/dflash/conv_kernel.py; the block's other Triton
    pieces) through the static step gives the plain eager node's candidates (float32; CPU: Triton's interpreter)."""
    graph = write_graph(tmp_path / "g.yaml", *pair)
    want, want_scores, _, _ = _candidate_scores(graph, registry, static=False, max_new_tokens=8)
    got, got_scores, runner, _ = _candidate_scores(graph, registry, static=True, triton=True, max_new_tokens=8)
    assert all(conv.triton for layer in runner.model.layers for conv in (layer.attention_conv, layer.mlp_conv))
    assert got == want and len(got_scores) == len(want_scores) >= 2
    for g, w in zip(got_scores, want_scores):
        assert_close_to_scale(g, w, tiny_model_bound(4), "candidate scores")


def test_target_params_hook_answers_the_backbone_tap_layers(random_pair, registry):
    """draftflow_target_params: a dflash2 node asks for its backbone's target_layer_ids."""
    hook = registry.pm.hook.draftflow_target_params
    assert hook(plugin="dflash2", params={"path": str(random_pair[1])}, target=None) == [{"tap_layers": [1, 2]}]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_walk_graphs_decode_what_the_eager_node_decodes_on_cuda(pair, tmp_path, registry):
    """On CUDA the warm-up captures the greedy walk of every row count (no request captures one), and a greedy
    request through the captured proposals and walks emits the eager node's tokens, which are target-only's."""
    graph = write_graph(tmp_path / "g.yaml", *pair)
    eager = Executor(build_plan(load_graph(graph, overrides=["device=cuda", "nodes.drafter.params.cuda_graphs=false"]),
                                registry))
    ex = Executor(build_plan(load_graph(graph, overrides=["device=cuda"]), registry))
    ex.warmup()
    walk_graphs = ex.nodes["drafter"].walk_graphs
    assert walk_graphs is not None and set(walk_graphs.graphs) == {(k,) for k in range(1, BLOCK)}
    for prompt in ([3, 4, 5, 6, 7], [9, 2, 11]):
        want = eager.generate(prompt, SamplingParams(max_new_tokens=24)).token_ids
        assert ex.generate(prompt, SamplingParams(max_new_tokens=24)).token_ids == want
    assert len(walk_graphs.graphs) == BLOCK - 1
    assert eager.nodes["drafter"].walk_graphs is None
    assert greedy_gate(load_graph(graph, overrides=["device=cuda"]), prompts=[[3, 4, 5]], max_new_tokens=16,
                       registry=registry).drafted > 0
