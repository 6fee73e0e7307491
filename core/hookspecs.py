"""The whole plugin contract of draftflow, sectioned by phase.

A plugin is a module (or object) with functions named like the hooks below, marked with
``@draftflow.core.hookspecs.hookimpl``, published under the entry-point group
``draftflow``. Built-in nodes register through exactly the same group. Every hook here is
documented in docs/PLUGINS.md (a test enforces it). Implementations of hooks that are not
declared here are rejected when plugins load.
"""

from __future__ import annotations

import pluggy

PROJECT = "draftflow"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --- register -------------------------------------------------------------------------
@hookspec
def draftflow_register_nodes(registry):
    """Add node types to the registry.

    :param registry: the ``draftflow.core.registry.Registry``; call
        ``registry.add_node_type(NodeType(...))`` once per node type.
    :return: ignored. All implementations are called.
    """


# --- check ----------------------------------------------------------------------------
@hookspec
def draftflow_add_checks(registry):
    """Add static graph checks that run before anything is allocated.

    :param registry: the ``Registry``; call ``registry.add_check(name, fn)`` where
        ``fn(plan) -> Iterable[Problem]`` inspects a ``draftflow.core.plan.GraphPlan``.
    :return: ignored. All implementations are called.
    """


# --- compose ------------------------------------------------------------------------
@hookspec
def draftflow_target_params(plugin, params, target):
    """Say what a node of your plugin needs of the target's params in a shortcut graph.

    ``draftflow generate --target T --dflash D`` builds its graph without YAML; for each
    drafter node it asks every plugin, and merges the answers into the target's params
    (list values are unioned, in order), e.g. DFlash answers ``{"tap_layers": [1, 2]}``.

    :param plugin: the node type name (answer only for your own node types).
    :param params: the node's params as given (not yet validated).
    :param target: the target's ``TargetInfo`` (from its config), or None when unreadable.
    :return: a dict of target params, or None. All implementations are called; a
        ``DraftflowError`` raised here is left to the node's own check to report.
    """


@hookspec
def draftflow_shortcut_defaults(plugin, params):
    """Say which graph-level values a shortcut graph with a node of your plugin should default to.

    ``draftflow generate --target T --dflash D`` asks for each drafter node, e.g. DFlash
    answers ``{"num_draft": block_size - 1}`` (the block shape it was trained on). Several
    answers for one key: the largest wins (a mixer of lookup and DFlash drafts DFlash's
    block). Explicit flags (``--spec``, ``--set``) are applied afterwards and always win.

    :param plugin: the node type name (answer only for your own node types).
    :param params: the node's params as given (not yet validated).
    :return: a dict of top-level graph keys to integers (today only ``num_draft``), or
        None. All implementations are called; a ``DraftflowError`` raised here is dropped
        (the node's own check reports it).
    """


# --- trace ----------------------------------------------------------------------------
@hookspec
def draftflow_cycle_event(event):
    """Receive one ``draft_cycle`` event, after the cycle has committed (a trace sink).

    :param event: a dict with the fields documented in docs/TRACING.md (request_id, cycle,
        position, anchor, draft, accepted, emitted, draft_ms, verify_ms, commit_ms, ...).
        Treat it as read-only.
    :return: ignored. All implementations are called, outside the timed part of the cycle.
    """


@hookspec
def draftflow_request_event(event):
    """Receive one ``request_done`` event when a request finishes (a trace sink).

    :param event: a dict with request_id, tokens, cycles, tau, acceptance_rate,
        per_position_acceptance, tokens_per_s, ttft_s, prefill_ms, load_s, warmup_s,
        finish_reason (stop, length or cancelled). Read-only.
    :return: ignored. All implementations are called.
    """
