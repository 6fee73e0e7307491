"""Bad inputs that already had clear errors before the reliability pass: kept so they stay clear."""

from harness import Case

CASES = [
    Case("check-missing-file", ["check", "{tmp}/nope.yaml"], r"nope\.yaml: no such graph file"),
    Case("check-malformed-yaml", ["check", "{fixtures}/malformed.yaml"], r"malformed\.yaml:\d+:\d+: malformed YAML"),
    Case("generate-unknown-flag", ["generate", "--no-such-flag"], r"unrecognized arguments", exit=2),
    Case("generate-bad-prompt-ids", ["generate", "--graph", "{fixtures}/good_toy.yaml", "--prompt-ids", "1,x"],
         r"--prompt-ids '1,x': expected comma-separated integers", toy=True),
    Case("trace-missing-file", ["trace", "summarize", "{tmp}/none.jsonl"], r"none\.jsonl"),
]
