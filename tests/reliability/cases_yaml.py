"""Bad graph files, YAML and --set overrides: tags, aliases, unreadable paths, wrong top-level values, devices.

Most fail while the YAML is read (before any plugin or model loads), so they are fast.
A check report (a heading and one line per problem) sets ``lines=2``.
"""

import os

from harness import Case

# A valid graph of the toy plugins (tests/toy_plugins.py); cases add or change one thing.
TOY = "nodes:\n  target: {plugin: toy-target, params: {vocab: 32}}\n  drafter: {plugin: toy-drafter}\n  verify: {plugin: verifier}\n"
G = "{tmp}/g.yaml"


def _toy(head="", tail=""):
    return {"g.yaml": head + TOY + tail}


def _case(id, text, message, *args, **kw):
    """`check g.yaml ARGS` on a graph file of the given text."""
    return Case(id, ["check", G, *args], message, files={"g.yaml": text}, toy=True, **kw)


def _alias_bomb():
    """'Billion laughs': 8 levels of nine aliases each, 9**8 = 43 million values from ~500 bytes."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    return "\n".join(lines) + "\n" + TOY


def _symlink_loop(tmp):
    os.symlink(tmp / "b.yaml", tmp / "a.yaml")
    os.symlink(tmp / "a.yaml", tmp / "b.yaml")


def _no_file_written(name):
    def check(result, tmp):
        assert not (tmp / name).exists(), f"the YAML ran code: {name} was written"
    return check


def _once(text):
    def check(result, tmp):
        assert result.stderr.count(text) == 1, f"{text!r} should appear once:\n{result.stderr}"
    return check


def _absent(text):
    def check(result, tmp):
        assert text not in result.stderr, f"{text!r} should not appear:\n{result.stderr}"
    return check


NO_CUDA = (r"(needs CUDA, but this torch build \(.*\) has no CUDA support; fix: install a CUDA build of torch"
           r"|.*sees no CUDA device; fix: check the NVIDIA driver).*--device cpu")

CASES = [
    # --- YAML tags outside the safe set: refused where they are written, the tag and key named
    _case("yaml-tag-python-name", 'name: !!python/name:os.system ""\n' + TOY,
          r"g\.yaml:1:7: name: the YAML tag !!python/name:os\.system is not allowed in a graph file"),
    _case("yaml-tag-python-apply", "description: !!python/object/apply:os.system ['touch {tmp}/pwned']\n" + TOY,
          r"g\.yaml:1:14: description: the YAML tag !!python/object/apply:os\.system is not allowed", check=_no_file_written("pwned")),
    _case("yaml-tag-local", "name: !foo bar\n" + TOY, r"g\.yaml:1:7: name: the YAML tag !foo is not allowed"),
    _case("yaml-tag-binary", "description: !!binary aGVsbG8=\n" + TOY, r"g\.yaml:1:14: description: the YAML tag !!binary is not allowed"),
    _case("yaml-tag-set", "name: !!set {a, b}\n" + TOY, r"g\.yaml:1:7: name: the YAML tag !!set is not allowed"),
    _case("yaml-tag-on-key", TOY + '!!python/name:os.system x: 1\n', r"g\.yaml:5:1: the YAML tag !!python/name:os\.system is not allowed"),
    _case("yaml-tag-int-not-a-number", 'num_draft: !!int "abc"\n' + TOY, r"g\.yaml:1:12: num_draft: 'abc' is not a valid !!int value"),
    _case("yaml-tag-float-in-params", TOY.replace("vocab: 32", 'vocab: !!float "x"'),
          r"g\.yaml:2:48: nodes\.target\.params\.vocab: 'x' is not a valid !!float value"),
    _case("yaml-tag-bool-not-a-bool", "debug: !!bool maybe\n" + TOY, r"g\.yaml:1:8: debug: 'maybe' is not a valid !!bool value"),
    _case("yaml-tags-safe-ok", 'name: !!str 42\nnum_draft: !!int "3"\n' + TOY, r"graph 42 .*: OK", exit=0),
    _case("yaml-set-python-tag", TOY, r"--set 'name=!!python/name:os\.system': the YAML tag !!python/name:os\.system is not allowed",
          "--set", "name=!!python/name:os.system"),
    _case("yaml-set-int-tag-not-a-number", TOY, r"--set 'num_draft=!!int abc': 'abc' is not a valid !!int value",
          "--set", "num_draft=!!int abc"),

    # --- aliases: a bomb stops fast, a recursive alias is named, ordinary sharing still works
    _case("yaml-alias-bomb", _alias_bomb(), r"g\.yaml:\d+:\d+: a\d\[0\]: aliases \(\*name\) expand to more than 100,000 copied values",
          timeout=30),
    _case("yaml-alias-recursive-mapping", "nodes: &a {x: *a}\n", r"g\.yaml:1:8: nodes\.x: this alias refers to a value that contains it"),
    _case("yaml-alias-recursive-list", TOY + "edges: &e [*e]\n", r"g\.yaml:5:8: edges\[0\]: this alias refers to a value that contains it"),
    _case("yaml-alias-recursive-merge", "nodes: &n\n  t: {plugin: toy-target, params: {<<: *n}}\n",
          r"nodes\.t\.params: this alias refers to a value that contains it"),
    _case("yaml-alias-shared-params", "nodes:\n  target: {plugin: toy-target, params: &p {vocab: 48}}\n"
          "  drafter: {plugin: toy-drafter, params: *p}\n  verify: {plugin: verifier}\n", r": OK", exit=0),
    _case("yaml-alias-merge-key", "nodes:\n  target: {plugin: toy-target, params: &p {vocab: 48}}\n"
          "  drafter: {plugin: toy-drafter, params: {<<: *p, wrong_at: [1]}}\n  verify: {plugin: verifier}\n", r": OK", exit=0),
    _case("yaml-merge-not-a-mapping", TOY.replace("{vocab: 32}", "{<<: 5}"), r"nodes\.target\.params: '<<' merges mappings only"),
    _case("yaml-set-recursive-alias", TOY, r"--set 'name=&a \[\*a\]': \[0\]: this alias refers to a value that contains it",
          "--set", "name=&a [*a]"),
    _case("yaml-nesting-too-deep", TOY + "description: " + "[" * 150 + "]" * 150 + "\n",
          r"g\.yaml:5:\d+: description\[0\].*: lists and mappings are nested more than 100 levels deep"),
    _case("yaml-nesting-too-deep-to-parse", TOY + "description: " + "[" * 5000 + "]" * 5000 + "\n",
          r"g\.yaml(:\d+:\d+)?: .*nested (too|more than 100 levels) deep"),

    # --- the graph path: say what is wrong with it
    Case("yaml-graph-is-directory", ["check", "{tmp}"], r"cannot read the graph file: is a directory, not a file"),
    Case("yaml-graph-through-a-file", ["check", G + "/x.yaml"],
         r"g\.yaml/x\.yaml: cannot read the graph file: a part of the path is a file",
         files=_toy()),
    Case("yaml-graph-symlink-loop", ["check", "{tmp}/a.yaml"],
         r"a\.yaml: cannot read the graph file: the symbolic links of the path form a loop",
         setup=_symlink_loop),
    Case("yaml-graph-endless-device", ["check", "/dev/zero"], r"/dev/zero: larger than 64 MiB, not a graph file"),
    _case("yaml-graph-empty", "", r"g\.yaml: the graph file is empty; it needs 'nodes:'"),
    _case("yaml-graph-only-comments", "# nothing yet\n\n", r"g\.yaml: the graph file is empty"),
    Case("yaml-graph-binary", ["check", G], r"g\.yaml: not UTF-8 text \(byte 0x89 at offset 0\), so not a graph file",
         files={"g.yaml": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe"}),
    Case("yaml-graph-utf16", ["check", G], r"g\.yaml: not UTF-8 text", files={"g.yaml": TOY.encode("utf-16")}),
    Case("yaml-graph-control-character", ["check", G], r"g\.yaml:5:7: the control character U\+0000 is not allowed in YAML",
         files={"g.yaml": (TOY + "name: \x00\n").encode()}, toy=True),
    _case("yaml-graph-top-list", "- nodes\n- edges\n", r"g\.yaml: the top level is a list, but a graph must be a mapping with 'nodes:'"),
    _case("yaml-graph-top-scalar", "draftflow\n", r"g\.yaml: the top level is a string, but a graph must be a mapping"),
    _case("yaml-graph-two-documents", TOY + "---\n" + TOY, r"g\.yaml:5:1: malformed YAML: but found another document"),
    _case("yaml-extends-missing", "extends: base.yaml\n" + TOY, r"g\.yaml:1:1: extends 'base\.yaml': .*base\.yaml: no such graph file"),
    _case("yaml-extends-directory", "extends: sub\n" + TOY,
          r"g\.yaml:1:1: extends 'sub': .*sub: cannot read the graph file: is a directory",
          setup=lambda tmp: (tmp / "sub").mkdir()),
    _case("yaml-extends-empty", 'extends: ""\n' + TOY, r"g\.yaml:1:1: 'extends' must be the path of another graph file, got ''"),
    _case("yaml-extends-not-utf8", "extends: base.yaml\n" + TOY, r"extends 'base\.yaml': .*base\.yaml: not UTF-8 text",
          setup=lambda tmp: (tmp / "base.yaml").write_bytes(b"\xff\xfe\x00")),

    # --- top-level values
    _case("yaml-num-draft-inf", "num_draft: .inf\n" + TOY, r"g\.yaml:1:1: num_draft must be an integer from 0 to 64, got inf"),
    _case("yaml-num-draft-true", "num_draft: true\n" + TOY, r"num_draft must be an integer from 0 to 64, got True"),
    _case("yaml-num-draft-negative", "num_draft: -1\n" + TOY, r"num_draft must be an integer from 0 to 64, got -1"),
    _case("yaml-num-draft-fraction", "num_draft: 2.5\n" + TOY, r"num_draft must be an integer from 0 to 64, got 2\.5"),
    _case("yaml-num-draft-5000-digits", "num_draft: " + "9" * 5000 + "\n" + TOY,
          r"g\.yaml:1:12: num_draft: a number of 5000 digits is too long to read"),
    _case("yaml-max-context-huge", "max_context: " + "9" * 40 + "\n" + TOY, r"max_context 9{40} exceeds the model context limit", lines=2),
    _case("yaml-vram-budget-huge", 'vram_budget: "' + "9" * 400 + ' TB"\n' + TOY,
          r"g\.yaml:1:1: vram_budget '9{39}\.\.\. \(405 characters\) is not a size"),
    _case("yaml-unknown-top-key", "num_drafts: 3\n" + TOY, r"g\.yaml:1:1: unknown key 'num_drafts'; did you mean 'num_draft'\?"),
    _case("yaml-device-banana", "device: banana\n" + TOY, r"g\.yaml:1:1: device 'banana' is not 'cpu', 'cuda' or 'cuda:N'"),
    _case("yaml-dtype-int8", "dtype: int8\n" + TOY, r"g\.yaml:1:1: dtype 'int8' is not one of float32, bfloat16, float16"),
    _case("yaml-name-a-list", "name: [a, b]\n" + TOY, r"g\.yaml:1:1: name must be text, got a list"),
    _case("yaml-duplicate-key", "num_draft: 2\nnum_draft: 3\n" + TOY, r"g\.yaml:2:1: key 'num_draft' appears twice"),
    _case("yaml-complex-key", TOY + "? [a, b]\n: c\n", r"g\.yaml:5:3: a mapping key must be a plain name"),

    # --- --set
    _case("yaml-set-no-value", TOY, r"--set 'novalue': expected KEY=VALUE", "--set", "novalue"),
    _case("yaml-set-empty-key-part", TOY, r"--set 'nodes\.\.x=1': the key 'nodes\.\.x' has an empty part", "--set", "nodes..x=1"),
    _case("yaml-set-empty-key", TOY, r"--set '=3': the key '' has an empty part", "--set", "=3"),
    _case("yaml-set-whole-params", TOY,
          r"--set 'nodes\.target\.params=\{vocab: 8\}': set one param at a time: nodes\.target\.params\.<param>=<value>",
          "--set", "nodes.target.params={vocab: 8}"),
    _case("yaml-set-unknown-node", TOY, r"--set 'nodes\.targte\.vocab=8': no node 'targte' in the graph; did you mean 'target'\?",
          "--set", "nodes.targte.vocab=8"),
    _case("yaml-set-inside-a-number", TOY, r"--set 'nodes\.target\.vocab\.x=1': nodes\.target\.params\.vocab is a number, not a mapping",
          "--set", "nodes.target.vocab.x=1"),
    _case("yaml-set-inside-top-value", TOY, r"--set 'num_draft\.x=1': num_draft is one value with no keys inside; write num_draft=VALUE",
          "--set", "num_draft.x=1"),
    _case("yaml-set-extends", TOY, r"--set 'extends=base\.yaml': 'extends' is read with the file and cannot be overridden",
          "--set", "extends=base.yaml"),
    _case("yaml-set-names-the-flag", "num_draft: 3\n" + TOY, r"^error: --set 'num_draft=x': num_draft must be an integer",
          "--set", "num_draft=x"),
    _case("yaml-set-param-names-the-flag", TOY, r"--set 'nodes\.target\.kv_mode=banana': node 'target' \(toy-target\) \[param\]",
          "--set", "nodes.target.kv_mode=banana", lines=2),

    # --- the graph built from the command line names its source once, and a specific fix is not followed by a generic one
    Case("yaml-command-line-named-once", ["generate", "--target", "{demo}/target", "--set", "nodes.target.kv_mode=banana", "hi"],
         r"parameter 'kv_mode' is 'banana'", lines=2, check=_once("<command line>")),
    Case("yaml-manifest-fix-once", ["generate", "--target", "{tmp}/nope", "hi"], r"nope", lines=2,
         check=_absent("correct the node's params")),
    Case("yaml-param-path-empty", ["generate", "--target", "{demo}/target", "--set", "nodes.target.path=", "hi"],
         r"parameter 'path': expected a path string, got ''", lines=2),

    # --- devices: the format in the YAML, availability at check time (CUDA_VISIBLE_DEVICES='' hides GPUs anywhere)
    _case("yaml-device-mps", "device: mps\n" + TOY, r"device 'mps' is not 'cpu', 'cuda' or 'cuda:N'"),
    Case("yaml-generate-device-cuda", ["generate", "--target", "{demo}/target", "--device", "cuda", "hi"],
         r"\[device\]: device 'cuda' " + NO_CUDA, lines=2, env={"CUDA_VISIBLE_DEVICES": ""}),
    Case("yaml-generate-device-cuda-99", ["generate", "--target", "{demo}/target", "--device", "cuda:99", "hi"],
         r"\[device\]: device 'cuda:99' " + NO_CUDA, lines=2, env={"CUDA_VISIBLE_DEVICES": ""}),
    _case("yaml-check-device-cuda", TOY, r"--set 'device=cuda': graph \[device\]: device 'cuda' " + NO_CUDA, "--set", "device=cuda",
          lines=2, env={"CUDA_VISIBLE_DEVICES": ""}),
    _case("yaml-check-device-cuda-in-file", "device: cuda:1\n" + TOY, r"g\.yaml:1:1: graph \[device\]: device 'cuda:1' " + NO_CUDA,
          lines=2, env={"CUDA_VISIBLE_DEVICES": ""}),
]
