"""The `draftflow` command line: generate, check, serve, train, plugins, trace summarize.

User errors print one line (``error: ...``) and exit 1; usage errors exit 2 (argparse).
Handlers import the session (plugins, torch) only after their flags and files are checked,
so a typo is reported in a fraction of a second.

Paths on the command line are relative to the working directory (made absolute here,
before they become graph overrides); paths inside a YAML file are relative to that file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from draftflow.core.errors import CheckError, DraftflowError, FollowerDone
from draftflow.core.generate_options import add_processor_args, logprob_rows, print_logprobs, processor_fields
from draftflow.core.hookspecs import hookimpl

DEFAULT_GRAPH = "demo.yaml"
PATH_FLAGS = ("target", "dflash", "dflash2", "mtp", "trace")
PROMPT_CONTEXT_TOKENS = 8  # prompt tokens decoded with the continuation (SentencePiece drops a leading space alone)


def _add_graph_args(p: argparse.ArgumentParser, positional: bool) -> None:
    if positional:
        p.add_argument("graph", help="graph YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a graph value, e.g. nodes.target.kv_mode=grow or num_draft=8 (repeatable)")
    p.add_argument("--expert-cache", type=int, metavar="N",
                   help="MoE targets: pin N experts resident on the device (0 = autosize); short for "
                        "--set nodes.<target>.expert_cache=N on every target node")
    p.add_argument("--tp", type=int, metavar="N", help="shard the target over N GPUs (tensor parallelism; short for "
                   "--set tensor_parallel=N); generate/serve start N local processes (docs/TENSOR_PARALLEL.md)")


def _add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, metavar="N",
                   help="CPU threads for torch (default: 1 for a target under 64 MiB on CPU, else the physical cores; "
                        "OMP_NUM_THREADS, if set, is kept)")


def _expert_cache_overrides(args) -> list[str]:
    """`--expert-cache N` as `--set` overrides on every `plugin: target` node of the graph."""
    if getattr(args, "expert_cache", None) is None:
        return []
    from draftflow.core.spec import read_graph_dict

    path = getattr(args, "graph", None)
    if path is None:  # generate's shortcut graph names its target node `target`
        names = ["target"] if getattr(args, "target", None) else []
        if not names:
            from draftflow.core.session import Session

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
    add_processor_args(g)
    g.add_argument("--device", choices=None, help="cpu, cuda or cuda:N")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    g.add_argument("--trace", metavar="FILE.jsonl",
                   help="write every cycle and request event as JSON lines (an existing trace is overwritten)")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats, ...)")
    g.add_argument("--stream", action="store_true", help="print the text as tokens are accepted")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS tokens")
    g.add_argument("--compare", action="store_true", help="then run the request on the graph's target alone (no "
                   "drafters) and report its tokens/s and the speedup")
    g.add_argument("--compare-rounds", type=int, metavar="N", help="--compare: rounds of (speculative run, target-only "
                   "run); the speedup is the median of their ratios (default 3)")
    _add_threads_arg(g)
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
    sv.add_argument("--max-batch", metavar="N", help="requests generated together, one request slot each, or 'auto' "
                                                     "(default: the graph's max_batch if it sets one, else auto: as many "
                                                     "as the VRAM plan fits, at most 64)")
    sv.add_argument("--max-waiting", type=int, default=64, help="queued requests before answering 503")
    sv.add_argument("--prefill-budget", type=int, default=512, metavar="TOKENS",
                    help="prompt tokens prefilled between two cycles while requests decode: a long prompt joins in "
                         "chunks of this size, stalling the running requests one chunk per cycle")
    sv.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    sv.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens a request may ask for")
    sv.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens of chat requests that give none")
    sv.add_argument("--spec-stats", action="store_true", help="add speculative_decoding stats to every response")
    sv.add_argument("--max-n", type=int, default=8, help="largest n / best_of a request may ask for (each choice takes "
                                                        "a request slot)")
    sv.add_argument("--trace", metavar="FILE.jsonl",
                    help="write every cycle and request event as JSON lines (an existing trace is overwritten)")
    _add_threads_arg(sv)

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


def _parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise DraftflowError(f"--prompt-ids {text!r}: expected comma-separated integers like 1,2,3") from None
    if not ids:
        raise DraftflowError(f"--prompt-ids {text!r}: no token ids; pass at least one, e.g. --prompt-ids 1,2,3")
    bad = next((t for t in ids if not 0 <= t < 2**63), None)
    if bad is not None:
        raise DraftflowError(f"--prompt-ids: {bad} is not a token id; ids are integers >= 0 below the vocabulary size")
    return ids


def _absolute_paths(args) -> None:
    """Command-line paths are relative to the working directory: make them absolute before they reach a graph."""
    for flag in PATH_FLAGS:
        value = getattr(args, flag, None)
        if value is None or (flag == "mtp" and value == ""):  # bare --mtp: the heads inside the target
            continue
        if not value.strip():
            raise DraftflowError(f"--{flag} is empty; give a path")
        setattr(args, flag, str(Path(value).expanduser().absolute()))


class _Printer:
    """Writes the prompt, then the continuation, to stdout: exactly prompt + completion.

    Streaming observes the executor's cycle events (a trace sink that never raises); the
    continuation is decoded whole each time and only the new, complete characters are printed.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], echo: str, stream: bool):
        from draftflow.core.stop_strings import StopScanner

        if tokenizer is None:  # ids only: the prompt ids, then each new id, space-separated
            decode = lambda ids: "".join(f" {t}" for t in ids)  # noqa: E731
        else:
            context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
            prefix = tokenizer.decode(context)

            def decode(ids):
                text = tokenizer.decode(context + list(ids))
                return text[len(prefix):] if text.startswith(prefix) else tokenizer.decode(ids)

        self.scanner, self.stream, self.echo, self.broken = StopScanner(decode), stream, echo, False

    def write(self, text: str) -> None:
        text, self.echo = self.echo + text, ""  # the prompt goes out with the first text: none if the run fails
        if text and not self.broken:
            try:
                sys.stdout.write(text)
                sys.stdout.flush()
            except OSError:  # stdout closed (e.g. piped into head): stop printing, let the run finish
                self.broken = True

    @hookimpl
    def draftflow_cycle_event(self, event):
        if self.stream:
            self.write(self.scanner.feed(event["emitted"])[0])

    def finish(self, token_ids) -> None:
        if not self.stream:
            self.write(self.scanner.feed(token_ids)[0])
        self.write(self.scanner.flush())
        if sys.stdout.isatty():  # the shell prompt on a line of its own; pipes and files get the exact text
            self.write("\n")


