"""The `draftflow` command line: generate, check, serve, train, plugins, trace summarize.

User errors print one line (``error: ...``) and exit 1; usage errors exit 2 (argparse).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftflow.core.errors import CheckError, DraftflowError
from draftflow.core.session import Session, shortcut_graph

DEFAULT_GRAPH = "demo.yaml"


def _add_graph_args(p: argparse.ArgumentParser, positional: bool) -> None:
    if positional:
        p.add_argument("graph", help="graph YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a graph value, e.g. nodes.target.kv_mode=grow or num_draft=8 (repeatable)")
    p.add_argument("--expert-cache", type=int, metavar="N",
                   help="MoE targets: pin N experts resident on the device (0 = autosize); short for "
                        "--set nodes.<target>.expert_cache=N on every target node")


def _expert_cache_overrides(args) -> list[str]:
    """`--expert-cache N` as `--set` overrides on every `plugin: target` node of the graph."""
    if getattr(args, "expert_cache", None) is None:
        return []
    from draftflow.core.spec import read_graph_dict

    path = getattr(args, "graph", None)
    if path is None:  # generate's shortcut graph names its target node `target`
        names = ["target"] if getattr(args, "target", None) else []
        if not names:
            path = str(Session.shipped_graph(DEFAULT_GRAPH))
    if path is not None:
        nodes = read_graph_dict(Path(path))[0].get("nodes") or {}
        names = [n for n, body in nodes.items() if isinstance(body, dict) and body.get("plugin") == "target"]
    if not names:
        raise DraftflowError("--expert-cache: the graph has no node with plugin 'target'; set the expert_cache "
                             "param of your target node with --set nodes.NAME.expert_cache=N")
    return [f"nodes.{n}.expert_cache={args.expert_cache}" for n in names]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftflow", description="Compose, check and trace speculative decoding graphs.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every cycle event to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate tokens with a graph (runs `check` first)")
    g.add_argument("prompt_text", nargs="?", metavar="PROMPT", help="prompt text (needs a tokenizer)")
    g.add_argument("--graph", help="graph YAML (default: the shipped graphs/demo.yaml unless --target is given)")
    g.add_argument("--target", help="target model: Hugging Face directory or .gguf file")
    g.add_argument("--dflash", metavar="PATH", help="add a DFlash drafter")
    g.add_argument("--dflash2", metavar="PATH", help="add a DFlash2 drafter and its selector")
    g.add_argument("--mtp", nargs="?", const="", metavar="PATH", help="add MTP heads (from the target, or PATH)")
    g.add_argument("--lookup", action="store_true", help="add a prompt-lookup drafter")
    g.add_argument("--spec", type=int, metavar="K", help="draft tokens per cycle (num_draft)")
    g.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    g.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--device", choices=None, help="cpu, cuda or cuda:N")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    g.add_argument("--trace", metavar="FILE.jsonl", help="write every cycle and request event as JSON lines")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats, ...)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS tokens")
    _add_graph_args(g, positional=False)

    c = sub.add_parser("check", help="check a graph statically and print its plan")
    _add_graph_args(c, positional=True)
    c.add_argument("--draw", metavar="OUT.png", help="also render the graph to an image")

    sv = sub.add_parser("serve", help="serve a graph over an OpenAI-compatible HTTP API (runs `check` first)")
    _add_graph_args(sv, positional=True)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on start)")
    sv.add_argument("--api-key", dest="api_keys", action="append", default=[], metavar="KEY",
                    help="require 'Authorization: Bearer KEY' (repeatable; also $DRAFTFLOW_API_KEY)")
    sv.add_argument("--served-model-name", dest="model_names", action="append", default=[], metavar="NAME",
                    help="model name(s) clients send (default: the graph's name)")
    sv.add_argument("--max-waiting", type=int, default=64, help="queued requests before answering 503")
    sv.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    sv.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens a request may ask for")
    sv.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens of chat requests that give none")
    sv.add_argument("--spec-stats", action="store_true", help="add speculative_decoding stats to every response")
    sv.add_argument("--trace", metavar="FILE.jsonl", help="write every cycle and request event as JSON lines")

    tr = sub.add_parser("train", help="train a DFlash or MTP drafter against a frozen target",
                        description="Options of a recipe: draftflow train dflash --help")
    tr.add_argument("recipe", choices=("dflash", "dflash2", "mtp"))
    tr.add_argument("train_args", nargs=argparse.REMAINDER, metavar="...", help="the recipe's options")

    sub.add_parser("plugins", help="list node types and where they were loaded from")

    t = sub.add_parser("trace", help="work with trace files")
    tsub = t.add_subparsers(dest="trace_command", required=True)
    s = tsub.add_parser("summarize", help="print statistics of a --trace file")
    s.add_argument("file")
    s.add_argument("--plot", metavar="OUT.png", help="draw the acceptance-length histogram and per-position acceptance")
    s.add_argument("--json", action="store_true")
    return parser


def _prompt_ids(args, session: Session) -> list[int]:
    if args.prompt_ids is not None:
        try:
            return [int(x) for x in args.prompt_ids.replace(" ", "").split(",") if x != ""]
        except ValueError:
            raise DraftflowError(f"--prompt-ids {args.prompt_ids!r}: expected comma-separated integers like 1,2,3") from None
    text = args.prompt if args.prompt is not None else args.prompt_text
    if text is None:
        raise DraftflowError("no prompt: pass PROMPT, --prompt TEXT or --prompt-ids 1,2,3")
    return session.encode(text)


def cmd_generate(args) -> int:
    from draftflow.core.node import SamplingParams

    if args.prompt is not None and args.prompt_text is not None:
        raise DraftflowError("give the prompt once: either PROMPT or --prompt, not both")
    if args.graph:
        graph_path = Path(args.graph)
    elif not args.target:
        graph_path = Session.shipped_graph(DEFAULT_GRAPH)
    else:
        graph_path = None
    overrides = list(args.overrides)
    if args.spec is not None:
        overrides.append(f"num_draft={args.spec}")
    if args.device:
        overrides.append(f"device={args.device}")
    if args.dtype:
        overrides.append(f"dtype={args.dtype}")
    if graph_path is not None and args.target:
        overrides.append(f"nodes.target.path={args.target}")
    shortcut = shortcut_graph(args) if graph_path is None else None
    if graph_path is not None and any([args.dflash, args.dflash2, args.mtp is not None, args.lookup]):
        raise DraftflowError("drafter shortcut flags (--dflash, --dflash2, --mtp, --lookup) build a graph; use them without --graph")
    session = Session.open(graph_path=graph_path, graph_dict=shortcut, overrides=overrides, trace=args.trace)
    try:
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                  max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos)
        result = session.generate(_prompt_ids(args, session), sampling)
    finally:
        session.close()
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": list(result.token_ids),
                          "prompt_token_ids": list(result.prompt_token_ids), "finish_reason": result.finish_reason,
                          "stats": result.stats}))
    else:
        print(result.text if result.text is not None else " ".join(map(str, result.token_ids)))
        s = result.stats
        print(f"[{len(result.token_ids)} tokens, {s['cycles']} cycles, tau {s['tau']:.2f}, acceptance {s['acceptance_rate']:.2f}, "
              f"{s['tokens_per_s']:.1f} tok/s, finish: {result.finish_reason}]", file=sys.stderr)
    return 0


def cmd_check(args) -> int:
    from draftflow.core.report import draw_plan, render_plan

    plan = Session.plan_only(Path(args.graph), args.overrides)
    plan.raise_if_problems()
    print(render_plan(plan))
    if args.draw:
        draw_plan(plan, args.draw)
        print(f"\ngraph drawn to {args.draw}")
    return 0


def cmd_serve(args) -> int:
    from draftflow.core.server import run_serve

    return run_serve(args)


def cmd_train(args) -> int:
    from draftflow.tools.train.cli import main as train_main

    return train_main([args.recipe, *args.train_args])


def cmd_plugins(args) -> int:
    from draftflow.core.registry import load_registry

    registry = load_registry()
    rows = [["node type", "role", "plugin", "version", "loaded from", "capabilities"]]
    for nt in sorted(registry.node_types.values(), key=lambda n: n.name):
        rows.append([nt.name, nt.role, nt.plugin, nt.version or "-", nt.origin, ",".join(nt.capabilities) or "-"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def cmd_trace(args) -> int:
    from draftflow.core.summarize import plot, read_trace, render, summarize

    summary = summarize(*read_trace(args.file))
    print(json.dumps(summary) if args.json else render(summary))
    if args.plot:
        plot(summary, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from draftflow.core.tracing import configure_logging

    args = build_parser().parse_args(argv)
    configure_logging(verbose=args.verbose)
    handler = {"generate": cmd_generate, "check": cmd_check, "plugins": cmd_plugins, "trace": cmd_trace, "train": cmd_train,
               "serve": cmd_serve}[args.command]
    try:
        if hasattr(args, "overrides"):
            args.overrides = list(args.overrides) + _expert_cache_overrides(args)
        return handler(args)
    except CheckError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except DraftflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
