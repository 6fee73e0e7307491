"""The Gated DeltaNet verify-window kernels equal the token-by-token torch path: outputs, every position's state, conv tape.

On the CPU the kernels run under Triton's interpreter (tiny shapes); the `gpu` tests run them
compiled on CUDA, float32 against the torch loop and bf16 against float32, and a tiny hybrid
target's greedy generation through CUDA graphs against the eager torch loop.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported: kernels run on CPU tensors
pytest.importorskip("triton")

from draftflow.layers import gdn_kernels  # noqa: E402
from draftflow.layers.config import TargetConfig  # noqa: E402
from draftflow.layers.gdn import GatedDeltaNet  # noqa: E402
from draftflow.layers.linear_state import LinearState  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# GVA: 2 key heads, 4 value heads; 16-wide heads so the interpreter stays fast.
TINY = dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=64, hidden_size=32,
            intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            rms_norm_eps=1e-6, layer_types=["linear_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=0)
MAX_WINDOW = 32


def _layer(cfg: TargetConfig, dtype: torch.dtype, device: str, seed: int = 0) -> GatedDeltaNet:
    """A random layer with O(1) activations and decays that forget over a few tokens (as hybrid_testlib's)."""
    layer = GatedDeltaNet(cfg, dtype, device)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.rand(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)
    return layer


def _states(cfg: TargetConfig, batch: int, mode: str, dtype: torch.dtype, device: str, seed: int = 1):
    """Two identical states with a random committed part (conv tail and recurrent slot 0) at length 5."""
    gen = torch.Generator().manual_seed(seed)
    pair = []
    for _ in range(2):
        s = LinearState.allocate(cfg, batch, MAX_WINDOW, dtype, device, mode)
        pair.append(s)
    tail = pair[0].kernel_tail
    conv = torch.randn(pair[0].conv[..., :tail].shape, generator=gen).to(dtype)
    rec = 0.3 * torch.randn(pair[0].rec[:, 0].shape, generator=gen)
    for s in pair:
        s.conv[..., :tail] = conv.to(device)
        s.rec[:, 0] = rec.to(device)
        s.length = 5
    return pair


def _run_both(cfg, batch: int, tokens: int, mode: str = "select", dtype=torch.float32, device: str = "cpu"):
    """The same window through the torch loop and the kernels; returns (layer, (out, state) torch, (out, state) kernel)."""
    layer = _layer(cfg, dtype, device)
    ref_state, got_state = _states(cfg, batch, mode, dtype, device)
    x = torch.randn(batch, tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    results = []
    for use_kernel, state in ((False, ref_state), (True, got_state)):
        layer.verify_kernel = use_kernel
        assert state.begin(5, tokens)
        with torch.inference_mode():
            results.append((layer(x, state, 0, True), state))
    return layer, results[0], results[1]


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * max(1.0, want.float().abs().max().item()), f"{what}: max error {err:.2e}"


@pytest.fixture(scope="module")
def cfg():
    return TargetConfig.from_hf_dict(TINY, "tiny gdn config")


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("tokens", [1, 2, 7, 16, 32])
def test_kernel_window_equals_token_loop(cfg, batch, tokens):
    """Every position's output, the state after every position and the conv tape equal the torch loop (fp32, 1e-4)."""
    _, (want, ref), (got, state) = _run_both(cfg, batch, tokens)
    _close(got, want, 1e-4, "layer output")
    for t in range(tokens + 1):
        _close(state.rec[0, t], ref.rec[0, t], 1e-4, f"recurrent state after {t} tokens")
    tail = state.kernel_tail
    assert torch.equal(state.conv[..., :tail + tokens], ref.conv[..., :tail + tokens])  # raw inputs: copies


def test_kernel_states_commit_by_selection(cfg, monkeypatch):
    """Committing 3 of 7 tokens selects the kernel-written slot and tape columns: the state after token 3
    (value heads split over two recurrence programs)."""
    monkeypatch.setattr(gdn_kernels, "BLOCK_V", 8)
    layer, (want, ref), (got, state) = _run_both(cfg, 3, 7)
    _close(got, want, 1e-4, "layer output")
    for s in (ref, state):
        s.commit(8)
    _close(state.rec[:, 0], ref.rec[:, 0], 1e-4, "committed state")
    assert torch.equal(state.conv[..., :state.kernel_tail], ref.conv[..., :ref.kernel_tail])
    x = torch.randn(3, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    outs = []
    for use_kernel, s in ((False, ref), (True, state)):  # the next window starts from the selected state
        layer.verify_kernel = use_kernel
        s.begin(8, 2)
        with torch.inference_mode():
            outs.append(layer(x, s, 0, True))
    _close(outs[1], outs[0], 1e-4, "window after the commit")


def test_kernel_on_a_rows_view_writes_only_its_rows(cfg):
    """A batched step on slots 1..2 of a 3-slot state (a `rows` view): the view's rows equal the torch loop's, slot 0
    keeps every buffer as it was."""
    layer = _layer(cfg, torch.float32, "cpu")
    ref, got = _states(cfg, 3, "select", torch.float32, "cpu")
    before = (got.conv.clone(), got.rec.clone())
    x = torch.randn(2, 3, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    outs = []
    for use_kernel, state in ((False, ref), (True, got)):
        layer.verify_kernel = use_kernel
        view = state.rows(1, 3)
        view.begin(5, 3)
        with torch.inference_mode():
            outs.append(layer(x, view, 0, True))
    _close(outs[1], outs[0], 1e-4, "layer output")
    _close(got.rec[:, :4, 1:], ref.rec[:, :4, 1:], 1e-4, "the view's states")
    assert torch.equal(got.conv[:, 1:], ref.conv[:, 1:])
    assert torch.equal(got.conv[:, 0], before[0][:, 0]) and torch.equal(got.rec[:, :, 0], before[1][:, :, 0])


def test_kernel_journals_replay_inputs(cfg):
    """Replay mode: the kernel journals k, v, log-decay and beta per token as the torch loop does; no state slots."""
    _, (want, ref), (got, state) = _run_both(cfg, 3, 7, mode="replay")
    _close(got, want, 1e-4, "layer output")
    _close(state.journal[0, :7], ref.journal[0, :7], 1e-5, "journal")
    assert torch.equal(state.rec[0, 1], torch.zeros_like(state.rec[0, 1]))
    for s in (ref, state):
        s.commit(9)
    _close(state.rec[:, 0], ref.rec[:, 0], 1e-4, "state replayed to token 4")


def test_bf16_kernel_tracks_the_bf16_torch_loop(cfg):
    """bf16: the kernels round where the torch path rounds; outputs within bf16 resolution of it."""
    _, (want, ref), (got, state) = _run_both(cfg, 1, 7, dtype=torch.bfloat16)
    _close(got, want, 2e-2, "bf16 layer output")
    _close(state.rec[0, 7], ref.rec[0, 7], 1e-2, "bf16 final state")
    assert torch.equal(state.conv, ref.conv)


def test_window_refuses_a_strided_tape(cfg):
    """The kernels index tape columns with unit stride; anything else is a clear error."""
    state = LinearState.allocate(cfg, 1, 4, torch.float32, "cpu")
    layer = _layer(cfg, torch.float32, "cpu")
    qkvz = torch.zeros(1, 2, layer.in_proj_qkvz.out_features)
    ba = torch.zeros(1, 2, layer.in_proj_ba.out_features)
    with pytest.raises(ValueError, match="unit-stride tape columns"):
        gdn_kernels.window(qkvz, ba, state.conv[0].transpose(1, 2), layer.conv1d.weight, layer.A_log, layer.dt_bias,
                           state.rec[0], None, 2, 16, 16)


# --- CUDA: compiled kernels --------------------------------------------------------------------------------------

QWEN_HEADS = dict(TINY, hidden_size=256, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
                  linear_value_head_dim=128)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("tokens", [1, 2, 7, 16, 32])
def test_cuda_kernel_equals_token_loop_float32(batch, tokens):
    """On CUDA at 128-wide heads: outputs and every position's state within 1e-4 of the torch loop (float32)."""
    cfg = TargetConfig.from_hf_dict(QWEN_HEADS, "128-wide heads")
    _, (want, ref), (got, state) = _run_both(cfg, batch, tokens, device="cuda")
    _close(got, want, 1e-4, "layer output")
    _close(state.rec[0, 1:tokens + 1], ref.rec[0, 1:tokens + 1], 1e-4, "per-position states")
    assert torch.equal(state.conv, ref.conv)


@needs_cuda
@pytest.mark.gpu
def test_cuda_bf16_error_against_float32():
    """bf16 kernels vs float32 torch loop, and the bf16 torch loop vs the same: the kernel is no worse (printed)."""
    cfg = TargetConfig.from_hf_dict(QWEN_HEADS, "128-wide heads")
    _, (want, _), (got32, _) = _run_both(cfg, 1, 16, device="cuda")
    _, (bf_loop, _), (bf_kernel, _) = _run_both(cfg, 1, 16, dtype=torch.bfloat16, device="cuda")
    scale = want.abs().max().item()
    errs = {name: (out.float() - want).abs().max().item() / scale
            for name, out in (("kernel fp32", got32), ("torch loop bf16", bf_loop), ("kernel bf16", bf_kernel))}
    print("max error vs float32 torch loop, relative to max |out|: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    assert errs["kernel fp32"] < 1e-4
    assert errs["kernel bf16"] < 2 * errs["torch loop bf16"] + 1e-3, errs


@needs_cuda
@pytest.mark.gpu
def test_cuda_hybrid_greedy_through_graphs_with_kernels_equals_torch_loop(tmp_path):
    """A tiny hybrid target: greedy tokens with the kernels under CUDA graphs (target-only and with rejected drafts)
    equal the eager token-by-token torch path's."""
    from hybrid_testlib import build_hybrid, save

    from draftflow.core.executor import Executor
    from draftflow.core.node import SamplingParams
    from draftflow.core.plan import build_plan
    from draftflow.core.registry import load_registry
    from draftflow.core.spec import GraphSpec

    path = save(build_hybrid(seed=3, head_scale=4.0), tmp_path / "m")
    prompt = [5, 17, 42, 9, 100, 3, 77, 12, 250]

    def generate(cuda_graphs: bool, kernel: bool, oracle=None):
        nodes = {"target": {"plugin": "target", "params": {"path": str(path), "cuda_graphs": cuda_graphs}},
                 "verify": {"plugin": "verifier"}}
        if oracle is not None:
            nodes["oracle"] = {"plugin": "oracle", "params": oracle}
        spec = GraphSpec.from_dict({"device": "cuda", "dtype": "float32", "num_draft": 4, "max_context": 128,
                                    "nodes": nodes})
        plan = build_plan(spec, load_registry(autoload=False))
        plan.raise_if_problems()
        ex = Executor(plan)
        target = ex.nodes["target"]
        for layer in target.model.layers:
            if layer.is_linear:
                layer.linear_attn.verify_kernel = kernel
        ex.warmup()
        assert (target.runner is not None) == cuda_graphs
        return ex.generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))

    reference = generate(cuda_graphs=False, kernel=False)
    assert generate(cuda_graphs=False, kernel=True).token_ids == reference.token_ids
    assert generate(cuda_graphs=True, kernel=True).token_ids == reference.token_ids
    oracle = {"reference": list(reference.token_ids), "errors": [3, 9, 10, 21]}
    drafted = generate(cuda_graphs=True, kernel=True, oracle=oracle)
    assert drafted.token_ids == reference.token_ids
    assert drafted.stats["drafted"] > 0
