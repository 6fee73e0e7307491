"""Target feature taps captured in verify windows against the same taps from one prefill forward.

    python -m draftflow.tools.dflash_taps TARGET DRAFTER --prompt "def add(a, b):" [--new 32]

A DFlash drafter is trained on taps from one forward over a whole sequence, but at
inference the taps of generated tokens come from verify windows (anchor + drafts, K + 1
rows over the cached prefix). If the two disagree (a RoPE position off by one, a stale
or unmasked KV cell, a tap read before or after the wrong norm), the drafter sees features
it was never trained on: acceptance drops while the output stays lossless, so nothing
else notices.

The tool runs a greedy generation through a `Session` (the `--dflash` / `--dflash2`
shortcut graph: the target tapped at the drafter's `target_layer_ids`, K = block - 1),
records each cycle's committed positions (`draftflow_cycle_event`), then reads the
target's feature buffer (`TargetHandle.features`): prompt rows as prefill wrote them, every
later row as the verify window that committed it wrote it. The reference is one
`TargetModel.forward` over the whole sequence (a second copy of the target, fresh cache).
It prints, per tap layer, the prompt range and each cycle's range: 1 - cosine similarity
(worst row), max abs diff and that diff relative to the layer's largest reference value,
and exits 1 when a row is beyond the tolerance.

Tolerance (float32): the same math over windows of other widths only reorders sums, so
each element differs by a few ulps of the values it was summed from (float32 eps 1.2e-7,
grown by sqrt of the reduction length and the layers): cosine >= 1 - 1e-5 and max abs
diff <= 1e-4 x the layer's largest reference value. The shipped demo pair measures
1 - cosine ~1e-13 and relative diffs up to ~5e-7; a position or mask bug gives cosines
far below 0.999.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import torch

from draftflow.core.errors import DraftflowError, ModelFormatError
from draftflow.core.hookspecs import hookimpl
from draftflow.core.node import SamplingParams

COS_TOL = 1e-5  # 1 - cosine, per row
REL_TOL = 1e-4  # max abs diff / max |reference| of the tap layer


class CycleRanges:
    """A trace sink: the positions each cycle committed features for (anchor + accepted drafts)."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []

    @hookimpl
    def draftflow_cycle_event(self, event):
        self.ranges.append((event["position"], event["position"] + len(event["emitted"])))


def drafter_kind(path: str) -> tuple[str, tuple[int, ...]]:
    """('dflash' or 'dflash2', its target_layer_ids); a ModelFormatError when `path` is neither."""
    from draftflow.plugins.dflash import dflash2_loader, loader

    try:
        if dflash2_loader.is_dflash2(path):
            return "dflash2", tuple(dflash2_loader.read_config(path).base.target_layer_ids)
        return "dflash", tuple(loader.read_config(path).target_layer_ids)
    except ModelFormatError as exc:
        raise ModelFormatError(f"DRAFTER {path} is not a DFlash or DFlash2 drafter ({exc})") from None


def load_target(path: str, device: str):
    """The target as a `LoadedTarget` in float32 (HF directory or GGUF file)."""
    from draftflow.plugins.target.plugin import is_gguf

    if is_gguf(path):
        from draftflow.plugins.target.gguf_loader import load_gguf as load
    else:
        from draftflow.plugins.target.hf_loader import load_hf as load
    loaded = load(path, device, torch.float32)
    loaded.model.eval()
    return loaded


@torch.inference_mode()
def prefill_taps(model, ids: list[int], taps: tuple[int, ...], device: str) -> torch.Tensor:
    """One forward over `ids` from position 0 on a fresh cache; the taps of every row."""
    # returns [len(ids), len(taps) * H] float32
    from draftflow.layers.kv_cache import KVCache
    from draftflow.layers.linear_state import LinearState

    cfg = model.config
    cache = KVCache.growing(cfg, 1, len(ids), torch.float32, device)
    linear = LinearState.allocate(cfg, 1, len(ids), torch.float32, device) if cfg.is_hybrid else None
    tokens = torch.tensor([ids], dtype=torch.long, device=device)
    _, out = model(tokens, 0, cache, logit_rows=0, tap_layers=taps, linear=linear)
    return out[0].float()