def cmd_generate(args) -> int:
    from draftflow.core.node import SamplingParams

    # Everything the flags alone decide is checked before the graph, plugins and models load.
    text = args.prompt if args.prompt is not None else args.prompt_text
    if args.prompt is not None and args.prompt_text is not None:
        raise DraftflowError("give the prompt once: either PROMPT or --prompt, not both")
    if args.prompt_ids is not None and text is not None:
        raise DraftflowError("give the prompt once: either text (PROMPT or --prompt) or --prompt-ids, not both")
    if args.prompt_ids is None and text is None:
        raise DraftflowError("no prompt: pass PROMPT, --prompt TEXT or --prompt-ids 1,2,3")
    if args.compare_rounds is not None and (args.compare_rounds < 1 or not args.compare):
        raise DraftflowError(f"--compare-rounds {args.compare_rounds}: give a positive number of rounds, with --compare")
    if args.stream and args.json:
        raise DraftflowError("--stream prints text as it is generated and --json one object at the end; choose one")
    if args.graph and any([args.dflash, args.dflash2, args.mtp is not None, args.lookup]):
        raise DraftflowError("drafter shortcut flags (--dflash, --dflash2, --mtp, --lookup) build a graph; use them without --graph")
    prompt_ids = _parse_prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                              max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos, **processor_fields(args))
    _absolute_paths(args)
    from draftflow.core.session import Session, check_threads, shortcut_graph

    check_threads(args.threads)
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
    shortcut = registry = None
    if graph_path is None:
        if any([args.dflash, args.dflash2, args.mtp is not None, args.lookup]):
            # Their plugins say what they need of the target; the session reuses this registry.
            from draftflow.core.registry import load_registry

            registry = load_registry()
        shortcut = shortcut_graph(args, registry)
    session = Session.open(graph_path=graph_path, graph_dict=shortcut, overrides=overrides, trace=args.trace,
                           registry=registry, threads=args.threads)
    try:
        if prompt_ids is None:
            prompt_ids = session.encode(text)
        printer = None
        if not args.json:
            echo = text if text is not None else (session.tokenizer.decode(prompt_ids) if session.tokenizer is not None
                                                  else " ".join(map(str, prompt_ids)))
            printer = _Printer(session.tokenizer, prompt_ids, echo, args.stream)
            session.registry.pm.register(printer, name="generate-printer")
        try:
            result = session.generate(prompt_ids, sampling)
        finally:
            if printer is not None:
                session.registry.pm.unregister(printer)
        compared = None
        if args.compare:
            from draftflow.core.compare import ROUNDS, compare

            compared = compare(session, prompt_ids, sampling, result, args.compare_rounds or ROUNDS)
    finally:
        session.close()
    if args.json:
        out = {"text": result.text, "token_ids": list(result.token_ids), "prompt_token_ids": list(result.prompt_token_ids),
               "finish_reason": result.finish_reason, "stats": result.stats}
        if sampling.logprobs is not None:
            out["logprobs"] = logprob_rows(session.tokenizer, result)
        if compared is not None:
            out["compare"] = compared
        print(json.dumps(out))
    else:
        printer.finish(result.token_ids)
        if sampling.logprobs is not None:
            print_logprobs(logprob_rows(session.tokenizer, result))
        s = result.stats
        threads = f", {session.threads} thread{'s' if session.threads != 1 else ''}" if session.threads else ""
        print(f"[{len(result.token_ids)} tokens, {s['cycles']} cycles, tau {s['tau']:.2f}, acceptance {s['acceptance_rate']:.2f}, "
              f"{s['tokens_per_s']:.1f} tok/s{threads}, {session.plan.spec.dtype}, finish: {result.finish_reason}{_compared(compared, sampling)}]",
              file=sys.stderr)
    return 0


