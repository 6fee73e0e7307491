"""`draftflow generate`'s logit-processor, structured-output and logprobs flags.

``add_processor_args`` declares them, ``processor_fields`` turns them into SamplingParams
fields (a bad --logit-bias or --json-schema is one ``error:`` line naming the flag; ranges
are SamplingParams' own checks), ``logprob_rows`` / ``print_logprobs`` show a Result's
logprobs. Imports nothing heavy: flags are checked before torch loads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftflow.core.errors import DraftflowError


def add_processor_args(g: argparse.ArgumentParser) -> None:
    g.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="divide positive logits of prompt and output tokens by R, multiply negative ones (1 = off)")
    g.add_argument("--presence-penalty", type=float, default=0.0, metavar="P",
                   help="subtract P from the logit of every token already in the output (OpenAI; -2..2)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                   help="subtract F times its count from the logit of every output token (OpenAI; -2..2)")
    g.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="drop tokens below P times the most likely token's probability (0 = off)")
    g.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS[,ID=BIAS...]",
                   help="add BIAS (-100..100) to token ID's logit (repeatable)")
    g.add_argument("--json-schema", metavar="FILE", help="constrain the output to JSON valid under this JSON schema")
    g.add_argument("--json-object", action="store_true", help="constrain the output to one JSON object")
    g.add_argument("--regex", metavar="PATTERN", help="constrain the output to match this regular expression")
    g.add_argument("--logprobs", type=int, metavar="N",
                   help="report each output token's logprob and its N most likely alternatives (0..20)")


def parse_logit_bias(values: list[str]) -> dict[int, float]:
    """`--logit-bias 42=-100,7=5` (repeatable) -> {42: -100.0, 7: 5.0}."""
    out: dict[int, float] = {}
    for value in values:
        for item in value.split(","):
            tid, sep, bias = item.strip().partition("=")
            try:
                if not sep or not tid.strip().isdigit():
                    raise ValueError
                out[int(tid)] = float(bias)
            except ValueError:
                raise DraftflowError(f"--logit-bias {value!r}: expected ID=BIAS[,ID=BIAS...] with token ids >= 0 and "
                                     "numbers, e.g. --logit-bias 42=-100,7=5") from None
    return out


def read_schema(path: str) -> str:
    """The JSON text of a --json-schema file, or a one-line error."""
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DraftflowError(f"--json-schema {path}: no such file; give a JSON schema file") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise DraftflowError(f"--json-schema {path}: cannot read it ({reason})") from None
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise DraftflowError(f"--json-schema {path}: not valid JSON ({exc})") from None
    if not isinstance(schema, (dict, bool)):
        raise DraftflowError(f"--json-schema {path}: a JSON schema is an object (or true / false), "
                             f"not {type(schema).__name__}")
    return json.dumps(schema)


def processor_fields(args) -> dict:
    """The SamplingParams fields these flags ask for."""
    from draftflow.core.node import GrammarSpec

    asked = [f for f, on in (("--json-schema", args.json_schema is not None), ("--json-object", args.json_object),
                             ("--regex", args.regex is not None)) if on]
    if len(asked) > 1:
        raise DraftflowError(f"{' and '.join(asked)} each constrain the output; give one")
    grammar = None
    if args.json_schema is not None:
        grammar = GrammarSpec("json_schema", read_schema(args.json_schema))
    elif args.json_object:
        grammar = GrammarSpec("json_object")
    elif args.regex is not None:
        if not args.regex:
            raise DraftflowError("--regex is empty; give a pattern")
        grammar = GrammarSpec("regex", args.regex)
    return {"repetition_penalty": args.repetition_penalty, "presence_penalty": args.presence_penalty,
            "frequency_penalty": args.frequency_penalty, "min_p": args.min_p,
            "logit_bias": parse_logit_bias(args.logit_bias), "logprobs": args.logprobs, "grammar": grammar}


def logprob_rows(tokenizer, result) -> list[dict]:
    """generate --json's ``logprobs``: per output token {id, token, logprob, top: [{id, token, logprob}]}."""
    from draftflow.core.openai_logprobs import TokenTexts

    decode = tokenizer.decode if tokenizer is not None else (lambda ids: "")
    texts = TokenTexts(decode, list(result.prompt_token_ids))
    rows = []
    for lp in result.logprobs or ():
        piece = texts.add(lp.token, lp.logprob, lp.top)
        rows.append({"id": lp.token, "token": piece.text, "logprob": lp.logprob,
                     "top": [{"id": t, "token": text, "logprob": v} for (t, _), (text, v) in zip(lp.top, piece.top)]})
    return rows


def print_logprobs(rows: list[dict], out=None) -> None:
    """One compact line per output token: index, token, logprob, then the alternatives."""
    out = out or sys.stdout
    out.write("\n")
    for i, row in enumerate(rows):
        alts = "  ".join(f"{a['token']!r} {a['logprob']:.4f}" for a in row["top"])
        out.write(f"{i:>4} {row['token']!r} {row['logprob']:.4f}" + (f"  | {alts}" if alts else "") + "\n")
    out.flush()