def compare(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Worst row's cosine and the max abs diff of two [T, H] blocks."""
    cos = torch.nn.functional.cosine_similarity(got.double(), ref.double(), dim=-1)
    return float(cos.min()), float((got - ref).abs().max())


def run(args) -> int:
    for path, what in ((args.target, "TARGET"), (args.drafter, "DRAFTER")):
        if not Path(path).exists():
            raise DraftflowError(f"{what} {path}: no such directory or file; pass a checkpoint directory or .gguf file")
    kind, taps = drafter_kind(args.drafter)
    from draftflow.core.registry import load_registry
    from draftflow.core.session import Session, shortcut_graph

    registry = load_registry()
    shortcut = types.SimpleNamespace(target=str(Path(args.target).resolve()), lookup=False, mtp=None, dflash=None, dflash2=None)
    setattr(shortcut, kind, str(Path(args.drafter).resolve()))
    graph = shortcut_graph(shortcut, registry)
    session = Session.open(graph_dict=graph, overrides=[f"device={args.device}", "dtype=float32"], registry=registry)
    cycles = CycleRanges()
    session.registry.pm.register(cycles, name="dflash-taps-cycles")
    try:
        prompt = session.encode(args.prompt)
        if len(prompt) < 2:
            raise DraftflowError(f"--prompt {args.prompt!r} is {len(prompt)} token(s); pass at least two")
        result = session.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=args.new, ignore_eos=True))
        tokens = list(prompt) + list(result.token_ids)
        fed = len(tokens) - 1  # the last token was never fed to the target
        captured = session.executor.handle.features[0, :fed].float().clone()  # [fed, n_taps * H]
    finally:
        session.close()
    ref = prefill_taps(load_target(args.target, args.device).model, tokens[:fed], taps, args.device)
    hidden = ref.shape[1] // len(taps)
    ranges = [("prefill", 0, len(prompt) - 1)] + [(f"cycle {i}", a, b) for i, (a, b) in enumerate(cycles.ranges) if b > a]
    print(f"{kind} drafter taps target layers {list(taps)}; prompt {len(prompt)} tokens, {len(result.token_ids)} generated "
          f"in {len(cycles.ranges)} cycles (K = {session.plan.spec.num_draft})")
    print(f"{'tap layer':>9}  {'range':<10} {'positions':>11}  {'1 - cosine':>10}  {'max abs diff':>12}  {'relative':>9}")
    bad = []
    for j, layer in enumerate(taps):
        cols = slice(j * hidden, (j + 1) * hidden)
        scale = float(ref[:, cols].abs().max()) or 1.0
        for name, a, b in ranges:
            if b <= a:
                continue
            cos, diff = compare(captured[a:b, cols], ref[a:b, cols])
            ok = 1 - cos <= COS_TOL and diff <= REL_TOL * scale
            print(f"{layer:>9}  {name:<10} {f'{a}..{b - 1}':>11}  {1 - cos:>10.1e}  {diff:>12.3e}  {diff / scale:>9.1e}"
                  f"{'' if ok else '  <- differs'}")
            if not ok:
                bad.append((layer, name, a, b, cos, diff))
    if bad:
        layer, name, a, b, cos, diff = bad[0]
        print(f"error: verify-window taps differ from prefill taps: layer {layer}, {name} (positions {a}..{b - 1}), "
              f"cosine {cos:.6f}, max abs diff {diff:.3e} (tolerance: 1 - cosine <= {COS_TOL}, diff <= {REL_TOL} x max |tap|)",
              file=sys.stderr)
        return 1
    print(f"verify-window taps equal prefill taps (1 - cosine <= {COS_TOL}, max abs diff <= {REL_TOL} x max |tap|)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draftflow.tools.dflash_taps", description=__doc__.split("\n")[0])
    parser.add_argument("target", help="target checkpoint directory or .gguf file")
    parser.add_argument("drafter", help="DFlash or DFlash2 drafter directory or .gguf file trained for the target")
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--new", type=int, default=32, help="tokens to generate (default 32)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu); float32 throughout")
    args = parser.parse_args(argv)
    if args.new < 1:
        print(f"error: --new {args.new}: generate at least one token", file=sys.stderr)
        return 1
    from draftflow.core.tracing import configure_logging

    configure_logging()  # cycle events stay out of the table (warnings still go to stderr)
    try:
        return run(args)
    except (DraftflowError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
