"""The built-in static checks, registered through the same hook a third-party check uses."""

from __future__ import annotations

from draftflow.core.hookspecs import hookimpl
from draftflow.core.plugin_rules import plugin_import_check
from draftflow.core.problems import Problem
from draftflow.core.target import TARGET_HANDLE


def check_roles(plan):
    """Exactly one target and exactly one verifier; at most one draft-length policy."""
    for role, fix in (("target", "add a target node (e.g. plugin: target)"), ("verifier", "add a verifier node (plugin: verifier)")):
        names = [n for n, r in plan.nodes.items() if r.manifest.role == role]
        if not names and not _unresolved(plan):
            yield Problem("", "role", f"the graph has no {role}", fix, "", plan.spec.at("nodes"))
        for extra in names[1:]:
            yield Problem(extra, "role", f"a second {role} (the first is '{names[0]}')", f"keep exactly one {role} node",
                          plan.nodes[extra].node_type.name, plan.spec.node(extra).where)
    policies = [n for n, r in plan.nodes.items() if r.manifest.role == "policy"]
    for extra in policies[1:]:
        yield Problem(extra, "role", f"a second draft-length policy (the first is '{policies[0]}')",
                      "keep one policy node (it chooses every cycle's K)", plan.nodes[extra].node_type.name,
                      plan.spec.node(extra).where)


def check_buffers(plan):
    """A buffer has one owner; only its owner writes it; every read buffer is owned by someone."""
    for info in plan.buffers.values():
        for extra in info.owners[1:]:
            yield _p(plan, extra, "buffer-owner", f"buffer {info.name!r} is also owned by '{info.owners[0]}'",
                     "give each buffer one owner; the other node should declare it under reads")
        for writer in info.writers:
            if writer not in info.owners:
                owner = f"'{info.owners[0]}'" if info.owners else "no node"
                yield _p(plan, writer, "buffer-write", f"writes buffer {info.name!r}, which is owned by {owner}",
                         "only the owner may write a buffer; read it instead, or move ownership")
        # A node that could not describe itself (its own problem is reported) may be the owner: no knock-on problem.
        if not info.owners and not _unresolved(plan):
            for reader in info.readers:
                yield _p(plan, reader, "buffer-missing", f"reads buffer {info.name!r}, which no node owns",
                         "add the node that provides it (see `draftflow plugins`)")


def check_capabilities(plan):
    """Required capabilities are provided; declared incompatibilities are absent (either side declares).

    A capability that a node which failed its params or manifest can provide is not
    reported missing: that node's own problem is the cause, and fixing it may provide it.
    """
    provided = {}
    for name, r in plan.nodes.items():
        for cap in r.manifest.provides:
            provided.setdefault(cap, []).append(name)
    pending = {cap for u in plan.unresolved.values() for cap in u.node_type.capabilities}
    for name, r in plan.nodes.items():
        for cap in sorted(r.manifest.requires):
            if cap in provided or cap in pending:
                continue
            if cap == TARGET_HANDLE:
                yield _missing_target(plan, name)
            else:
                yield _p(plan, name, "capability", f"requires capability {cap!r}, which no node in the graph provides",
                         f"add or configure a node that provides {cap!r}")
        for inc in r.manifest.incompatible:
            for other in provided.get(inc.capability, []):
                if other != name:
                    yield _p(plan, name, "incompatible", f"cannot run with '{other}', which provides {inc.capability!r}: {inc.reason}",
                             f"reconfigure '{other}' so it does not provide {inc.capability!r}, or remove one of the two")


def _missing_target(plan, node):
    """The capability problem of a node that needs the target interface: says whether the target is absent or lacks it."""
    targets = [n for n, r in plan.nodes.items() if r.manifest.role == "target"]
    needs = f"needs the target's interface ({TARGET_HANDLE!r}: tokenizer, embedding, LM head, feature taps)"
    if not targets:
        return _p(plan, node, "capability", f"{needs}, which only a target node provides, and the graph has no target node",
                  "add a target node, e.g. `target: {plugin: target, params: {path: MODEL_DIR}}`")
    plugin = plan.nodes[targets[0]].node_type.name
    return _p(plan, node, "capability", f"{needs}, which target '{targets[0]}' ({plugin}) does not provide",
              f"use a target plugin that provides {TARGET_HANDLE!r} (the built-in `target` does), or remove '{node}'")


def _p(plan, node, rule, message, fix):
    r = plan.nodes.get(node)
    return Problem(node, rule, message, fix, r.node_type.name if r else "", plan.spec.node(node).where if plan.spec.node(node) else "")


def _unresolved(plan) -> bool:
    # A node whose plugin is unknown may be the missing role; don't pile on a second error.
    return len(plan.nodes) < len(plan.spec.nodes)


@hookimpl
def draftflow_add_checks(registry):
    registry.add_check("role", check_roles)
    registry.add_check("buffers", check_buffers)
    registry.add_check("capabilities", check_capabilities)
    registry.add_check("plugin-import", plugin_import_check(registry))