def _compared(compared: dict | None, sampling) -> str:
    """The --compare part of the summary line."""
    if compared is None:
        return ""
    speedup = f"{compared['speedup']:.2f}x" if compared["speedup"] else "-"
    same = ""
    if sampling.temperature == 0:  # greedy: speculation must not change a token
        same = ", same tokens" if compared["identical"] else ", TOKENS DIFFER (please report this)"
    rounds = len(compared["rounds"])
    over = f" (median of {rounds} rounds)" if rounds > 1 else ""
    return f"; target only {compared['target_only_tokens_per_s']:.1f} tok/s, speedup {speedup}{over}{same}"


def cmd_check(args) -> int:
    from draftflow.core.session import Session

    if args.draw:  # a bad image path is refused before any work
        from draftflow.core.plotting import check_image_output

        check_image_output(args.draw, "--draw", inputs=(args.graph,))
    plan = Session.plan_only(Path(args.graph), args.overrides)  # reads the YAML before plugins and torch load
    from draftflow.core.report import draw_plan, render_plan

    plan.raise_if_problems()
    print(render_plan(plan))
    if args.draw:
        draw_plan(plan, args.draw)
        print(f"\ngraph drawn to {args.draw}")
    return 0


def cmd_serve(args) -> int:
    from draftflow.core.session import check_threads

    _absolute_paths(args)
    check_threads(args.threads)
    from draftflow.core.serve_cli import run_serve

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

    if args.plot:  # a bad image path is refused before any work
        from draftflow.core.plotting import check_image_output

        check_image_output(args.plot, "--plot", inputs=(args.file,))
    summary = summarize(*read_trace(args.file))
    print(json.dumps(summary) if args.json else render(summary))
    if args.plot:
        plot(summary, args.plot, inputs=(args.file,))
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
        from draftflow.core import tp_launch

        if (ranks := tp_launch.launch_size(args)) > 1:  # --tp N: N worker processes run this command, one per rank
            return tp_launch.launch(sys.argv[1:] if argv is None else list(argv), ranks)
        if hasattr(args, "overrides"):
            args.overrides = list(args.overrides) + _expert_cache_overrides(args) + tp_launch.tp_overrides(args)
        return handler(args)
    except CheckError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except DraftflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except FollowerDone:  # a tensor-parallel rank > 0 mirrored rank 0 to its end
        return 0
    except BrokenPipeError:  # stdout closed early (e.g. piped into head): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush cannot fail
        return 1


# Commands after which nothing runs in the background: their process may skip interpreter teardown.
_FAST_EXIT = ("generate", "check", "plugins")


def console(argv: list[str] | None = None):
    """The `draftflow` executable: ``main``, then exit. After a one-shot command whose output is
    written and whose files are closed, the process ends without interpreter teardown (freeing
    every module, CUDA graphs and device memory one object at a time), which took 0.8-2.5 s
    after `generate`, measured with benchmarks/cli_cold.py. Other commands exit normally."""
    code = main(argv)
    args = sys.argv[1:] if argv is None else argv
    if next((a for a in args if not a.startswith("-")), None) in _FAST_EXIT:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (BrokenPipeError, ValueError, OSError):
                pass
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console()
